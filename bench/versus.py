"""DeadPool side by side with torchrun (and torchft, when installed): the same job, the same SIGKILL.

    .venv/bin/python bench/versus.py [--steps 160 --kill-step 56] [--goodput-s 300 --kill-every-s 30]

The job (`versus_train.py`): a language model under DDP on gloo, 2 ranks, each step's batch a function
of the step. Rank 1 SIGKILLs itself in the middle of step --kill-step, once. Per system:

- DeadPool: `deadpool launch` with one warm spare, against one local control plane (credentials on):
  the spare takes the rank, restored from the snapshot stores.
- torchrun: `torch.distributed.run --max-restarts`, every rank saving a `torch.save` checkpoint every K
  steps (K in --checkpoint-every, default 1 and 10); on the failure every rank restarts and resumes
  from the newest complete checkpoint.
- torchft (0.2.0, where installed: `pip install torchft==0.2.0`, else skipped with the reason): one
  replica group per rank, each under its own torchrun (--max-restarts), against a lighthouse
  (min_replicas 1, quorum tick 100 ms, join timeout 10 s, the heartbeat timeout DeadPool's detector
  has here). The survivor goes on alone; the dead replica restarts and heals from it over HTTP. The
  steps a replica sat out are reported as steps_degraded: their batches were never trained on, so
  the weights cannot equal the reference's.

Each system runs --repeats times without the fault (its reference: the same checkpointing) and with
it, interleaved; the figures are medians over the repeats. Reported per system, from the per-step
completion times every process writes:
- time_lost_s: the training phase (step 0 done -> last step done) minus the reference's;
- fault_cost_s: the part of it across the fault: how much further behind the reference the run is 10
  steps after the fault step than just before it (two runs drift apart by a few percent on a busy
  machine before any fault; this leaves the drift out);
- downtime_s: the kill -> the first step every rank completed after it;
- steps_recomputed: steps completed before the kill that were computed again;
- steps_degraded: steps some rank did not complete (trained without its batch); batches_untrained:
  the (step, rank) batches no process completed;
- fault_cost_with_untrained_s: fault_cost_s plus the time the run would need to train the batches it
  skipped (untrained batches / ranks x step_s): the same as fault_cost_s where no step was degraded;
- step_s: the reference's median step time;
- bit_identical: the final weights and optimizer state equal the reference's (torch.equal).
Goal: DeadPool's time lost at least 20x below torchrun's best K (and 5x below torchft's), judged on
fault_cost_s: DeadPool's whole-run difference (a few tenths of a second) is smaller than the drift
between two runs of 80 steps here (up to half a second either way), so its median can even be
negative; both figures are reported.

--goodput-s S adds a goodput run per system: S seconds of training with a SIGKILL of a rank every
--kill-every-s, reporting the effective training fraction: steps x a step time / the wall time of the
training phase, with the reference's step time and with the run's own median step time (its pace
between the faults). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.util
import itertools
import json
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deadpool_cli.nats_server import free_port
from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states

TRAIN = Path(__file__).resolve().parent / "versus_train.py"
RUN_TIMEOUT_S = 900.0
GOALS = {"vs_torchrun_best_k_min": 20.0, "vs_torchft_min": 5.0}
FAULT_WINDOW_STEPS = 10
HEARTBEAT_TIMEOUT_S = 2.0  # the detector's here, and torchft's lighthouse's
RANKS = 2


@dataclass
class Run:
    system: str
    stats_dir: Path
    out: Path
    marker: Path
    returncode: int
    wall_s: float


def completions(stats_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for path in stats_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut by the SIGKILL
    return rows


def training_s(rows: list[dict[str, Any]], steps: int) -> float:
    """Step 0 done -> the last step done (startup and teardown excluded: they are no system's doing)."""
    begin = min(r["t"] for r in rows if r["step"] == 0)
    end = max(r["t"] for r in rows if r["step"] == steps - 1)
    return float(end - begin)


def median_step_s(rows: list[dict[str, Any]]) -> float:
    ts = sorted(r["t"] for r in rows if r["rank"] == 0)
    return float(statistics.median(b - a for a, b in itertools.pairwise(ts)))


def behind(rows: list[dict[str, Any]], ref_rows: list[dict[str, Any]], step: int, first: bool = False) -> float:
    """How much later than the reference (both from their step 0) the run completed `step` by every
    rank: its last completion, or with `first` its first (a step computed again after a rollback was
    completed twice)."""

    def done(rs: list[dict[str, Any]], s: int, pick: Any) -> float:
        by_rank: dict[int, list[float]] = {}
        for r in rs:
            if r["step"] == s:
                by_rank.setdefault(r["rank"], []).append(r["t"])
        start = min(r["t"] for r in rs if r["step"] == 0)
        return float(max(pick(ts) for ts in by_rank.values()) - start)

    return done(rows, step, min if first else max) - done(ref_rows, step, max)


def trained_batches(rows: list[dict[str, Any]]) -> set[tuple[int, int]]:
    """The (step, rank) batches some process completed (a step computed again counts once)."""
    return {(r["step"], r["rank"]) for r in rows}


def fault_figures(rows: list[dict[str, Any]], t_kill: float, ranks: int, steps: int) -> dict[str, Any]:
    ranks_done = collections.Counter(step for step, _ in trained_batches(rows))
    before = [r["step"] for r in rows if r["t"] < t_kill]
    after = [r for r in rows if r["t"] > t_kill]
    firsts = [min((r["t"] for r in after if r["rank"] == rank), default=float("nan")) for rank in range(ranks)]
    last_done = max(before, default=-1)
    restart = min((r["step"] for r in after), default=last_done + 1)
    return {
        "downtime_s": round(max(firsts) - t_kill, 4),
        "steps_recomputed": max(0, last_done + 1 - restart),
        "steps_degraded": sum(1 for s in range(steps) if ranks_done[s] < ranks),
        "batches_untrained": sum(ranks - ranks_done[s] for s in range(steps)),
        "restart_step": restart,
    }


async def run_job(
    command: list[str], log: Path, env: dict[str, str], timeout_s: float = RUN_TIMEOUT_S
) -> tuple[int, float]:
    started = time.monotonic()
    with open(log, "wb") as sink:
        process = await asyncio.create_subprocess_exec(
            *command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        code = await asyncio.wait_for(process.wait(), timeout_s)
    except TimeoutError:
        os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        code = -9
    return code, time.monotonic() - started


def train_args(args: argparse.Namespace, run_dir: Path, steps: int, kill: bool) -> list[str]:
    out = [
        *("--steps", str(steps), "--width", str(args.width), "--batch", str(args.batch)),
        *("--stats-dir", str(run_dir / "stats"), "--out", str(run_dir / "final")),
    ]
    if kill:
        out += ["--die-at-step", str(args.kill_step), "--die-rank", "1", "--die-marker", str(run_dir / "killed.json")]
    return out


def job_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"}


Runner = Callable[[Path, bool, int, bool], Awaitable[Run]]
"""(run directory, whether rank 1 kills itself, steps, whether dead ranks are replaced for ever: the
goodput run's) -> the finished run."""


def deadpool_runner(stack: Stack, args: argparse.Namespace) -> Runner:
    async def run(run_dir: Path, kill: bool, steps: int, endless: bool) -> Run:
        return await deadpool_run(stack, args, run_dir, kill, steps, respawns=1000 if endless else 0)

    return run


def torchrun_runner(args: argparse.Namespace, every: int) -> Runner:
    async def run(run_dir: Path, kill: bool, steps: int, endless: bool) -> Run:
        return await torchrun_run(args, run_dir, every, kill, steps)

    return run


def torchft_runner(args: argparse.Namespace) -> Runner:
    async def run(run_dir: Path, kill: bool, steps: int, endless: bool) -> Run:
        return await torchft_run(args, run_dir, kill, steps)

    return run


async def deadpool_run(
    stack: Stack, args: argparse.Namespace, run_dir: Path, kill: bool, steps: int, respawns: int = 0
) -> Run:
    """One run with one warm spare; `respawns` fresh spares replace dead members (the goodput run's)."""
    run_dir.mkdir(parents=True)
    job = f"versus-{run_dir.parent.name}-{run_dir.name}-{secrets.token_hex(2)}"  # a job name is used once
    command = [sys.executable, "-m", "deadpool_cli", "launch", *stack.nats_args, "--job", job, "--nproc", str(RANKS)]
    command += ["--spares", "1", "--respawns", str(respawns), "--collective-timeout-s", "20"]
    command += [str(TRAIN), "--mode", "deadpool", *train_args(args, run_dir, steps, kill)]
    code, wall = await run_job(command, run_dir / "run.log", job_env())
    return Run("deadpool", run_dir / "stats", run_dir / "final", run_dir / "killed.json", code, wall)


async def torchrun_run(args: argparse.Namespace, run_dir: Path, every: int, kill: bool, steps: int) -> Run:
    run_dir.mkdir(parents=True)
    command = [*TORCHRUN, "--nproc-per-node", str(RANKS)]
    command += [str(TRAIN), "--mode", "torchrun", *train_args(args, run_dir, steps, kill)]
    command += ["--checkpoint-every", str(every), "--checkpoint-dir", str(run_dir / "checkpoints")]
    code, wall = await run_job(command, run_dir / "run.log", job_env())
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return Run(f"torchrun K={every}", run_dir / "stats", run_dir / "final", run_dir / "killed.json", code, wall)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "1000"]
TORCHRUN += ["--monitor-interval", "0.1"]


async def torchft_run(args: argparse.Namespace, run_dir: Path, kill: bool, steps: int) -> Run:
    """A lighthouse, and one torchrun per replica group (one process each), which restarts it."""
    run_dir.mkdir(parents=True)
    port = free_port()
    lighthouse_bin = Path(sys.executable).parent / "torchft_lighthouse"
    lighthouse_command = [str(lighthouse_bin), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1"]
    lighthouse_command += ["--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
    lighthouse_command += ["--heartbeat_timeout_ms", str(int(HEARTBEAT_TIMEOUT_S * 1000))]
    with open(run_dir / "lighthouse.log", "wb") as sink:
        lighthouse = await asyncio.create_subprocess_exec(*lighthouse_command, stdout=sink, stderr=subprocess.STDOUT)
    command = [*TORCHRUN, "--nproc-per-node", "1", str(TRAIN), "--mode", "torchft"]
    command += [*train_args(args, run_dir, steps, kill), "--replicas", str(RANKS)]
    env = {**job_env(), "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
    try:
        replicas = await asyncio.gather(
            *(run_job(command, run_dir / f"replica{i}.log", {**env, "REPLICA_GROUP_ID": str(i)}) for i in range(RANKS))
        )
    finally:
        lighthouse.terminate()
        await lighthouse.wait()
    code = next((c for c, _ in replicas if c != 0), 0)
    wall = max(w for _, w in replicas)
    return Run("torchft", run_dir / "stats", run_dir / "final", run_dir / "killed.json", code, wall)


def compare(system: str, faulted: Run, reference: Run, steps: int) -> dict[str, Any]:
    ref_rows, rows = completions(reference.stats_dir), completions(faulted.stats_dir)
    result: dict[str, Any] = {
        "system": system,
        "finished": faulted.returncode == 0 and reference.returncode == 0,
        "returncodes": [faulted.returncode, reference.returncode],
        "wall_s": round(faulted.wall_s, 2),
        "reference_wall_s": round(reference.wall_s, 2),
    }
    if not result["finished"] or not faulted.marker.exists():
        result["error"] = "a run failed, or the fault did not happen: see its run.log"
        return result
    killed = json.loads(faulted.marker.read_text())
    t_kill, kill_step = killed["t"], killed["step"]
    result["time_lost_s"] = round(training_s(rows, steps) - training_s(ref_rows, steps), 4)
    after = min(steps - 1, kill_step + FAULT_WINDOW_STEPS)
    before = behind(rows, ref_rows, kill_step - 1, first=True)  # as it stood when the fault came
    result["fault_cost_s"] = round(behind(rows, ref_rows, after) - before, 4)
    result.update(fault_figures(rows, t_kill, RANKS, steps))
    result["step_s"] = round(median_step_s(ref_rows), 4)
    untrained_s = result["batches_untrained"] / RANKS * result["step_s"]
    result["fault_cost_with_untrained_s"] = round(result["fault_cost_s"] + untrained_s, 4)
    identical, tensors, _ = compare_final_states(faulted.out, reference.out)
    result["bit_identical"] = identical and tensors > 0
    return result


async def goodput(runner: Runner, args: argparse.Namespace, run_dir: Path, step_s: float) -> dict[str, Any]:
    """Train for --goodput-s with a SIGKILL of a training rank every --kill-every-s."""
    steps = max(10, int(args.goodput_s / step_s))
    stats = run_dir / "stats"
    killer_stop = asyncio.Event()
    kills = 0

    async def killer() -> None:
        nonlocal kills
        rng = random.Random(args.seed)
        while not killer_stop.is_set():
            try:
                await asyncio.wait_for(killer_stop.wait(), args.kill_every_s)
                return
            except TimeoutError:
                pass
            recent = {}  # pid -> last completion time: the processes training now
            for path in stats.glob("*.jsonl"):
                lines = path.read_text().splitlines()
                if lines:
                    recent[int(path.stem)] = json.loads(lines[-1])["t"] if lines[-1].endswith("}") else 0.0
            training = [pid for pid, t in recent.items() if time.time() - t < 5.0]
            if training:
                with_pid = rng.choice(sorted(training))
                try:
                    os.kill(with_pid, signal.SIGKILL)
                    kills += 1
                except ProcessLookupError:
                    pass

    task = asyncio.create_task(killer())
    run = await runner(run_dir, False, steps, True)
    killer_stop.set()
    await task
    return goodput_figures(run, completions(run.stats_dir), steps, kills, step_s)


def goodput_figures(run: Run, rows: list[dict[str, Any]], steps: int, kills: int, step_s: float) -> dict[str, Any]:
    """The effective training fraction: steps x a step time / the training phase; and the same counting
    only the batches trained (a step some rank sat out, as torchft's survivors train without the dead
    replica, trained part of its batch)."""
    done = len({r["step"] for r in rows})
    phase = training_s(rows, steps) if done == steps else float("nan")
    own = own_step_s(rows)
    trained = len(trained_batches(rows)) / (steps * RANKS)

    def fraction(step_time: float, share: float = 1.0) -> float | None:
        return round(share * steps * step_time / phase, 4) if phase == phase else None

    return {
        "system": run.system,
        "finished": run.returncode == 0,
        "steps": steps,
        "kills": kills,
        "training_s": round(phase, 2),
        "effective_fraction": fraction(step_s),
        "own_median_step_s": round(own, 4),
        "effective_fraction_own_pace": fraction(own),
        "batches_trained": round(trained, 4),
        "effective_fraction_own_pace_batches": fraction(own, trained),
    }


def own_step_s(rows: list[dict[str, Any]]) -> float:
    """The run's own median step time (each step's first completion): its pace between the faults. A
    long run on this shared machine settles at a pace of its own, a few percent off a short one's."""
    first: dict[int, float] = {}
    for r in sorted(rows, key=lambda r: r["t"]):
        first.setdefault(r["step"], r["t"])
    ts = [first[s] for s in sorted(first)]
    return float(statistics.median(b - a for a, b in itertools.pairwise(ts)))


def summarise(system: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system over its repeats: medians of the times, the worst of the rest."""
    done = [r for r in runs if "time_lost_s" in r]
    if len(done) < len(runs):
        return {"system": system, "error": f"{len(runs) - len(done)} of {len(runs)} repeats failed", "runs": runs}

    def median(key: str) -> float:
        return round(float(statistics.median(r[key] for r in done)), 4)

    return {
        "system": system,
        "repeats": len(done),
        "time_lost_s": median("time_lost_s"),
        "time_lost_s_each": [r["time_lost_s"] for r in done],
        "fault_cost_s": median("fault_cost_s"),
        "downtime_s": median("downtime_s"),
        "steps_recomputed": max(r["steps_recomputed"] for r in done),
        "steps_degraded": max(r["steps_degraded"] for r in done),
        "fault_cost_with_untrained_s": median("fault_cost_with_untrained_s"),
        "step_s": median("step_s"),
        "bit_identical": all(r["bit_identical"] for r in done),
    }


def torchft_skip_reason() -> str | None:
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install torchft==0.2.0 to compare with it)"
    if not socket.gethostbyname(socket.gethostname()).startswith("127."):
        return "torchft's checkpoint server advertises this host's name, which is not a loopback address here"
    return None


def ratio(theirs: float | None, ours: float | None) -> float | None:
    return round(theirs / ours, 1) if theirs is not None and ours is not None and ours > 0 else None


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="deadpool-versus-"))
    trials: dict[str, list[dict[str, Any]]] = {}
    skip = torchft_skip_reason()
    if skip:
        print(f"torchft: skipped: {skip}", flush=True)
    config = StackConfig(workdir=workdir / "stack", stores=2, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, hang_floor_s=3.0)
    async with Stack(config) as stack:
        runners: dict[str, Runner] = {"deadpool": deadpool_runner(stack, args)}
        for every in args.checkpoint_every:
            runners[f"torchrun K={every}"] = torchrun_runner(args, every)
        if skip is None:
            runners["torchft"] = torchft_runner(args)
        for repeat in range(args.repeats):
            for system, runner in runners.items():
                here = workdir / f"repeat-{repeat}" / system.replace(" K=", "-")
                reference = await runner(here / "ref", False, args.steps, False)
                faulted = await runner(here / "kill", True, args.steps, False)
                trials.setdefault(system, []).append(compare(system, faulted, reference, args.steps))
                print(json.dumps(trials[system][-1]), flush=True)
        rows = {system: summarise(system, runs) for system, runs in trials.items()}
        goodputs = []
        if args.goodput_s > 0:
            step_s = rows["deadpool"].get("step_s") or 0.1
            best_k = f"torchrun K={min(args.checkpoint_every)}"
            for system in ["deadpool", best_k, "torchft"]:
                if system in runners:
                    here = workdir / "goodput" / system.replace(" K=", "-")
                    goodputs.append(await goodput(runners[system], args, here, step_s))
                    print(json.dumps(goodputs[-1]), flush=True)

    _print_table(list(rows.values()))
    dp = rows["deadpool"]
    torchruns = [r for system, r in rows.items() if system.startswith("torchrun") and "time_lost_s" in r]
    best_torchrun = min((r["time_lost_s"] for r in torchruns), default=None)
    best_cost = min((r["fault_cost_s"] for r in torchruns), default=None)
    torchft = rows.get("torchft", {})
    at_fault = {
        "torchrun": ratio(best_cost, dp.get("fault_cost_s")),
        "torchft": ratio(torchft.get("fault_cost_s"), dp.get("fault_cost_s")),
    }
    goals_met = (
        dp.get("bit_identical", False)
        and (at_fault["torchrun"] or 0) >= GOALS["vs_torchrun_best_k_min"]
        and (skip is not None or (at_fault["torchft"] or 0) >= GOALS["vs_torchft_min"])
    )
    return {
        "deadpool_time_lost_s": dp.get("time_lost_s"),
        "torchrun_time_lost_s": best_torchrun,
        "torchft_time_lost_s": torchft.get("time_lost_s"),
        "torchft_skipped": skip,
        "deadpool_bit_identical": dp.get("bit_identical", False),
        "torchft_bit_identical": torchft.get("bit_identical"),
        "torchrun_over_deadpool": ratio(best_torchrun, dp.get("time_lost_s")),
        "torchft_over_deadpool": ratio(torchft.get("time_lost_s"), dp.get("time_lost_s")),
        "deadpool_fault_cost_s": dp.get("fault_cost_s"),
        "torchrun_fault_cost_s": best_cost,
        "torchft_fault_cost_s": torchft.get("fault_cost_s"),
        "torchrun_over_deadpool_at_fault": at_fault["torchrun"],
        "torchft_over_deadpool_at_fault": at_fault["torchft"],
        "torchft_fault_cost_with_untrained_s": torchft.get("fault_cost_with_untrained_s"),
        "torchft_over_deadpool_with_untrained": ratio(
            torchft.get("fault_cost_with_untrained_s"), dp.get("fault_cost_s")
        ),
        "systems": list(rows.values()),
        "goodput": goodputs,
        "goals": GOALS,
        "goals_met": goals_met,
        "config": {k: v for k, v in vars(args).items() if k != "workdir"},
        "workdir": str(workdir),
    }


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'system':16s} {'time lost':>10s} {'at fault':>9s} {'downtime':>9s} {'recomputed':>10s} {'degraded':>8s}"
        f" {'step':>8s}  bit-identical"
    )
    for r in rows:
        if "time_lost_s" not in r:
            print(f"{r['system']:16s} {r.get('error', '?')}")
            continue
        print(
            f"{r['system']:16s} {r['time_lost_s']:9.3f}s {r['fault_cost_s']:8.3f}s {r['downtime_s']:8.3f}s "
            f"{r['steps_recomputed']:10d} {r['steps_degraded']:8d} "
            f"{r['step_s']:7.3f}s  {r['bit_identical']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=160, help="long enough for a restarted torchft replica to rejoin")
    parser.add_argument("--kill-step", type=int, default=56, help="mid-way between checkpoints of K=10")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each system, with and without the fault")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--checkpoint-every", type=lambda s: [int(k) for k in s.split(",")], default=[1, 10])
    parser.add_argument("--goodput-s", type=float, default=0.0, help="also a goodput run per system, this long")
    parser.add_argument("--kill-every-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", default="")
    args = parser.parse_args()
    if not 0 < args.kill_step < args.steps - 1:
        parser.error("--kill-step must fall inside the run")
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
