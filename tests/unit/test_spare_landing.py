"""A warm spare's landing buffer: faulted in to the largest snapshot heard, never past the model's
bound, taken once and exactly as long as the snapshot."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from deadpool.spare_landing import FAULT_SLICE_BYTES, SpareLanding
from deadpool_runtime.logs import get_logger

pytestmark = pytest.mark.unit

WAIT_S = 30.0


def warm(landing: SpareLanding, nbytes: int) -> None:
    landing.start()
    assert landing.wait_faulted(nbytes, WAIT_S), f"{landing.faulted_bytes} of {nbytes} bytes faulted in"


def test_the_landing_is_the_largest_snapshot_heard_and_is_taken_once_exactly_as_long_as_the_snapshot() -> None:
    landing = SpareLanding(64 << 20, pin=False, log=get_logger(test="landing"))
    landing.want(3 << 20)
    landing.want(5 << 20)
    landing.want(1 << 20)  # smaller: the landing never shrinks
    warm(landing, 5 << 20)
    got = landing.take(4 << 20)
    assert got is not None and got.numel() == 4 << 20 and got.dtype == torch.uint8
    assert int(got.sum()) == 0, "faulted in by writing it"
    assert landing.take(4 << 20) is None, "a landing is taken once: the buffer is now the restored rank's"
    assert landing.faulted_bytes == 0
    assert not landing.want(6 << 20), "a spent landing wants no more sizes (its member stops hearing commits)"


def test_a_size_past_the_models_bound_faults_in_the_bound_only_and_a_larger_snapshot_is_not_taken() -> None:
    limit = 2 * FAULT_SLICE_BYTES + 4096
    landing = SpareLanding(limit, pin=False, log=get_logger(test="landing"))
    with capture_logs() as logs:
        landing.want(1 << 40)  # what a hostile message could name: 1 TiB
    assert any("larger than this model's can be" in e["event"] for e in logs)
    warm(landing, limit)
    assert landing.faulted_bytes == limit
    assert landing.take(limit + 1) is None, "a snapshot larger than the landing is allocated by the restore"


def test_a_take_before_anything_was_heard_gets_nothing_and_a_closed_landing_holds_nothing() -> None:
    landing = SpareLanding(64 << 20, pin=False, log=get_logger(test="landing"))
    landing.start()
    assert landing.take(1 << 20) is None
    other = SpareLanding(64 << 20, pin=False, log=get_logger(test="landing"))
    other.want(1 << 20)
    warm(other, 1 << 20)
    other.close()
    assert other.faulted_bytes == 0 and other.take(1 << 20) is None


def test_a_larger_snapshot_heard_after_the_landing_is_warm_grows_it() -> None:
    landing = SpareLanding(64 << 20, pin=False, log=get_logger(test="landing"))
    landing.want(1 << 20)
    warm(landing, 1 << 20)
    landing.want(3 << 20)
    warm(landing, 3 << 20)
    got = landing.take(3 << 20)
    assert got is not None and got.numel() == 3 << 20


def test_a_landing_given_back_unused_is_taken_again_by_the_next_restore_and_not_once_closed() -> None:
    """A newcomer takes its landing for the crash copy; when the ranks find no step in common, the
    store restore of the swapper's next link fetches into the same warm memory."""
    landing = SpareLanding(64 << 20, pin=False, log=get_logger(test="landing"))
    landing.want(4 << 20)
    warm(landing, 4 << 20)
    first = landing.take(4 << 20)
    assert first is not None
    landing.give_back()
    again = landing.take(3 << 20)
    assert again is not None and again.data_ptr() == first.data_ptr() and again.numel() == 3 << 20
    landing.close()
    landing.give_back()  # closed (a rank now): nothing comes back
    assert landing.take(1 << 20) is None
