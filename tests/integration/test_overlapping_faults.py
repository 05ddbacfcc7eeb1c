"""Faults that overlap never wedge a job, and the result stays bit-identical.

The example job (4 ranks, warm spares, respawns) under a control plane with two swappers and two
detectors: first two ranks are SIGKILLed 15 ms apart (the case that once stacked generations until
every member gave up after 300 s), then a rank is SIGKILLed and a second one as soon as the rebuild
that replaces the first is seen. The job must finish, each pair of failures must be closed by one
generation, and the final weights must equal an uninterrupted run's (`torch.equal`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states

from .jobs import every_rank_at, finish, kill, launch, rank_steps, stop_all, until, watcher

STEPS = 350
"""The second pair of kills comes at about step 170 here (once two spares are warm again after the
first pair): 350 leaves it as many steps again."""


async def test_overlapping_kills_are_swapped_and_training_ends_bit_identical(tmp_path: Path) -> None:
    config = StackConfig(workdir=tmp_path, stores=2, swappers=2, detectors=2, heartbeat_timeout_s=2.0, hang_floor_s=3.0)
    async with Stack(config) as stack:
        nc, watch = await watcher(stack, "overlap")
        log = tmp_path / "swap.log"
        launcher = await launch(
            stack.nats_args, "overlap", log, steps=STEPS, spares=3, respawns=6, out=tmp_path / "swap"
        )

        def ready(need: int) -> bool:
            return len(watch.ready_spares(time.time())) >= need

        def newer_than(generation: int) -> bool:
            return watch.rebuild is not None and watch.rebuild.generation > generation

        try:
            await until(watch, lambda: every_rank_at(watch, 10) and ready(3), log, "training, 3 warm spares")
            assert watch.rebuild is not None
            before = watch.rebuild.generation
            kill(watch, watch.rebuild.ranks[1])
            await asyncio.sleep(0.015)
            kill(watch, watch.rebuild.ranks[3])
            await until(watch, lambda: len(watch.incidents) >= 2, log, "both kills recovered")
            double = watch.incidents[:2]

            step = max(rank_steps(watch))
            await until(watch, lambda: every_rank_at(watch, step + 10) and ready(2), log, "training, 2 warm spares")
            assert watch.rebuild is not None
            generation = watch.rebuild.generation
            kill(watch, watch.rebuild.ranks[0])
            await until(watch, lambda: newer_than(generation), log, "the rebuild replacing rank 0")
            assert watch.rebuild is not None
            # A survivor, in the middle of the takeover: at once, since its exit reaches the swapper some
            # 50 ms later, and a takeover here once completed 65 ms after its rebuild was published.
            kill(watch, watch.rebuild.ranks[2])
            returncode = await finish(launcher, log)
        finally:
            stop_all(launcher)
        assert returncode == 0
        assert {i.rank for i in double} == {1, 3} and len({i.generation for i in double}) == 1, double
        assert double[0].generation > before
        said = [(i.incident_id, i.generation, i.rank, i.member, i.replacement) for i in watch.incidents]
        assert len(watch.incidents) == 4 and len({i.generation for i in watch.incidents[2:]}) == 1, said
        # From a crash copy at most 1 step; a rank restored from the stores (its rebuild superseded) at most
        # 2K-1 for the job's snapshot interval K (1 while the stores keep up).
        bound = 2 * watch.snapshot_every_max - 1
        assert all(i.lost_steps <= max(1, bound) for i in watch.incidents), (bound, watch.incidents)

        ref_log = tmp_path / "ref.log"
        reference = await launch(stack.nats_args, "overlap-ref", ref_log, steps=STEPS, spares=0, out=tmp_path / "ref")
        assert await finish(reference, ref_log) == 0
        await nc.close()
    identical, tensors, differences = compare_final_states(tmp_path / "swap", tmp_path / "ref")
    assert identical and tensors > 0, differences[:5]
