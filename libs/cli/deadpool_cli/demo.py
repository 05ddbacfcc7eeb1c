"""`deadpool demo`: kill a rank mid-step in a real training job, watch a warm spare take over, and check
the final weights against an uninterrupted run of the same seed.

Everything is real: an embedded nats-server, the detector, swapper and two snapshot stores as separate
processes, `deadpool launch` running the example GPT with DDP and ZeRO on gloo, and a SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deadpool_cli.job_watch import JobWatch, StepDone
from deadpool_cli.stack import Stack, StackConfig
from deadpool_cli.weights_check import compare_final_states
from deadpool_detector.core import DetectorConfig
from deadpool_protocol import Incident
from deadpool_protocol.timeouts import HEARTBEAT_PERIOD_S_DEFAULT, TimeoutHierarchy
from deadpool_runtime.logs import get_logger

__all__ = [
    "FAULT_SIGNALS",
    "DemoConfig",
    "Kill",
    "default_script",
    "incident_report",
    "inject_fault_mid_step",
    "run_demo",
]

KILL_AT_FRACTION_OF_STEP = 0.5
"""Where inside the chosen step the kill lands: half-way, in the middle of forward/backward."""
COLLECTIVE_TIMEOUT_S = 20.0
"""Steps take well under a second here; a collective blocked for 20 s is stuck (see docs/architecture.md)."""


FAULT_SIGNALS = {
    "kill": signal.SIGKILL,
    "stop": signal.SIGSTOP,
    "hang": signal.SIGUSR1,
    "exception": signal.SIGUSR2,
    "reset": signal.SIGURG,
}
"""How each fault class is injected; hang and exception use `deadpool.fault_injection`'s handlers."""


def default_script() -> Path:
    return Path(__file__).resolve().parents[3] / "examples" / "train_gpt.py"


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 40
    nproc: int = 4
    spares: int = 1
    kill_step: int = 15
    kill_rank: int = 2
    model_size: str = "small"
    device: str = "cpu"
    gpus: str = "auto"
    """With --device cuda: `deadpool launch --gpus` (a GPU per member; `0,0,0` shares one, gloo only)."""
    seed: int = 1337
    stores: int = StackConfig.stores
    report: str = ""
    run_dir: str = ""
    script: str = ""
    run_timeout_s: float = 600.0
    reference: bool = True
    reference_from: str = ""
    """The run dir of an earlier demo whose uninterrupted run is compared with, instead of training the
    reference again (several faults, one reference): its training must be this one's (checked)."""
    fault: str = "kill"
    """kill (SIGKILL), stop (SIGSTOP: frozen, heartbeats too), hang (the training thread stuck in Python,
    heartbeats going on), exception (raised in the training thread), reset (the rank's process-group
    connections reset: every rank alive, the job regroups without a swap)."""
    host_copy: bool = True
    """False: `deadpool launch --no-host-copy`, the swap restores from a store (as a lost host's does)."""
    heartbeat_timeout_s: float = 2.0
    """Below the detector's own default (`DetectorConfig`): the demo's steps are short."""
    hang_floor_s: float = 3.0
    hang_factor: float = DetectorConfig.hang_factor

    def check(self) -> None:
        TimeoutHierarchy(
            HEARTBEAT_PERIOD_S_DEFAULT, self.heartbeat_timeout_s, self.hang_floor_s, COLLECTIVE_TIMEOUT_S
        ).check()
        if self.fault not in FAULT_SIGNALS:
            raise ValueError(f"--fault must be one of {sorted(FAULT_SIGNALS)}")
        if not 1 <= self.kill_step < self.steps:
            raise ValueError(f"--kill-step must be between 1 and {self.steps - 1} (the last step is {self.steps - 1})")
        if not 0 <= self.kill_rank < self.nproc:
            raise ValueError(f"--kill-rank must be between 0 and {self.nproc - 1}")
        if self.spares < 1:
            raise ValueError("the demo swaps in a spare: use --spares 1 or more")
        if self.reference_from and not self.reference:
            raise ValueError("--reference-from names a reference to compare with: drop --no-reference")


REFERENCE_RUN = "ref"
"""The folder of a run dir that holds the uninterrupted run's final states."""
TRAINING_FILE = "training.json"
"""Written beside a reference's final states: the training they come from (see `training_of`)."""


def training_of(cfg: DemoConfig) -> dict[str, Any]:
    """What decides a run's final weights: two runs equal in these, with no fault, train the same."""
    script = Path(cfg.script) if cfg.script else default_script()
    fields = {k: getattr(cfg, k) for k in ("steps", "nproc", "model_size", "device", "seed")}
    return {**fields, "script": str(script.resolve())}


def reused_reference(cfg: DemoConfig) -> Path:
    """The final states of `cfg.reference_from`'s reference run, refused unless it trained as `cfg` does."""
    ref = Path(cfg.reference_from) / REFERENCE_RUN
    try:
        trained = json.loads((ref / TRAINING_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--reference-from {cfg.reference_from}: no finished reference run there ({exc})") from exc
    if trained != training_of(cfg):
        raise ValueError(f"--reference-from {cfg.reference_from}: it trained {trained}, this run {training_of(cfg)}")
    return ref


@dataclass
class Kill:
    rank: int
    member: str
    pid: int
    step: int
    t: float
    fault: str = "kill"


@dataclass
class RunResult:
    job: str
    returncode: int
    started_t: float
    wall_s: float
    finished: bool
    incidents: list[Incident] = field(default_factory=list)
    kill: Kill | None = None
    log: str = ""
    stuck: list[str] = field(default_factory=list)
    """If the run timed out: each member's last heartbeat, then the failures the detector declared."""
    steps_done: list[StepDone] = field(default_factory=list)
    """Every step completion of the members that ended cleanly, with its exact time (their step stats)."""
    snapshot_every_max: int = 1
    """The longest snapshot interval K a rank's heartbeat named: a lost host would have lost at most 2K-1."""


async def inject_fault_mid_step(watch: JobWatch, rank: int, step: int, steps: int, fault: str = "kill") -> Kill | None:
    """Inject `fault` into the process holding `rank` half-way through step `step` (it has completed
    step-1), or the first step after it that the watch sees: the launcher batches beats every quarter
    second, which is several steps of a tiny model. None when the holder is first seen in the run's last
    step (of `steps`) or past it: a fault there races the run's end (the rank may already have said it
    is done, and the code after the loop is its own), which is not the mid-run fault asked for."""

    def reached() -> bool:
        member = watch.holder_of(rank)
        view = watch.members.get(member or "")
        return view is not None and (view.step >= steps - 1 or (view.step >= step - 1 and view.in_step))

    await watch.wait_for(reached)
    member = watch.holder_of(rank)
    assert member is not None
    view = watch.members[member]
    if view.step >= steps - 1:
        return None
    target = view.step_started_t + KILL_AT_FRACTION_OF_STEP * watch.median_step_s(member)
    await asyncio.sleep(max(0.0, target - time.time()))
    os.kill(view.pid, FAULT_SIGNALS[fault])
    return Kill(rank, member, view.pid, view.step + 1, time.time(), fault)


async def _train(
    nc: Any, stack: Stack, cfg: DemoConfig, job: str, spares: int, out: Path, kill: bool, log_path: Path
) -> RunResult:
    watch = JobWatch(nc, job, get_logger(job=job))
    await watch.start()
    stats_dir = out.with_name(f"{out.name}-stats")  # every member's step times, written as it ends
    script = cfg.script or str(default_script())
    launch = ["launch", *stack.nats_args, "--job", job, "--nproc", str(cfg.nproc), "--spares", str(spares)]
    launch += ["--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S)]
    launch += ["--gpus", cfg.gpus if cfg.device == "cuda" else "none"]
    launch += [] if cfg.host_copy else ["--no-host-copy"]
    train = ["--steps", str(cfg.steps), "--model-size", cfg.model_size, "--seed", str(cfg.seed), "--out", str(out)]
    train += ["--device", cfg.device]
    if cfg.device == "cuda":  # the weights are compared bit for bit
        train += ["--deterministic"]
    command = [sys.executable, "-m", "deadpool_cli", *launch, script, *train]
    started = time.time()
    with open(log_path, "wb") as log:
        env = {
            **os.environ,
            **stack.trace_env,  # the members' spans go where the services' do
            "DEADPOOL_FAULT_INJECTION": "1" if kill else "0",
            "DEADPOOL_STATS_DIR": str(stats_dir),
        }
        launcher = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=asyncio.subprocess.STDOUT, env=env)
    killer = (
        asyncio.create_task(inject_fault_mid_step(watch, cfg.kill_rank, cfg.kill_step, cfg.steps, cfg.fault))
        if kill
        else None
    )
    stuck: list[str] = []
    try:
        returncode = await asyncio.wait_for(launcher.wait(), cfg.run_timeout_s)
    except TimeoutError:
        stuck = watch.describe_members(time.time())
        stuck += [f"declared: {f.member} rank {f.rank} ({f.reason}) {f.evidence}" for f in watch.failures]
        print(f"run did not finish within {cfg.run_timeout_s} s; stopping it. Last heartbeats:", flush=True)
        for line in stuck:
            print(f"  {line}", flush=True)
        launcher.send_signal(signal.SIGTERM)
        returncode = await launcher.wait()
    result = RunResult(
        job,
        returncode,
        started,
        time.time() - started,
        watch.finished.is_set(),
        list(watch.incidents),
        log=str(log_path),
        stuck=stuck,
        steps_done=_steps_completed(stats_dir),
        snapshot_every_max=watch.snapshot_every_max,
    )
    if killer is not None:
        if killer.done() and killer.exception() is None:
            result.kill = killer.result()
        else:
            killer.cancel()
    return result


def incident_report(incident: Incident, kill: Kill | None) -> dict[str, Any]:
    """The incident as the demo saw it. The swapper dates the fault at the launcher's `waitpid`; the
    demo knows the kill itself, so it adds the `exit` phase (SIGKILL -> process reaped) in front.
    `downtime_s` runs to the first step every rank completed after the fault; `ready_s` to every
    rank's ack of the rebuild (ready to train, the step not yet done)."""
    killed = kill is not None and kill.rank == incident.rank
    fault_t = kill.t if kill is not None and killed else incident.t_fault
    phases = {"exit": max(0.0, incident.t_fault - fault_t), **incident.phases}
    return {
        "incident_id": incident.incident_id,
        "rank": incident.rank,
        "reason": incident.reason,
        "member": incident.member,
        "replacement": incident.replacement,
        "generation": incident.generation,
        "detect_s": round(incident.t_detected - fault_t, 4),
        "downtime_s": round((incident.t_first_step or incident.t_resumed) - fault_t, 4),
        "ready_s": round(incident.t_resumed - fault_t, 4),
        "first_step_known": incident.t_first_step > 0,
        "lost_steps": incident.lost_steps,
        "restore_step": incident.restore_step,
        "phases": {name: round(value, 4) for name, value in phases.items()},
        "evidence": incident.evidence,
    }


def _steps_completed(stats_dir: Path) -> list[StepDone]:
    """Every step the members that ended cleanly completed, from their step stats (a SIGKILLed member
    writes none; the others, survivors and the spare, completed every step alongside it)."""
    done: list[StepDone] = []
    for path in sorted(stats_dir.glob("*.json")):
        record = json.loads(path.read_text())
        rank = record.get("rank")
        for step in record.get("steps", []):
            if step.get("t_completed"):
                done.append(
                    StepDone(
                        step["t_completed"],
                        record["member"],
                        rank if rank is not None else -1,
                        step["generation"],
                        step["step"],
                    )
                )
    return done


def _completed_at(steps: list[StepDone]) -> dict[tuple[int, int], float]:
    """(generation, step) -> when the last member that reported it completed it. Ranks step together
    (each step ends in collectives), so that is when every rank had completed it."""
    at: dict[tuple[int, int], float] = {}
    for done in steps:
        key = (done.generation, done.step)
        at[key] = max(done.t, at.get(key, done.t))
    return at


def time_lost(swap: list[StepDone], ref: list[StepDone]) -> tuple[float, int, int] | None:
    """The time the failure cost the run: how much longer the run with it took than the reference
    from step s0 to step s1, completed in both runs (s0 in the first generation, s1 in the last).
    Exact step-completion times, so start-up (imports, formation), which varies by seconds between
    runs, does not count. None if the runs have no such steps."""
    swap_at, ref_at = _completed_at(swap), _completed_at(ref)
    if not swap_at or not ref_at:
        return None
    first_gen, last_gen = min(g for g, _ in swap_at), max(g for g, _ in swap_at)
    ref_gen = min(g for g, _ in ref_at)
    starts = {s for g, s in swap_at if g == first_gen} & {s for g, s in ref_at if g == ref_gen}
    ends = {s for g, s in swap_at if g == last_gen} & {s for g, s in ref_at if g == ref_gen}
    if not starts or not ends or min(starts) >= max(ends):
        return None
    s0, s1 = min(starts), max(ends)
    took = swap_at[(last_gen, s1)] - swap_at[(first_gen, s0)]
    took_ref = ref_at[(ref_gen, s1)] - ref_at[(ref_gen, s0)]
    return took - took_ref, s0, s1


def _print_summary(report: dict[str, Any]) -> None:
    w = print
    cfg = report["config"]
    w("")
    w(
        f"DeadPool demo: {cfg['nproc']} ranks + {cfg['spares']} warm spare(s), {cfg['steps']} steps, "
        f"GPT '{cfg['model_size']}', DDP + ZeroRedundancyOptimizer on gloo"
    )
    swap = report["runs"]["swap"]
    kill = swap.get("kill")
    if kill:
        w(
            f"  injected '{kill['fault']}' into rank {kill['rank']} (pid {kill['pid']}) during step {kill['step']}, "
            f"{kill['at_s']:.1f} s into the run"
        )
    else:
        w(
            f"  no fault injected: rank {cfg['kill_rank']} was first seen at or after step {cfg['kill_step']} "
            f"only in its last step (more steps, or an earlier --kill-step, leave the watch time to see it)"
        )
    for inc in report["incidents"]:
        if inc["replacement"] == inc["member"]:
            outcome = f"rank {inc['rank']} left first; the same members regrouped"
        else:
            outcome = f"rank {inc['rank']} handed to spare {inc['replacement']}"
        w(
            f"  detected in {inc['detect_s'] * 1000:.0f} ms ({inc['reason']}); {outcome}; "
            f"restored step {inc['restore_step']}, lost {inc['lost_steps']} step(s)"
        )
        phases = "  ".join(f"{k} {v * 1000:.0f}" for k, v in inc["phases"].items())
        w(f"  phases (ms): {phases}")
        to = "every rank's first step after it" if inc["first_step_known"] else "every rank ready (first step unknown)"
        w(f"  downtime, fault -> {to}: {inc['downtime_s']:.3f} s (ready to train after {inc['ready_s']:.3f} s)")
    w(
        f"  run with the failure: {'finished' if swap['finished'] else 'DID NOT FINISH'} in {swap['wall_s']:.1f} s "
        f"(launcher exit code {swap['returncode']})"
    )
    every = swap.get("snapshot_every_max", 1)
    if cfg.get("host_copy", True):
        w(
            f"  snapshots: every step into the host's crash copy, every {every} step(s) at most to the stores "
            f"(a crashed process loses at most 1 step, a lost host at most {2 * every - 1})"
        )
    else:
        w(f"  snapshots: every {every} step(s) at most to the stores (a lost rank loses at most {2 * every - 1})")
    ref = report["runs"].get("reference")
    if ref or report["reference_from"]:
        if ref:
            w(
                f"  reference run without failure: {'finished' if ref['finished'] else 'DID NOT FINISH'} "
                f"in {ref['wall_s']:.1f} s"
            )
        else:
            w(f"  reference run without failure: the one in {report['reference_from']} (same training)")
        lost = report.get("time_lost_s")
        if lost is not None:
            span = report["time_lost_span"]
            w(
                f"  time lost to the failure: {lost:.3f} s (steps {span[0]} to {span[1]} took that much longer "
                "than in the reference run)"
            )
        verdict = "bit-identical to" if report["bit_identical"] else "DIFFERENT from"
        w(
            f"  final weights and optimizer shards: {verdict} the reference "
            f"({report['tensors_compared']} tensors, torch.equal)"
        )
        for diff in report["differences"][:5]:
            w(f"    {diff}")
    if report["timeline"]:
        w(f"  timeline of the recovery: {report['timeline']}")
    w(f"  recovered: {report['recovered']}    logs and traces: {report['run_dir']}")


def _timeline(trace_file: Path, out: Path) -> str:
    """Draw the last recovery of the demo's trace file; its path, or '' (spans went to an OTLP endpoint
    instead, or no recovery was traced)."""
    from deadpool_cli.timeline import PlotsMissingError, draw, pick_trace, read_spans

    if not trace_file.exists():
        return ""
    try:
        draw(pick_trace(read_spans(trace_file)), out)
    except PlotsMissingError as exc:  # an optional extra: the report goes on without its picture
        print(f"  no timeline picture: {exc}; then `deadpool timeline --trace-file {trace_file} -o {out}`", flush=True)
        return ""
    except (LookupError, ValueError, OSError) as exc:
        print(f"  no timeline: {exc}", flush=True)
        return ""
    return str(out)


async def run_demo(cfg: DemoConfig) -> int:
    cfg.check()
    reused = reused_reference(cfg) if cfg.reference_from else None
    run_dir = Path(cfg.run_dir) if cfg.run_dir else Path(tempfile.mkdtemp(prefix="deadpool-demo-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(3)
    print(f"starting NATS, detector, swapper and {cfg.stores} snapshot stores (run dir {run_dir})", flush=True)
    stack_cfg = StackConfig(
        workdir=run_dir,
        stores=cfg.stores,
        trace_file=str(run_dir / "traces.jsonl"),
        heartbeat_timeout_s=cfg.heartbeat_timeout_s,
        hang_floor_s=cfg.hang_floor_s,
        hang_factor=cfg.hang_factor,
    )
    async with Stack(stack_cfg) as stack:
        nc = await stack.connect()
        try:
            print(
                f"run 1: training with a failure at step {cfg.kill_step} (rank {cfg.kill_rank}) ...",
                flush=True,
            )
            swap = await _train(
                nc,
                stack,
                cfg,
                f"demo-swap-{token}",
                cfg.spares,
                run_dir / "swap",
                True,
                run_dir / "logs" / "run-swap.log",
            )
            ref = None
            if cfg.reference and reused is None:
                print("run 2: the same training without a failure, for reference ...", flush=True)
                ref = await _train(
                    nc,
                    stack,
                    cfg,
                    f"demo-ref-{token}",
                    0,
                    run_dir / REFERENCE_RUN,
                    False,
                    run_dir / "logs" / "run-ref.log",
                )
                if ref.returncode == 0 and ref.finished:
                    (run_dir / REFERENCE_RUN / TRAINING_FILE).write_text(json.dumps(training_of(cfg)) + "\n")
        finally:
            await nc.close()

    identical, tensors, diffs = (False, 0, ["no reference run"])
    if ref is not None or reused is not None:
        identical, tensors, diffs = compare_final_states(run_dir / "swap", reused or run_dir / REFERENCE_RUN)
    kill = swap.kill
    report: dict[str, Any] = {
        "recovered": bool(swap.returncode == 0 and swap.finished and kill is not None and swap.incidents),
        "bit_identical": identical,
        "tensors_compared": tensors,
        "differences": diffs[:20],
        "config": {
            k: getattr(cfg, k)
            for k in (
                "steps",
                "nproc",
                "spares",
                "kill_step",
                "kill_rank",
                "fault",
                "model_size",
                "device",
                "seed",
                "stores",
                "heartbeat_timeout_s",
                "hang_floor_s",
                "hang_factor",
                "host_copy",
            )
        },
        "incidents": [incident_report(i, kill) for i in swap.incidents],
        "runs": {
            "swap": {
                "job": swap.job,
                "returncode": swap.returncode,
                "finished": swap.finished,
                "wall_s": round(swap.wall_s, 2),
                "snapshot_every_max": swap.snapshot_every_max,
                "log": swap.log,
                "stuck": swap.stuck,
                "kill": None
                if kill is None
                else {
                    "rank": kill.rank,
                    "member": kill.member,
                    "pid": kill.pid,
                    "step": kill.step,
                    "t": kill.t,
                    "fault": kill.fault,
                    "at_s": round(kill.t - swap.started_t, 2),
                },
            },
        },
        "run_dir": str(run_dir),
        "reference_from": str(reused) if reused is not None else None,
        "timeline": _timeline(run_dir / "traces.jsonl", run_dir / "timeline.png"),
        "time_lost_s": None,  # how much longer than the reference run (None without one)
        "time_lost_span": None,
    }
    if ref is not None:
        lost = time_lost(swap.steps_done, ref.steps_done)
        report["time_lost_s"] = round(lost[0], 4) if lost is not None else None
        report["time_lost_span"] = list(lost[1:]) if lost is not None else None
        report["runs"]["reference"] = {
            "job": ref.job,
            "returncode": ref.returncode,
            "finished": ref.finished,
            "wall_s": round(ref.wall_s, 2),
            "log": ref.log,
            "stuck": ref.stuck,
        }
    _print_summary(report)
    if cfg.report:
        Path(cfg.report).write_text(json.dumps(report, indent=2) + "\n")
        print(f"  report written to {cfg.report}")
    return 0 if report["recovered"] and (identical or not cfg.reference) else 1
