"""Durability: a lost store heals without a rebuild, and commits keep pace on a saturated host.

    .venv/bin/python bench/durability.py --trials 10

Part 1, re-replication. A 2-rank job (the example, tiny GPT) trains on a stack with three stores and
replication 2; every service is started again 1 s after it dies. Each trial SIGKILLs a store that holds
snapshots, while they stream, and times from the kill:
- `placement_s`: until the swapper knows (a new placement without the store, or the store seen back,
  empty, under a new incarnation);
- `rereplicate_s`: until every rank's committed step has its 2 live copies again (made store to
  store, or a newer step committed under the new placement, whichever comes first);
- `commit_resume_s`: until the first commit after the swapper knew (a step stored under the new
  placement, or on the store back);
- the generation, which must not change (no rebuild).

Part 2, commit lag. The 4-rank demo job (GPT 'small') with a busy loop per core beside it (the CPU saturated). At every
step completion a member reports (its own clock, heartbeats every 0.1 s), the lag is the step every
rank has completed minus the step committed at that moment. Goal: at most 1.

Part 3, the durable tier. The 2-rank job (GPT `--durable-model-size`, default 'small') runs
`--durable-steps` steps twice, alternating, with in-memory snapshots every step both times, and
persisting every `--durable-every-steps` steps the second time:
- `durable_step_time_ratio`: median step time with the durable tier over without (goal <= 1.01);
- `persist_gbps`: bytes persisted per second of the writer thread's time (all ranks; a 'small'
  snapshot is 5 MB, so fixed costs, fsync among them, dominate), and `persist_gbps_large` /
  `load_gbps_large`: the same files written and read back (verified) for one `--large-mib` snapshot;
- `resume_s`: from launching a job with `--resume-from` to the first step every rank completed, and
  `fresh_start_s`, the same for a job that starts fresh (the difference is what resuming costs).

A table, then one JSON line. Goals: rereplicate_s_p99 <= 5, commit_lag_steps_max <= 1, generations
unchanged by store loss, durable_step_time_ratio <= 1.01.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from measures import percentile
from nats.aio.client import Client

from deadpool_cli.demo import default_script
from deadpool_cli.job_watch import JobWatch
from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol import SWAPPER_STATUS, Commit, Subjects, decode
from deadpool_runtime.logs import get_logger

GOAL = {
    "rereplicate_s_p99_max": 5.0,
    "commit_lag_steps_max": 1,
    "generation_changes": 0,
    "durable_step_time_ratio_max": 1.01,
}
STORES = 3
TRIAL_WAIT_S = 30.0
POLL_S = 0.02
FOREVER_STEPS = 1_000_000


class Commits:
    """Every commit of one job, with when it arrived."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, int]] = []

    async def on_commit(self, msg: Any) -> None:
        self.seen.append((time.time(), decode(msg.data, Commit).step))

    def at(self, t: float) -> int:
        """The step committed at time `t` (-1 before the first commit)."""
        return max((step for when, step in self.seen if when <= t), default=-1)


async def status(nc: Client, job: str) -> dict[str, Any]:
    try:
        reply = await nc.request(SWAPPER_STATUS, job.encode(), timeout=2.0)
        body: dict[str, Any] = json.loads(reply.data)
        return body
    except Exception:
        return {}


async def launch(
    nats_args: list[str],
    job: str,
    nproc: int,
    steps: int,
    model: str,
    log: Path,
    *flags: str,
    env: dict[str, str] | None = None,
) -> asyncio.subprocess.Process:
    command = [sys.executable, "-m", "deadpool_cli", "launch", *nats_args, "--job", job]
    command += ["--nproc", str(nproc), "--spares", "0", *flags, str(default_script()), "--steps", str(steps)]
    command += ["--model-size", model]
    with open(log, "wb") as sink:
        return await asyncio.create_subprocess_exec(
            *command, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )


async def stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()


async def wait_until(predicate: Any, timeout_s: float) -> float | None:
    """Poll `predicate` (a coroutine function) until true; the time it became true, or None."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if await predicate():
            return time.time()
        await asyncio.sleep(POLL_S)
    return None


async def rereplication(args: argparse.Namespace, stack: Stack, nc: Client, workdir: Path) -> dict[str, Any]:
    job = "durability-rereplicate"
    commits = Commits()
    await nc.subscribe(Subjects.for_job(job).commit, cb=commits.on_commit)
    launcher = await launch(stack.nats_args, job, 2, FOREVER_STEPS, args.model_size, workdir / "rereplicate-run.log")
    rng = random.Random(args.seed)
    trials: list[dict[str, Any]] = []
    try:
        whole = await wait_until(lambda: _whole(nc, job, commits), 180.0)
        if whole is None:
            raise SystemExit("the job did not form with its replicas")
        generation = (await status(nc, job))["generation"]
        for trial in range(args.trials):
            await wait_until(lambda: _whole(nc, job, commits), TRIAL_WAIT_S)
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            before = await status(nc, job)
            placed = sorted({n for names in before["placement"] for n in names})
            name = rng.choice(placed)
            incarnation = next(s.get("incarnation", "") for s in before["stores"] if s["store"] == name)
            version = before["placement_version"]
            t0 = time.time()
            stack.kill(name)

            async def known(name: str = name, incarnation: str = incarnation, version: int = version) -> bool:
                now = await status(nc, job)
                if not now:
                    return False
                back = any(s["store"] == name and s.get("incarnation", "") != incarnation for s in now["stores"])
                return back or now["placement_version"] != version

            async def healed(known: Any = known) -> bool:
                now = await status(nc, job)
                return bool(now) and now.get("replicas_short", 1) == 0 and await known()

            t_known = await wait_until(known, TRIAL_WAIT_S)
            t_healed = await wait_until(healed, TRIAL_WAIT_S)
            since = t_known or t0

            async def committed(since: float = since) -> bool:
                return any(t > since for t, _ in commits.seen)

            await wait_until(committed, TRIAL_WAIT_S)
            after = [t for t, _ in commits.seen if t > since]
            row = {
                "store": name,
                "placement_s": None if t_known is None else round(t_known - t0, 4),
                "rereplicate_s": None if t_healed is None else round(t_healed - t0, 4),
                "commit_resume_s": round(after[0] - t0, 4) if after else None,
                "generation": (await status(nc, job)).get("generation"),
            }
            trials.append(row)
            print(
                f"trial {trial:2d}: killed {name}; known after {row['placement_s']} s, replicas again after "
                f"{row['rereplicate_s']} s, next commit after {row['commit_resume_s']} s, "
                f"generation {row['generation']}",
                flush=True,
            )
    finally:
        await stop(launcher)
    times = [t["rereplicate_s"] for t in trials if t["rereplicate_s"] is not None]
    resumes = [t["commit_resume_s"] for t in trials if t["commit_resume_s"] is not None]
    return {
        "trials": trials,
        "rereplicate_s_p50": round(statistics.median(times), 4) if times else None,
        "rereplicate_s_p99": round(percentile(times, 99), 4) if times else None,
        "rereplicate_s_max": round(max(times), 4) if times else None,
        "commit_resume_s_p50": round(statistics.median(resumes), 4) if resumes else None,
        "not_healed": len(trials) - len(times),
        "generation_changes": sum(t["generation"] != generation for t in trials),
    }


async def _whole(nc: Client, job: str, commits: Commits) -> bool:
    """Formed, committing, and every rank's committed step on as many live stores as placed."""
    now = await status(nc, job)
    live = {s["store"] for s in now.get("stores", [])}
    placed = {n for names in now.get("placement", []) for n in names}
    recent = bool(commits.seen) and time.time() - commits.seen[-1][0] < 2.0
    return bool(now) and now.get("replicas_short", 1) == 0 and len(live) == STORES and placed <= live and recent


async def commit_lag(args: argparse.Namespace, stack: Stack, nc: Client, workdir: Path) -> dict[str, Any]:
    job = "durability-lag"
    commits = Commits()
    await nc.subscribe(Subjects.for_job(job).commit, cb=commits.on_commit)
    watch = JobWatch(nc, job, get_logger(job=job))
    await watch.start()
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs or os.cpu_count() or 2)
    ]
    started = time.time()
    try:
        launcher = await launch(stack.nats_args, job, 4, args.lag_steps, args.lag_model_size, workdir / "lag-run.log")
        returncode = await launcher.wait()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    wall_s = time.time() - started
    latest: dict[int, int] = {}
    lags: list[int] = []
    for done in sorted(watch.steps_done, key=lambda d: d.t):
        latest[done.rank] = max(latest.get(done.rank, -1), done.step)
        if len(latest) < 4 or not commits.seen or done.t < commits.seen[0][0]:
            continue  # forming: nothing committed yet to trail
        lags.append(min(latest.values()) - commits.at(done.t))
    step_times = [s for v in watch.members.values() for s in v.step_times]
    return {
        "returncode": returncode,
        "commit_lag_steps_max": max(lags) if lags else None,
        "commit_lag_steps_p50": statistics.median(lags) if lags else None,
        "lag_samples": len(lags),
        "lag_step_s_median": round(statistics.median(step_times), 4) if step_times else None,
        "lag_hogs": len(hogs),
        "lag_model_size": args.lag_model_size,
        "lag_wall_s": round(wall_s, 1),
    }


def member_stats(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


async def first_step_s(nc: Client, nats_args: list[str], job: str, workdir: Path, *flags: str) -> float:
    """From launching a 2-rank job to the first step every rank completed (the job is then stopped)."""
    watch = JobWatch(nc, job, get_logger(job=job))
    await watch.start()
    started = time.time()
    launcher = await launch(nats_args, job, 2, FOREVER_STEPS, "small", workdir / f"{job}.log", *flags)

    def every_rank_stepped() -> bool:
        ranks = {d.rank for d in watch.steps_done}
        return len(ranks) == 2

    try:
        await asyncio.wait_for(watch.wait_for(every_rank_stepped), 300)
        firsts: dict[int, float] = {}
        for done in watch.steps_done:
            firsts.setdefault(done.rank, done.t)
        return max(firsts.values()) - started
    finally:
        await stop(launcher)


async def durable_tier(args: argparse.Namespace, stack: Stack, nc: Client, workdir: Path) -> dict[str, Any]:
    model, steps, every = args.durable_model_size, args.durable_steps, args.durable_every_steps
    durable = workdir / "durable"
    ratios: list[float] = []
    medians: dict[str, list[float]] = {"off": [], "on": []}
    written, seconds, persisted, skipped = 0, 0.0, 0, 0
    for round_ in range(args.durable_rounds):
        for mode in ("off", "on"):
            stats = workdir / f"stats-{mode}-{round_}"
            stats.mkdir()
            flags = ("--durable-dir", str(durable), "--durable-every-steps", str(every)) if mode == "on" else ()
            job = f"durability-{mode}-{round_}"
            env = {"DEADPOOL_STATS_DIR": str(stats)}
            launcher = await launch(stack.nats_args, job, 2, steps, model, workdir / f"{job}.log", *flags, env=env)
            if await launcher.wait() != 0:
                raise SystemExit(f"{job} failed: see {workdir / f'{job}.log'}")
            members = member_stats(stats)
            step_s = [s["step_s"] for m in members for s in m["steps"][2:]]  # past the first steps' warm-up
            medians[mode].append(statistics.median(step_s))
            if mode == "on":
                written += sum(m.get("durable_bytes", 0) for m in members)
                seconds += sum(m.get("durable_s", 0.0) for m in members)
                persisted += sum(m.get("durable_persisted", 0) for m in members)
                skipped += sum(m.get("durable_skipped", 0) for m in members)
        ratios.append(medians["on"][-1] / medians["off"][-1])
        print(
            f"durable round {round_}: step {medians['off'][-1]:.4f} s without, {medians['on'][-1]:.4f} s with "
            f"(ratio {ratios[-1]:.4f})",
            flush=True,
        )
    large = await asyncio.to_thread(large_snapshot_gbps, workdir / "large", args.large_mib)
    resume_s = await first_step_s(nc, stack.nats_args, "durability-resumed", workdir, "--resume-from", str(durable))
    fresh_s = await first_step_s(nc, stack.nats_args, "durability-fresh", workdir)
    return {
        "durable_step_time_ratio": round(statistics.median(ratios), 4),
        "durable_step_time_ratios": [round(r, 4) for r in ratios],
        "durable_step_s_off": round(statistics.median(medians["off"]), 4),
        "durable_step_s_on": round(statistics.median(medians["on"]), 4),
        "persist_gbps": round(written / seconds / 1e9, 4) if seconds else None,
        "persisted": persisted,
        "persist_skipped": skipped,
        "persisted_bytes": written,
        "resume_s": round(resume_s, 3),
        "fresh_start_s": round(fresh_s, 3),
        "durable_model_size": model,
        **large,
    }


def large_snapshot_gbps(directory: Path, mib: int) -> dict[str, Any]:
    """Write and read back (verifying every checksum) one snapshot of `mib` MiB in 16 tensors."""
    from deadpool.durable_tier import load_rank, write_step
    from deadpool.snapshot_layout import FlatBuffer, plan_layout
    from deadpool.state_tree import encode_tree
    from deadpool.training_state import WHOLE, SnapshotMeta

    tensors = [torch.randn(mib * 2**20 // 16 // 4) for _ in range(16)]
    layout = plan_layout([(f"param.{i}", t) for i, t in enumerate(tensors)])
    buffer = FlatBuffer(layout)
    torch._foreach_copy_(buffer.views, tensors)
    tree, _ = encode_tree({"groups": [], "optim": {}, "user": {}})
    meta = SnapshotMeta(1, layout, {}, tree, {}, WHOLE, 0).encode()
    started = time.perf_counter()
    write_step(directory, "large", 1, 0, 1, 1, buffer, meta)
    written_s = time.perf_counter() - started
    started = time.perf_counter()
    loaded, _ = load_rank(directory, 1, 0, 1)
    read_s = time.perf_counter() - started
    assert all(torch.equal(loaded.by_name[n], v) for n, v in buffer.by_name.items())
    nbytes = layout.total_bytes
    return {
        "persist_gbps_large": round(nbytes / written_s / 1e9, 3),
        "load_gbps_large": round(nbytes / read_s / 1e9, 3),
        "large_bytes": nbytes,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="deadpool-durability-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"work dir {workdir}", flush=True)
    config = StackConfig(workdir=workdir, stores=STORES, replication=2, restart_after_s=1.0)
    async with Stack(config) as stack:
        nc = await stack.connect()
        result: dict[str, Any] = {}
        if args.trials:
            result |= await rereplication(args, stack, nc, workdir)
        if args.lag_steps:
            result |= await commit_lag(args, stack, nc, workdir)
        if args.durable_rounds:
            result |= await durable_tier(args, stack, nc, workdir)
        await nc.close()
    result["goal"] = GOAL
    rereplicate_p99 = result.get("rereplicate_s_p99")
    lag_max = result.get("commit_lag_steps_max")
    result["goal_met"] = (
        rereplicate_p99 is not None
        and rereplicate_p99 <= GOAL["rereplicate_s_p99_max"]
        and result.get("not_healed", 1) == 0
        and result.get("generation_changes", 1) == 0
        and lag_max is not None
        and lag_max <= GOAL["commit_lag_steps_max"]
        and (result.get("durable_step_time_ratio") or float("inf")) <= GOAL["durable_step_time_ratio_max"]
    )
    result["work_dir"] = str(workdir)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10, help="stores killed, one after another (0: skip)")
    parser.add_argument("--lag-steps", type=int, default=60, help="steps of the saturated-host run (0: skip)")
    parser.add_argument("--hogs", type=int, default=0, help="busy loops beside it (default: one per core)")
    parser.add_argument("--model-size", default="tiny", help="model of the re-replication job")
    parser.add_argument("--lag-model-size", default="small", help="model of the saturated-host job (the demo's)")
    parser.add_argument("--durable-rounds", type=int, default=3, help="pairs of runs without/with it (0: skip)")
    parser.add_argument("--durable-steps", type=int, default=40)
    parser.add_argument("--durable-every-steps", type=int, default=10)
    parser.add_argument("--durable-model-size", default="small")
    parser.add_argument("--large-mib", type=int, default=1024, help="the large snapshot written and read back")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", default="")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print("")
    print(f"{'figure':>28} {'value':>10} {'goal':>8}")
    rows = [
        ("rereplicate_s p50", result.get("rereplicate_s_p50"), ""),
        ("rereplicate_s p99", result.get("rereplicate_s_p99"), "<= 5"),
        ("commit_resume_s p50", result.get("commit_resume_s_p50"), ""),
        ("stores not healed", result.get("not_healed"), "0"),
        ("generations changed", result.get("generation_changes"), "0"),
        ("commit lag max (steps)", result.get("commit_lag_steps_max"), "<= 1"),
        ("commit lag p50 (steps)", result.get("commit_lag_steps_p50"), ""),
        ("durable step-time ratio", result.get("durable_step_time_ratio"), "<= 1.01"),
        ("persist GB/s (job)", result.get("persist_gbps"), ""),
        ("persist GB/s (large)", result.get("persist_gbps_large"), ""),
        ("load GB/s (large)", result.get("load_gbps_large"), ""),
        ("resume to first step (s)", result.get("resume_s"), ""),
        ("fresh start to first step (s)", result.get("fresh_start_s"), ""),
    ]
    for name, value, goal in rows:
        print(f"{name:>28} {value!s:>10} {goal:>8}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
