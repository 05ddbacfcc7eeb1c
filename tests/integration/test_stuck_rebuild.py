"""A member stuck inside its own rebuild is declared and swapped: the detector bounds it from outside.

Real processes, the real control plane, a script whose optimizer factory (run in the rebuild's APPLY
state) never returns on one rank of the formation. Its peer finishes the rebuild, trains, and its
first collective times out; before this bound, the stuck rank said "rebuilding" for ever, which no
rule could name (it counts as waiting, and a broken group needs every rank awaiting), and the job
waited until the survivor's own 300 s bound ended it. Now it is declared `hang` `rebuild_lag_s` (30 s)
after its peer finished, fenced, and a spare takes its rank: the job finishes.
"""

from __future__ import annotations

from pathlib import Path

from deadpool_cli.stack import Stack, StackConfig

from .jobs import finish, launch, stop_all, tail, until, watcher

SCRIPT = Path(__file__).parent / "scripts" / "stuck_factory.py"
STEPS = 20


async def test_a_rank_stuck_in_its_rebuild_after_its_peer_finished_is_declared_and_swapped(tmp_path: Path) -> None:
    config = StackConfig(workdir=tmp_path, stores=1, replication=1, heartbeat_timeout_s=2.0, hang_floor_s=3.0)
    flags = tmp_path / "flags"
    flags.mkdir()
    async with Stack(config) as stack:
        nc, watch = await watcher(stack, "stuck")
        log = tmp_path / "launch.log"
        launcher = await launch(
            stack.nats_args,
            "stuck",
            log,
            steps=STEPS,
            nproc=2,
            spares=1,
            script=SCRIPT,
            env={"STUCK_FACTORY_DIR": str(flags)},
        )
        try:
            await until(watch, lambda: len(watch.incidents) >= 1, log, "the stuck rank swapped", timeout_s=120.0)
            returncode = await finish(launcher, log, timeout_s=120.0)
        finally:
            stop_all(launcher)
        assert (flags / "blocked").exists(), "the script should have blocked one rank"
        assert returncode == 0, tail(log)
        stuck = {f.member for f in watch.failures}
        assert len(stuck) == 1, [(f.member, f.reason, f.evidence) for f in watch.failures]
        failure = watch.failures[0]
        assert failure.reason == "hang" and "finished its rebuild" in failure.evidence["stuck_in_rebuild"]
        assert float(failure.evidence["behind_s"]) >= 30.0
        (incident,) = watch.incidents
        assert incident.member == failure.member and incident.replacement
        await nc.close()
