"""The swap scheduler: membership, generations, spares and the rebuild protocol."""

from deadpool_swapper.core import SwapperConfig, SwapperCore
from deadpool_swapper.service import SwapperServiceConfig, main

__all__ = ["SwapperConfig", "SwapperCore", "SwapperServiceConfig", "main"]
