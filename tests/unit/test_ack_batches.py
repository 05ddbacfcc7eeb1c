"""A launcher stores its members' rebuild acks as one event: the swapper takes each ack as it would
alone, once however often it comes, and refuses an ack for a member another launcher runs."""

from __future__ import annotations

import pytest

from deadpool_protocol import MemberHello, Rebuild, RebuildAckBatch, RestoreSource, StoreStatus
from deadpool_swapper.core import SwapperConfig, SwapperCore
from tests.unit.test_swapper_core import ack, published

pytestmark = pytest.mark.unit


def unformed(ranks: int = 4) -> tuple[SwapperCore, Rebuild]:
    """A formation of `ranks` ranks, two per host, each host's members run by its own launcher."""
    core = SwapperCore(SwapperConfig(replication=1, store_timeout_s=1e9))
    core.on_store_status(StoreStatus("store0", "127.0.0.1", 5000, 0, 100, 0, 0.0), 0.0)
    decisions = [
        core.on_hello(
            MemberHello("j", 0, f"r{r}", f"h{r // 2}", 100, f"l-h{r // 2}", r, ranks, "127.0.0.1", 4000, 0.0), 0.1
        )[1]
        for r in range(ranks)
    ]
    (formation,) = [r for d in decisions for r in published(d, Rebuild)]
    return core, formation


def batch(formation: Rebuild, launcher: str, members: list[str]) -> RebuildAckBatch:
    acks = [ack(formation, m, 1.0, source=RestoreSource.FRESH) for m in members]
    return RebuildAckBatch("j", formation.generation, launcher, acks)


def test_a_batch_per_host_forms_the_generation_as_acks_one_by_one_would() -> None:
    core, formation = unformed()
    first = core.on_ack_batch(batch(formation, "l-h0", ["r0", "r1"]), 1.0)
    assert first.routine and core.jobs["j"].recovery.pending is not None
    assert core.on_ack_batch(batch(formation, "l-h0", ["r0", "r1"]), 1.1).routine  # again: nothing new
    pending = core.jobs["j"].recovery.pending
    assert pending is not None and len(pending.acks) == 2
    formed = core.on_ack_batch(batch(formation, "l-h1", ["r2", "r3"]), 1.2)
    assert core.jobs["j"].recovery.pending is None and core.jobs["j"].recovery.formed
    assert "every rank acked" in formed.reason


def test_an_ack_for_a_member_another_launcher_runs_is_refused_and_not_counted() -> None:
    core, formation = unformed()
    decision = core.on_ack_batch(batch(formation, "l-h0", ["r0", "r2"]), 1.0)
    assert "ack of r2 from launcher l-h0, which does not run it: refused" in decision.reason
    pending = core.jobs["j"].recovery.pending
    assert pending is not None and set(pending.acks) == {"r0"}
