"""DeadPool side by side with torchrun (and torchft, when installed): the same job, the same SIGKILL.

    .venv/bin/python bench/versus.py [--steps 80 --kill-step 50] [--goodput-s 300 --kill-every-s 30]

The job (`versus_train.py`): a language model under DDP on gloo, 2 ranks, each step's batch a function
of the step. Rank 1 SIGKILLs itself in the middle of step --kill-step, once. Per system:

- DeadPool: `deadpool launch` with one warm spare, against one local control plane (credentials on):
  the spare takes the rank, restored from the snapshot stores.
- torchrun: `torch.distributed.run --max-restarts`, every rank saving a `torch.save` checkpoint every K
  steps (K in --checkpoint-every, default 1 and 10); on the failure every rank restarts and resumes
  from the newest complete checkpoint.
- torchft: skipped, with the reason, where `torchft` is not installed (`pip install torchft==0.2.0`).

Each system runs --repeats times without the fault (its reference: the same checkpointing) and with
it, interleaved; the figures are medians over the repeats. Reported per system, from the per-step
completion times every process writes:
- time_lost_s: the training phase (step 0 done -> last step done) minus the reference's;
- fault_cost_s: the part of it across the fault: how much further behind the reference the run is 10
  steps after the fault step than just before it (two runs drift apart by a few percent on a busy
  machine before any fault; this leaves the drift out);
- downtime_s: the kill -> the first step every rank completed after it;
- steps_recomputed: steps completed before the kill that were computed again;
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
import importlib.util
import itertools
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states

TRAIN = Path(__file__).resolve().parent / "versus_train.py"
RUN_TIMEOUT_S = 900.0
GOALS = {"vs_torchrun_best_k_min": 20.0, "vs_torchft_min": 5.0}
FAULT_WINDOW_STEPS = 10


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


def fault_figures(rows: list[dict[str, Any]], t_kill: float, ranks: int) -> dict[str, Any]:
    before = [r["step"] for r in rows if r["t"] < t_kill]
    after = [r for r in rows if r["t"] > t_kill]
    firsts = [min((r["t"] for r in after if r["rank"] == rank), default=float("nan")) for rank in range(ranks)]
    last_done = max(before, default=-1)
    restart = min((r["step"] for r in after), default=last_done + 1)
    return {
        "downtime_s": round(max(firsts) - t_kill, 4),
        "steps_recomputed": max(0, last_done + 1 - restart),
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


async def deadpool_run(
    stack: Stack, args: argparse.Namespace, run_dir: Path, kill: bool, steps: int, respawns: int = 0
) -> Run:
    """One run with one warm spare; `respawns` fresh spares replace dead members (the goodput run's)."""
    run_dir.mkdir(parents=True)
    job = f"versus-{run_dir.parent.name}-{run_dir.name}-{secrets.token_hex(2)}"  # a job name is used once
    command = [sys.executable, "-m", "deadpool_cli", "launch", *stack.nats_args, "--job", job, "--nproc", "2"]
    command += ["--spares", "1", "--respawns", str(respawns), "--collective-timeout-s", "20"]
    command += [str(TRAIN), "--mode", "deadpool", *train_args(args, run_dir, steps, kill)]
    code, wall = await run_job(command, run_dir / "run.log", job_env())
    return Run("deadpool", run_dir / "stats", run_dir / "final", run_dir / "killed.json", code, wall)


async def torchrun_run(args: argparse.Namespace, run_dir: Path, every: int, kill: bool, steps: int) -> Run:
    run_dir.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", "1000", "--monitor-interval", "0.1"]
    command += [str(TRAIN), "--mode", "torchrun", *train_args(args, run_dir, steps, kill)]
    command += ["--checkpoint-every", str(every), "--checkpoint-dir", str(run_dir / "checkpoints")]
    code, wall = await run_job(command, run_dir / "run.log", job_env())
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return Run(f"torchrun K={every}", run_dir / "stats", run_dir / "final", run_dir / "killed.json", code, wall)


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
    t_kill = json.loads(faulted.marker.read_text())["t"]
    result["time_lost_s"] = round(training_s(rows, steps) - training_s(ref_rows, steps), 4)
    kill_step = json.loads(faulted.marker.read_text())["step"]
    after = min(steps - 1, kill_step + FAULT_WINDOW_STEPS)
    before = behind(rows, ref_rows, kill_step - 1, first=True)  # as it stood when the fault came
    result["fault_cost_s"] = round(behind(rows, ref_rows, after) - before, 4)
    result.update(fault_figures(rows, t_kill, 2))
    result["step_s"] = round(median_step_s(ref_rows), 4)
    identical, tensors, _ = compare_final_states(faulted.out, reference.out)
    result["bit_identical"] = identical and tensors > 0
    return result


async def goodput(
    stack: Stack | None, args: argparse.Namespace, run_dir: Path, step_s: float, every: int
) -> dict[str, Any]:
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
    if stack is not None:
        run = await deadpool_run(stack, args, run_dir, False, steps, respawns=1000)
    else:
        run = await torchrun_run(args, run_dir, every, False, steps)
    killer_stop.set()
    await task
    rows = completions(run.stats_dir)
    done = len({r["step"] for r in rows})
    phase = training_s(rows, steps) if done == steps else float("nan")
    own = own_step_s(rows)
    return {
        "system": run.system,
        "finished": run.returncode == 0,
        "steps": steps,
        "kills": kills,
        "training_s": round(phase, 2),
        "effective_fraction": round(steps * step_s / phase, 4) if phase == phase else None,
        "own_median_step_s": round(own, 4),
        "effective_fraction_own_pace": round(steps * own / phase, 4) if phase == phase else None,
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
        "step_s": median("step_s"),
        "bit_identical": all(r["bit_identical"] for r in done),
    }


def torchft_skip_reason() -> str:
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install torchft==0.2.0 to compare with it)"
    return "torchft is installed, but this benchmark has no torchft runner yet"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="deadpool-versus-"))
    trials: dict[str, list[dict[str, Any]]] = {}
    config = StackConfig(workdir=workdir / "stack", stores=2, heartbeat_timeout_s=2.0, hang_floor_s=3.0)
    async with Stack(config) as stack:
        for repeat in range(args.repeats):
            here = workdir / f"repeat-{repeat}"
            reference = await deadpool_run(stack, args, here / "deadpool-ref", False, args.steps)
            faulted = await deadpool_run(stack, args, here / "deadpool-kill", True, args.steps)
            trials.setdefault("deadpool", []).append(compare("deadpool", faulted, reference, args.steps))
            print(json.dumps(trials["deadpool"][-1]), flush=True)
            for every in args.checkpoint_every:
                system = f"torchrun K={every}"
                reference = await torchrun_run(args, here / f"torchrun-{every}-ref", every, False, args.steps)
                faulted = await torchrun_run(args, here / f"torchrun-{every}-kill", every, True, args.steps)
                trials.setdefault(system, []).append(compare(system, faulted, reference, args.steps))
                print(json.dumps(trials[system][-1]), flush=True)
        rows = [summarise(system, runs) for system, runs in trials.items()]
        skip = torchft_skip_reason()
        print(f"torchft: skipped: {skip}", flush=True)
        goodputs = []
        if args.goodput_s > 0:
            step_s = rows[0].get("step_s") or 0.1
            goodputs.append(await goodput(stack, args, workdir / "deadpool-goodput", step_s, 0))
            print(json.dumps(goodputs[-1]), flush=True)
            best = min(args.checkpoint_every)
            goodputs.append(await goodput(None, args, workdir / f"torchrun-{best}-goodput", step_s, best))
            print(json.dumps(goodputs[-1]), flush=True)

    _print_table(rows)
    dp = rows[0]
    torchruns = [r for r in rows[1:] if "time_lost_s" in r]
    best_torchrun = min((r["time_lost_s"] for r in torchruns), default=None)
    ratio = best_torchrun / dp["time_lost_s"] if best_torchrun and dp.get("time_lost_s", 0) > 0 else None
    best_cost = min((r["fault_cost_s"] for r in torchruns), default=None)
    cost_ratio = best_cost / dp["fault_cost_s"] if best_cost and dp.get("fault_cost_s", 0) > 0 else None
    return {
        "deadpool_time_lost_s": dp.get("time_lost_s"),
        "torchrun_time_lost_s": best_torchrun,
        "torchft_time_lost_s": None,
        "torchft_skipped": skip,
        "deadpool_bit_identical": dp.get("bit_identical", False),
        "torchrun_over_deadpool": round(ratio, 1) if ratio else None,
        "deadpool_fault_cost_s": dp.get("fault_cost_s"),
        "torchrun_fault_cost_s": best_cost,
        "torchrun_over_deadpool_at_fault": round(cost_ratio, 1) if cost_ratio else None,
        "systems": rows,
        "goodput": goodputs,
        "goals": GOALS,
        "goals_met": bool(cost_ratio and cost_ratio >= GOALS["vs_torchrun_best_k_min"] and dp.get("bit_identical")),
        "config": {k: v for k, v in vars(args).items() if k != "workdir"},
        "workdir": str(workdir),
    }


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'system':16s} {'time lost':>10s} {'at fault':>9s} {'downtime':>9s} {'recomputed':>10s} {'step':>8s}"
        "  bit-identical"
    )
    for r in rows:
        if "time_lost_s" not in r:
            print(f"{r['system']:16s} {r.get('error', '?')}")
            continue
        print(
            f"{r['system']:16s} {r['time_lost_s']:9.3f}s {r['fault_cost_s']:8.3f}s {r['downtime_s']:8.3f}s "
            f"{r['steps_recomputed']:10d} "
            f"{r['step_s']:7.3f}s  {r['bit_identical']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
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
