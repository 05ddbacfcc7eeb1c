from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def gloo_world_of_one() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
