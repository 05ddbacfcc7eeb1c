"""The failure detector: one `failure` event per dead member."""

from deadpool_detector.core import DetectorConfig, DetectorCore
from deadpool_detector.service import DetectorServiceConfig, main

__all__ = ["DetectorConfig", "DetectorCore", "DetectorServiceConfig", "main"]
