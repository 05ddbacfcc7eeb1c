"""A warm spare restores into the buffer it faulted in while it waited, and training ends bit-identical.

Real processes: NATS, a detector, a swapper, two stores, and `deadpool launch --no-host-copy` with 2
ranks and a spare (so the swap restores from a store, as a lost host's does). The spare hears the job's
snapshot size from the swapper (the hello's answer, then each commit), faults in its landing buffer,
and once it is warm rank 1 is SIGKILLed: the spare's fetch lands in that buffer (the promoted spare
then stops hearing the job's commits), and the final weights equal an uninterrupted run's, bit for bit.

And with the crash copy on: a newcomer takes its landing to read the dead member's copies into, every
copy fails its checksums (rank 1 frozen, its copies' bytes flipped, then SIGKILLed), the ranks find no
step in common, and the swapper's next link restores from a store: the newcomer gave the landing back
unused, so that fetch lands in the same warm buffer.
"""

from __future__ import annotations

import signal
from pathlib import Path

from deadpool.host_copy_dir import DIR_PREFIX, SHM_ROOT
from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig

from .jobs import assert_same_as_uninterrupted, every_rank_at, finish, kill, launch, stop_all, tail, until, watcher

JOB = "spare-landing"
STEPS = 60


async def rank_1_once_the_landing_is_warm(watch: JobWatch, log: Path) -> str:
    """The member holding rank 1, once the job trains and the spare's landing buffer is faulted in."""
    await until(watch, lambda: every_rank_at(watch, 5), log, "training")
    await until(watch, lambda: "landing buffer warm" in log.read_text(), log, "the spare's landing warm")
    victim = watch.holder_of(1)
    assert victim is not None
    return victim


async def test_a_warm_spare_restores_into_its_faulted_in_landing_and_training_ends_bit_identical(
    tmp_path: Path,
) -> None:
    async with Stack(StackConfig(workdir=tmp_path)) as stack:
        nc, watch = await watcher(stack, JOB)
        log = tmp_path / "job.log"
        no_copy = ("--no-host-copy",)
        launcher = await launch(
            stack.nats_args, JOB, log, steps=STEPS, nproc=2, spares=1, out=tmp_path / "job", launch_args=no_copy
        )
        try:
            victim = await rank_1_once_the_landing_is_warm(watch, log)
            kill(watch, victim, signal.SIGKILL)
            await until(watch, lambda: bool(watch.incidents), log, "the rank swapped")
            incident = watch.incidents[0]
            assert incident.evidence.get("restore_link") == "committed", incident.evidence  # from a store
            assert await finish(launcher, log) == 0, tail(log)
        finally:
            stop_all(launcher)
            await nc.close()
        landed = [line for line in log.read_text().splitlines() if "restore lands in the warm buffer" in line]
        assert len(landed) == 1, tail(log)
        assert "commits no longer heard: the landing was taken" in log.read_text(), "the promoted spare hears on"
        await assert_same_as_uninterrupted(stack, JOB, tmp_path / "job", tmp_path, steps=STEPS, spares=0)


async def test_a_landing_taken_for_crash_copies_that_fail_their_checks_is_given_back_and_the_store_restore_lands_in_it(
    tmp_path: Path,
) -> None:
    job = "landing-given-back"
    async with Stack(StackConfig(workdir=tmp_path)) as stack:
        nc, watch = await watcher(stack, job)
        log = tmp_path / "job.log"
        launcher = await launch(stack.nats_args, job, log, steps=STEPS, nproc=2, spares=1, out=tmp_path / "job")
        try:
            victim = await rank_1_once_the_landing_is_warm(watch, log)
            kill(watch, victim, signal.SIGSTOP)  # no capture rewrites its copies meanwhile
            copies = list(SHM_ROOT.glob(f"{DIR_PREFIX}{job}-*/{victim}/slot-*.bin"))
            assert len(copies) == 3, copies
            for path in copies:
                with open(path, "r+b") as f:
                    first = f.read(1)
                    f.seek(0)
                    f.write(bytes([first[0] ^ 0xFF]))
            kill(watch, victim, signal.SIGKILL)
            await until(watch, lambda: bool(watch.incidents), log, "the rank swapped")
            incident = watch.incidents[0]
            assert incident.evidence.get("restore_link") == "committed", incident.evidence  # the next link
            assert await finish(launcher, log) == 0, tail(log)
        finally:
            stop_all(launcher)
            await nc.close()
        text = log.read_text()
        assert "the landing was given back unused" in text, tail(log)
        landed = [line for line in text.splitlines() if "restore lands in the warm buffer" in line]
        assert len(landed) == 2, "taken for the crash copy, then again for the store's copy"
        await assert_same_as_uninterrupted(stack, job, tmp_path / "job", tmp_path, steps=STEPS, spares=1)
