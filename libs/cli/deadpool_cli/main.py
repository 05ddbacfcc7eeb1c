"""The `deadpool` command: wires the parts together; no logic of its own.

An option that sets a field of a part's config takes its default from that config (`DetectorConfig`,
`SwapperConfig`, `StoreConfig`, `LaunchConfig`, `MemberConfig`, `StackConfig`, `DemoConfig`): each
default is written once (tests/unit/test_config_defaults.py). A number typed here is the default of an
option no config holds one for (`launch --spares`), or one this command sets apart from the config's
(`up` runs two swappers and two detectors where a `StackConfig` runs one of each)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from deadpool.launcher import LaunchConfig
from deadpool.member_config import MemberConfig, env_float
from deadpool_cli.demo import DemoConfig
from deadpool_cli.node_plan import NodePlan, plan_node
from deadpool_cli.stack import StackConfig
from deadpool_detector import DetectorServiceConfig
from deadpool_detector.core import DetectorConfig
from deadpool_runtime.credentials import CREDENTIALS_ENV
from deadpool_runtime.tls import TLS_ENV
from deadpool_runtime.tracing import TRACE_FILE_ENV
from deadpool_store import StoreConfig
from deadpool_swapper import SwapperConfig, SwapperServiceConfig

__all__ = ["main"]


def _add_nats(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--nats",
        required=required,
        default="",
        help="NATS server URL, or a comma-separated list of a cluster's, e.g. nats://127.0.0.1:4222",
    )
    p.add_argument(
        "--credentials",
        default=os.environ.get(CREDENTIALS_ENV, ""),
        help="the deployment's credentials directory (what `deadpool up` printed; default: $DEADPOOL_CREDENTIALS); "
        "this command reads only its own role's files there",
    )
    p.add_argument(
        "--tls",
        default=os.environ.get(TLS_ENV, ""),
        help="a directory of TLS files (ca.pem; cert.pem and key.pem where this host serves; docs/operations.md "
        "§2): the bus and the data plane then speak TLS only (default: $DEADPOOL_TLS; the processes this command "
        "starts inherit it)",
    )


def _role_files(args: argparse.Namespace, role: str, dataplane: bool = False) -> tuple[str, bytes]:
    """(`role`'s nkey seed file, the data-plane key if asked for) from `--credentials`; exits saying what
    is missing. `deadpool store --id ID` reads that store's own key (`store_nkey_file`)."""
    from deadpool_runtime.credentials import dataplane_key_file, nkey_file, read_dataplane_key, store_nkey_file

    try:
        key = read_dataplane_key(dataplane_key_file(args.credentials)) if dataplane else b""
        if role == "store" and vars(args).get("id"):
            return store_nkey_file(args.credentials, args.id), key
        return nkey_file(args.credentials, role), key
    except (OSError, ValueError) as exc:
        sys.exit(f"deadpool {args.command}: {exc}")


def _add_replicas(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument(
        "--js-replicas",
        type=int,
        default=default,
        help="JetStream replicas of the events stream and KV (3 on a cluster)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deadpool", description="Hot-swap fault tolerance for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="kill a rank mid-step in a real job and watch a spare take over")
    demo.add_argument("--steps", type=int, default=DemoConfig.steps)
    demo.add_argument("--nproc", type=int, default=DemoConfig.nproc, help="ranks")
    demo.add_argument("--spares", type=int, default=DemoConfig.spares, help="warm spares")
    demo.add_argument(
        "--kill-step", type=int, default=DemoConfig.kill_step, help="the step during which a rank is killed"
    )
    demo.add_argument("--kill-rank", type=int, default=DemoConfig.kill_rank)
    demo.add_argument("--model-size", default=DemoConfig.model_size, choices=["tiny", "small", "base", "medium"])
    demo.add_argument("--device", default=DemoConfig.device, choices=["cpu", "cuda"], help="where the example trains")
    demo.add_argument("--gpus", default=DemoConfig.gpus, help="with --device cuda: as deadpool launch --gpus")
    demo.add_argument("--seed", type=int, default=DemoConfig.seed)
    demo.add_argument("--stores", type=int, default=DemoConfig.stores, help="snapshot store processes")
    demo.add_argument("--report", default=DemoConfig.report, help="write the outcome as JSON to this file")
    demo.add_argument(
        "--run-dir", default=DemoConfig.run_dir, help="where logs and final states go (default: a new temp dir)"
    )
    demo.add_argument("--no-reference", action="store_true", help="skip the uninterrupted reference run")
    demo.add_argument(
        "--no-host-copy", action="store_true", help="as deadpool launch --no-host-copy: the swap restores from a store"
    )
    demo.add_argument(
        "--reference-from",
        default=DemoConfig.reference_from,
        metavar="RUN_DIR",
        help="compare with the reference run of an earlier demo's --run-dir (same training, checked) "
        "instead of training it again",
    )
    demo.add_argument(
        "--fault",
        default=DemoConfig.fault,
        choices=["kill", "stop", "hang", "exception", "reset"],
        help="SIGKILL; SIGSTOP; the training thread stuck in Python; an exception in the step; "
        "the rank's process-group connections reset (everyone alive: a regroup, no swap)",
    )
    demo.add_argument("--heartbeat-timeout-s", type=float, default=DemoConfig.heartbeat_timeout_s)
    demo.add_argument("--hang-floor-s", type=float, default=DemoConfig.hang_floor_s)
    demo.add_argument("--hang-factor", type=float, default=DemoConfig.hang_factor)
    demo.add_argument(
        "--run-timeout-s",
        type=float,
        default=DemoConfig.run_timeout_s,
        help="stop a run that has not finished by then, saying why",
    )

    up = sub.add_parser("up", help="run NATS, detector, swapper and snapshot stores locally, in the foreground")
    _add_nats(up, required=False)
    up.add_argument("--stores", type=int, default=StackConfig.stores)
    up.add_argument("--swappers", type=int, default=2, help="swapper instances (one leads, the others stand by)")
    up.add_argument("--detectors", type=int, default=2, help="detector instances (each watches everything)")
    up.add_argument(
        "--nats-nodes", type=int, default=StackConfig.nats_nodes, help="embedded NATS servers: 1, or 3 for a cluster"
    )
    up.add_argument(
        "--listen",
        default=StackConfig.listen,
        help="the address NATS and the stores listen on (default %(default)s: this host only); a private "
        "address serves the training hosts that reach it",
    )
    up.add_argument(
        "--advertise",
        default=StackConfig.advertise,
        help="the address other hosts reach NATS and the stores at (default: --listen; needed with 0.0.0.0)",
    )
    up.add_argument("--workdir", default="", help="logs and JetStream data (default: a new temp dir)")
    up.add_argument(
        "--trace-file", default="", help="incident traces as JSON lines (default: WORKDIR/traces.jsonl; OTEL_* wins)"
    )
    up.add_argument(
        "--insecure",
        action="store_true",
        help="no credentials: anyone who reaches NATS or a store's port may act as any part (tests only)",
    )

    launch = sub.add_parser("launch", help="run a training script with ranks and warm spares, like torchrun")
    _add_nats(launch, required=False)
    launch.add_argument(
        "--nproc", "--nproc-per-node", type=int, required=True, help="ranks on this host (0: a host of spares only)"
    )
    launch.add_argument("--spares", type=int, default=1, help="warm spares on this host")
    launch.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="hosts with ranks in the job, each with --nproc-per-node of them, as torchrun's (inside srun: Slurm's)",
    )
    launch.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this host's place among them, from 0, as torchrun's (inside srun: SLURM_NODEID; in a Kubernetes "
        "Indexed Job: JOB_COMPLETION_INDEX)",
    )
    launch.add_argument(
        "--job",
        "--rdzv-id",
        default="",
        help="job name, the same on every host (default on one host: the script's name and a random suffix; "
        "inside srun: slurm-SLURM_JOB_ID)",
    )
    launch.add_argument(
        "--nkey",
        default="",
        help="the job's own nkey seed file, which this launcher and its members hold (default: jobs/JOB.nk in "
        "--credentials; with systemd or compose, the credential or secret it was given as)",
    )
    launch.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks in the whole job (default: --nnodes x --nproc-per-node; on a host of spares only, the job's)",
    )
    launch.add_argument(
        "--rank-offset", type=int, default=None, help="first rank this host asks for (default: --node-rank x --nproc)"
    )
    launch.add_argument(
        "--hold-without-stores-s",
        type=float,
        default=LaunchConfig.hold_without_stores_s,
        help="when every snapshot store is lost, hold training until one returns, for at most this long, then "
        "end the job (default %(default)g: train on unprotected; a lost rank then restores from the durable "
        "tier, if any)",
    )
    launch.add_argument(
        "--no-host-copy",
        action="store_true",
        help="keep each member's snapshot buffers in its own process rather than in this host's shared "
        "memory: a crashed rank then restores from the stores, as a lost host's does (default: a crash copy "
        "in /dev/shm, which a spare of this launcher restores from)",
    )
    launch.add_argument(
        "--snapshot-budget",
        type=float,
        default=MemberConfig.snapshot_budget,
        help="the share of step time a step may wait for the last snapshot's stream (default %(default)g): "
        "past it the job streams every K-th step instead, K a power of two it adapts (see deadpool status)",
    )
    launch.add_argument(
        "--snapshot-every",
        default=None,
        help="stream every N-th step's snapshot, waiting for the stream if it is slower (default auto: the "
        "job chooses within --snapshot-budget; 0: only the step-0 snapshot)",
    )
    launch.add_argument(
        "--run-id",
        default=LaunchConfig.run,
        help="the run this launcher starts, the same on every launcher of the job (default: a new one on one "
        "host; over several, the job name; inside srun, SLURM_JOB_ID). A job name holds one run at a time, "
        "and a finished job's name can be launched again under a new run",
    )
    launch.add_argument(
        "--rendezvous-host",
        default=LaunchConfig.rendezvous_host,
        help="the address other hosts reach this host's members at (default: this host's address on its route "
        "to the NATS server; loopback when the server runs here)",
    )
    launch.add_argument(
        "--respawns", type=int, default=LaunchConfig.respawns, help="replace up to N dead members with fresh spares"
    )
    launch.add_argument(
        "--gpus",
        default="auto",
        help="a GPU per member, spares included: auto (what the host shows), none, a count, or ids like 0,1,2",
    )
    launch.add_argument(
        "--collective-timeout-s",
        type=float,
        default=LaunchConfig.collective_timeout_s,
        help=f"how long a collective may block (default {MemberConfig.pg_timeout_s:g})",
    )
    launch.add_argument(
        "--heartbeat-batch-s",
        type=float,
        default=LaunchConfig.heartbeat_batch_s,
        help="how often the members' heartbeats go to the detector, in one message (default %(default)g; "
        "keep it within a quarter of the detector's --heartbeat-timeout-s)",
    )
    launch.add_argument(
        "--durable-dir",
        default=MemberConfig.durable_dir,
        help="persist snapshots there as torch.distributed.checkpoint files",
    )
    launch.add_argument(
        "--durable-every-steps",
        type=int,
        default=MemberConfig.durable_every_steps,
        help="persist every N steps (0: by time)",
    )
    launch.add_argument(
        "--durable-every-s",
        type=float,
        default=MemberConfig.durable_every_s,
        help="persist every T seconds too, at the next grid step",
    )
    launch.add_argument(
        "--durable-grid-steps",
        type=int,
        default=MemberConfig.durable_grid_steps,
        help="the grid time-based persists land on",
    )
    launch.add_argument(
        "--durable-keep", type=int, default=MemberConfig.durable_keep, help="persisted steps each rank keeps"
    )
    launch.add_argument(
        "--resume-from",
        default=MemberConfig.resume_from,
        help="start from the newest step every rank has intact in this durable dir",
    )
    launch.add_argument(
        "-m", "--module", action="store_true", help="run the script as a module (python -m), as torchrun -m"
    )
    launch.add_argument("script", help="the training script, or with -m the module")
    launch.add_argument("script_args", nargs=argparse.REMAINDER)

    detector = sub.add_parser("detector", help="run the failure detector")
    _add_nats(detector)
    detector.add_argument("--heartbeat-timeout-s", type=float, default=DetectorConfig.heartbeat_timeout_s)
    detector.add_argument(
        "--hang-factor",
        type=float,
        default=DetectorConfig.hang_factor,
        help="hang: no step for this x the median step",
    )
    detector.add_argument(
        "--hang-floor-s", type=float, default=DetectorConfig.hang_floor_s, help="hang threshold never below this"
    )
    detector.add_argument(
        "--first-step-s",
        type=float,
        default=DetectorConfig.first_step_s,
        help="hang threshold before any step time",
    )
    detector.add_argument(
        "--regroup-after-s",
        type=float,
        default=DetectorConfig.regroup_after_s,
        help="every rank awaiting a rebuild this long, nobody failed: regroup them (0: the heartbeat timeout)",
    )
    detector.add_argument(
        "--rebuild-lag-s",
        type=float,
        default=DetectorConfig.rebuild_lag_s,
        help="a rank still rebuilding this long after another rank of its generation finished: hung",
    )
    detector.add_argument(
        "--rebuild-max-s",
        type=float,
        default=DetectorConfig.rebuild_max_s,
        help="a rank rebuilding one generation this long, whatever the others do: hung (0: no bound)",
    )
    detector.add_argument(
        "--straggler-window",
        type=int,
        default=DetectorConfig.straggler_window,
        help="heartbeats a rank's busy share is judged over before it can be called a straggler",
    )
    detector.add_argument(
        "--io-wait-min-s",
        type=float,
        default=DetectorServiceConfig.io_wait_min_s,
        help="the event loop waits for I/O at most once per this, reading messages in chunks (0: asyncio's own)",
    )
    _add_replicas(detector, DetectorServiceConfig.js_replicas)

    swapper = sub.add_parser("swapper", help="run the swap scheduler")
    _add_nats(swapper)
    swapper.add_argument(
        "--replication", type=int, default=SwapperConfig.replication, help="stores each snapshot goes to"
    )
    swapper.add_argument("--trace-file", default=SwapperServiceConfig.trace_file, help="incident traces as JSON lines")
    swapper.add_argument(
        "--last-call-s",
        type=float,
        default=SwapperConfig.last_call_s,
        help="after a failure, wait this long for others, to swap them in one rebuild (default %(default)s)",
    )
    _add_replicas(swapper, SwapperServiceConfig.js_replicas)

    store = sub.add_parser("store", help="run a snapshot store")
    _add_nats(store)
    store.add_argument("--id", required=True, help="this store's name")
    store.add_argument("--host", default=StoreConfig.host, help="data-plane listen address")
    store.add_argument("--port", type=int, default=StoreConfig.port)
    store.add_argument(
        "--advertise-host", default=StoreConfig.advertise_host, help="address members connect to (default: --host)"
    )
    store.add_argument("--capacity-bytes", type=int, default=StoreConfig.capacity_bytes)
    store.add_argument(
        "--nice", type=int, default=StoreConfig.nice, help="added CPU niceness (e.g. 10 on hosts that also train)"
    )
    store.add_argument(
        "--ingest-threads",
        type=int,
        default=StoreConfig.ingest_threads,
        help="threads receiving uploads (default: one per core the store may run on; 0: all on the event loop)",
    )
    store.add_argument(
        "--node",
        default=StoreConfig.node,
        help="this host's name, as members name theirs (default: DEADPOOL_HOST or the hostname)",
    )
    store.add_argument(
        "--unsealed-max-s",
        type=float,
        default=StoreConfig.unsealed_max_s,
        help="an upload not sealed within this long is freed",
    )

    ping = sub.add_parser("ping", help="health check: exit 0 if this host's instance of SERVICE answers its ping")
    _add_nats(ping)
    ping.add_argument("service", choices=["deadpool-detector", "deadpool-swapper", "deadpool-store"])
    ping.add_argument("--role", default="admin", help="whose credentials to ping with (a container has its own only)")

    timeline = sub.add_parser("timeline", help="draw one recovery (processes by phases) from a trace file")
    timeline.add_argument(
        "--trace-file",
        default=os.environ.get(TRACE_FILE_ENV, ""),
        help="the JSON-lines spans (default: $DEADPOOL_TRACE_FILE; the demo's is RUN_DIR/traces.jsonl)",
    )
    chosen = timeline.add_mutually_exclusive_group()
    chosen.add_argument("--incident", default="", help="the incident's id (as `deadpool status` shows it)")
    chosen.add_argument("--last", action="store_true", help="the last recovery in the file (the default)")
    timeline.add_argument("-o", "--output", required=True, help="FILE.png or FILE.html")

    credentials = sub.add_parser(
        "credentials",
        help="create a deployment's credentials: an nkey per role, the data-plane key, and nats-auth.conf",
    )
    credentials.add_argument("directory", help="where to write them (kept if already there)")
    credentials.add_argument(
        "--store",
        action="append",
        default=[],
        help="also the key of this store (repeatable), which lets it announce its own name and report its own "
        "copies only; give a store's host its own key alone, as store.nk",
    )
    credentials.add_argument(
        "--job",
        action="append",
        default=[],
        help="also the key of this job (repeatable), which its launchers and members hold: it reads and writes "
        "the job's subjects only; reload the NATS servers after adding one (`deadpool up` admits it itself)",
    )

    status = sub.add_parser("status", help="show a job: ranks, spares, committed step, incidents")
    _add_nats(status)
    status.add_argument("job")
    status.add_argument("--json", action="store_true")
    status.add_argument("--watch", action="store_true", help="refresh a live view until Ctrl-C")
    status.add_argument("--interval-s", type=float, default=1.0, help="with --watch: seconds between refreshes")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    command = args.command
    if vars(args).get("tls"):
        os.environ[TLS_ENV] = args.tls  # read where each connection is made, here and in every child
    if command == "detector":
        from deadpool_detector import main as detector_main

        nkey, _ = _role_files(args, "detector")
        try:
            detector_config = DetectorConfig(
                heartbeat_timeout_s=args.heartbeat_timeout_s,
                hang_factor=args.hang_factor,
                hang_floor_s=args.hang_floor_s,
                first_step_s=args.first_step_s,
                regroup_after_s=args.regroup_after_s,
                rebuild_lag_s=args.rebuild_lag_s,
                rebuild_max_s=args.rebuild_max_s,
                straggler_window=args.straggler_window,
            )
            service_config = DetectorServiceConfig(
                args.nats,
                detector=detector_config,
                js_replicas=args.js_replicas,
                nkey_file=nkey,
                io_wait_min_s=args.io_wait_min_s,
            )
        except ValueError as exc:
            sys.exit(f"deadpool detector: {exc}")
        detector_main(service_config)
    elif command == "swapper":
        from deadpool_runtime.credentials import read_dataplane_key, signing_key_file
        from deadpool_swapper import main as swapper_main

        nkey, dataplane_key = _role_files(args, "swapper", dataplane=True)
        try:
            signing_key = read_dataplane_key(signing_key_file(args.credentials))
        except (OSError, ValueError) as exc:
            sys.exit(f"deadpool swapper: {exc}")
        try:
            swapper_config = SwapperServiceConfig(
                args.nats,
                replication=args.replication,
                trace_file=args.trace_file,
                js_replicas=args.js_replicas,
                last_call_s=args.last_call_s,
                nkey_file=nkey,
                dataplane_key=dataplane_key,
                signing_key=signing_key,
            )
            SwapperConfig(replication=args.replication, last_call_s=args.last_call_s)  # checks the values
        except ValueError as exc:
            sys.exit(f"deadpool swapper: {exc}")
        swapper_main(swapper_config)
    elif command == "store":
        from deadpool_store import main as store_main

        nkey, dataplane_key = _role_files(args, "store", dataplane=True)
        store_main(
            StoreConfig(
                args.nats,
                args.id,
                args.host,
                args.port,
                args.advertise_host,
                args.capacity_bytes,
                nice=args.nice,
                ingest_threads=args.ingest_threads,
                node=args.node,
                unsealed_max_s=args.unsealed_max_s,
                nkey_file=nkey,
                dataplane_key=dataplane_key,
            )
        )
    elif command == "launch":
        sys.exit(_launch(args))
    elif command == "up":
        _up(args)
    elif command == "status":
        try:
            sys.exit(asyncio.run(_status(args)))
        except KeyboardInterrupt:  # Ctrl-C while connecting
            sys.exit(0)
    elif command == "ping":
        sys.exit(asyncio.run(_ping(args)))
    elif command == "timeline":
        from deadpool_cli.timeline import PlotsMissingError, draw, pick_trace, read_spans

        if not args.trace_file:
            sys.exit("deadpool timeline: no trace file (--trace-file, or set DEADPOOL_TRACE_FILE)")
        try:
            draw(pick_trace(read_spans(Path(args.trace_file)), args.incident), Path(args.output))
        except (OSError, LookupError, ValueError, PlotsMissingError) as exc:
            sys.exit(f"deadpool timeline: {exc}")
        print(f"timeline written to {args.output}")
    elif command == "credentials":
        from deadpool_cli.nats_auth import create_job_credentials, create_store_credentials, write_server_authorization

        try:
            for store in args.store:
                print(f"store {store}'s key: {create_store_credentials(Path(args.directory), store)}")
            for job in args.job:
                print(f"job {job}'s key: {create_job_credentials(Path(args.directory), job)}")
        except ValueError as exc:
            sys.exit(f"deadpool credentials: {exc}")
        conf = write_server_authorization(Path(args.directory))
        print(f"credentials in {args.directory}; the NATS servers include {conf} (see docs/operations.md)")
        if args.job or args.store:
            print("reload the NATS servers to admit the new keys (nats-server --signal reload, or SIGHUP)")
    elif command == "demo":
        from deadpool_cli.demo import run_demo

        cfg = DemoConfig(
            steps=args.steps,
            nproc=args.nproc,
            spares=args.spares,
            kill_step=args.kill_step,
            kill_rank=args.kill_rank,
            model_size=args.model_size,
            device=args.device,
            gpus=args.gpus,
            seed=args.seed,
            stores=args.stores,
            report=args.report,
            run_dir=args.run_dir,
            reference=not args.no_reference,
            reference_from=args.reference_from,
            fault=args.fault,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            hang_floor_s=args.hang_floor_s,
            hang_factor=args.hang_factor,
            run_timeout_s=args.run_timeout_s,
            host_copy=not args.no_host_copy,
        )
        try:
            sys.exit(asyncio.run(run_demo(cfg)))
        except ValueError as exc:
            sys.exit(f"deadpool demo: {exc}")


def node_plan_of(args: argparse.Namespace, environ: Mapping[str, str]) -> NodePlan:
    """This host's place in the job that `launch`'s arguments and `environ` (Slurm's, Kubernetes')
    describe. Raises ValueError where they disagree."""
    return plan_node(
        script_name=args.script.rsplit(".", 1)[-1] if args.module else Path(args.script).stem,
        nproc=args.nproc,
        job=args.job,
        run=args.run_id,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        world_size=args.world_size,
        rank_offset=args.rank_offset,
        environ=environ,
    )


def _launch(args: argparse.Namespace) -> int:
    from deadpool.cuda_devices import detect_devices, plan_devices
    from deadpool.launcher import Launcher
    from deadpool.member_config import ENV
    from deadpool_cli.stack import Stack
    from deadpool_protocol.names import require_name
    from deadpool_protocol.timeouts import TimeoutHierarchy
    from deadpool_runtime.credentials import job_nkey_file
    from deadpool_runtime.lifecycle import run_service
    from deadpool_runtime.logs import configure_logging, get_logger

    configure_logging("launcher")
    try:
        node = node_plan_of(args, os.environ)
        require_name(node.job, "--job")
        if node.run:
            require_name(node.run, "--run-id")
    except ValueError as exc:
        print(f"deadpool launch: {exc}", file=sys.stderr)
        return 2
    job = node.job
    if node.multi_host and not args.nats:
        print(
            "deadpool launch: a job over several hosts needs a control plane they all reach: --nats URL "
            "(deadpool up --listen ADDRESS, or the deploy/ files)",
            file=sys.stderr,
        )
        return 2
    member_env: dict[str, str] = {}
    if args.snapshot_budget != MemberConfig.snapshot_budget:  # else the members' environment's, or the default
        if not 0 <= args.snapshot_budget < 1:
            print("deadpool launch: --snapshot-budget is a share of step time, from 0 to below 1", file=sys.stderr)
            return 2
        member_env[ENV.SNAPSHOT_BUDGET] = str(args.snapshot_budget)
    if args.snapshot_every is not None:
        if args.snapshot_every != "auto" and not args.snapshot_every.isdigit():
            print("deadpool launch: --snapshot-every is auto or a number of steps", file=sys.stderr)
            return 2
        member_env[ENV.SNAPSHOT_EVERY] = args.snapshot_every
    if args.durable_dir:
        member_env[ENV.DURABLE_DIR] = str(Path(args.durable_dir).resolve())
        member_env[ENV.DURABLE_EVERY_STEPS] = str(args.durable_every_steps)
        member_env[ENV.DURABLE_KEEP] = str(args.durable_keep)
        member_env[ENV.DURABLE_EVERY_S] = str(args.durable_every_s)
        member_env[ENV.DURABLE_GRID_STEPS] = str(args.durable_grid_steps)
    if args.resume_from:
        if not Path(args.resume_from).is_dir():
            print(f"deadpool launch: --resume-from {args.resume_from}: no such directory", file=sys.stderr)
            return 2
        member_env[ENV.RESUME_FROM] = str(Path(args.resume_from).resolve())
    try:
        devices = plan_devices(args.gpus, args.nproc, args.spares, detect_devices())
    except ValueError as exc:
        print(f"deadpool launch: {exc}", file=sys.stderr)
        return 2
    result = {"code": 1}
    workdir = Path(tempfile.mkdtemp(prefix="deadpool-launch-")) if not args.nats else Path()
    stack_config = StackConfig(
        workdir=workdir, trace_file=str(workdir / "traces.jsonl") if not args.nats else "", jobs=(job,)
    )
    if not args.nats:  # this launcher starts the detector too: it knows every level of the hierarchy
        try:
            TimeoutHierarchy(
                env_float(os.environ, ENV.HEARTBEAT_PERIOD_S, MemberConfig.heartbeat_period_s),
                stack_config.heartbeat_timeout_s,
                stack_config.hang_floor_s,
                args.collective_timeout_s or env_float(os.environ, ENV.PG_TIMEOUT_S, MemberConfig.pg_timeout_s),
            ).check()
        except ValueError as exc:
            print(f"deadpool launch: {exc}", file=sys.stderr)
            return 2

    nkey = ""
    if args.nats:
        try:
            nkey = _job_key(args.credentials, job) if not args.nkey else args.nkey
            if nkey and not Path(nkey).is_file():
                raise FileNotFoundError(f"--nkey {nkey}: no such file")
        except (OSError, ValueError) as exc:
            sys.exit(f"deadpool launch: {exc}")

    async def run(stop: asyncio.Event) -> None:
        async def with_url(url: str, nkey: str) -> None:
            if nkey:
                await _admitted(url, nkey, job)
            config = LaunchConfig(
                nats_url=url,
                job=job,
                nproc=args.nproc,
                spares=args.spares,
                command=["-m", args.script, *args.script_args] if args.module else [args.script, *args.script_args],
                world_size=node.world_size,
                rank_offset=node.rank_offset,
                rendezvous_host=args.rendezvous_host,
                respawns=args.respawns,
                collective_timeout_s=args.collective_timeout_s,
                heartbeat_batch_s=args.heartbeat_batch_s,
                extra_env=member_env,
                devices=devices,
                nkey_file=nkey,
                run=node.run,
                hold_without_stores_s=args.hold_without_stores_s,
                host_copy_root="" if args.no_host_copy else LaunchConfig.host_copy_root,
            )
            result["code"] = await Launcher(config, get_logger(job=job)).run(stop)

        if args.nats:
            await with_url(args.nats, nkey)
        else:
            async with Stack(stack_config) as stack:
                print(
                    f"deadpool: embedded NATS and services at {stack.url} (logs in {workdir / 'logs'})",
                    flush=True,
                )
                credentials = stack.credentials or ""
                member_env.update(stack.trace_env)  # the members' spans go where the services' do
                await with_url(stack.url, job_nkey_file(credentials, job))

    run_service(run)
    return result["code"]


JOB_KEY_ADMIT_S = 15.0
"""How long `launch` waits for the NATS servers to admit its job's key (`deadpool up` reloads them
within a second of a new key; a deployment's operator reloads them by hand)."""


def _job_key(credentials: str, job: str) -> str:
    """The job's key in `credentials` ('' without credentials). In the control plane's own directory
    (it holds `admin.nk`, as `deadpool up` writes it) a missing key is created, for `up` to admit; on a
    training host, given only the keys of its jobs, a missing one is an error that says what to do."""
    from deadpool_cli.nats_auth import create_job_credentials
    from deadpool_runtime.credentials import job_nkey_file, job_nkey_path

    if credentials and (Path(credentials) / "admin.nk").is_file() and not job_nkey_path(credentials, job).is_file():
        path = create_job_credentials(Path(credentials), job)
        print(f"deadpool launch: created job {job}'s key, {path}", flush=True)
    return job_nkey_file(credentials, job)


async def _admitted(url: str, nkey: str, job: str) -> None:
    """Wait until the servers admit `nkey` (a key just created is admitted at their next reload), at
    most `JOB_KEY_ADMIT_S`; then the launcher connects as usual. Other failures are the launcher's."""
    import time

    import nats

    from deadpool_protocol.subjects import Subjects
    from deadpool_runtime import server_urls
    from deadpool_runtime.bus import tls_options

    async def quiet(_exc: Exception) -> None:
        pass  # a refusal is expected until the reload: it is not worth a traceback

    deadline = time.monotonic() + JOB_KEY_ADMIT_S
    while True:
        try:
            nc = await nats.connect(
                servers=server_urls(url),
                nkeys_seed=nkey,
                allow_reconnect=False,
                connect_timeout=2,
                inbox_prefix=Subjects.for_job(job).inbox,
                error_cb=quiet,
                **tls_options(),
            )
        except Exception as exc:
            if "authorization" not in str(exc).lower():
                return
            if time.monotonic() > deadline:
                sys.exit(
                    f"deadpool launch: the NATS servers refuse job {job}'s key ({nkey}) after {JOB_KEY_ADMIT_S} s: "
                    "reload them after `deadpool credentials DIR --job JOB` (nats-server --signal reload)"
                )
            await asyncio.sleep(0.2)
        else:
            await nc.close()
            return


def _up(args: argparse.Namespace) -> None:
    from deadpool_cli.stack import Stack
    from deadpool_runtime.host import LOOPBACK
    from deadpool_runtime.lifecycle import run_service

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="deadpool-up-"))

    try:
        config = StackConfig(
            workdir=workdir,
            nats_url=args.nats,
            nats_nodes=args.nats_nodes,
            stores=args.stores,
            swappers=args.swappers,
            detectors=args.detectors,
            trace_file=args.trace_file or str(workdir / "traces.jsonl"),
            auth=not args.insecure,
            credentials=args.credentials if args.nats else "",
            listen=args.listen,
            advertise=args.advertise,
        )
    except ValueError as exc:
        sys.exit(f"deadpool up: {exc}")

    async def run(stop: asyncio.Event) -> None:
        async with Stack(config) as stack:
            print(
                f"deadpool is up: NATS at {stack.url}; {args.detectors} detector(s), {args.swappers} swapper(s) "
                f"(one leads), {args.stores} store(s); logs in {workdir / 'logs'}"
            )
            if stack.credentials:
                print(
                    f"  credentials in {stack.credentials}: give a training host the key of each job it runs, "
                    "jobs/<job>.nk (`deadpool launch --credentials` here creates one, and this command admits it), "
                    "and keep the rest to the control plane"
                )
            else:
                print("  no credentials: the bus and the stores are open to anyone who reaches them")
            print(f"  launch jobs with: deadpool launch {' '.join(stack.nats_args)} --nproc N --spares S train.py ...")
            if config.advertised != LOOPBACK and stack.credentials:
                print(
                    f"  from another host: deadpool launch --nats {stack.url} --nkey JOB.nk --job JOB --nnodes N "
                    "--node-rank I --nproc-per-node G train.py ..., JOB.nk a copy of the job's key that "
                    f"`deadpool credentials {stack.credentials} --job JOB` makes here (and this command admits)"
                )
            print("  Ctrl-C stops everything.", flush=True)
            await stop.wait()

    run_service(run)


async def _ping(args: argparse.Namespace) -> int:
    import nats

    from deadpool_cli.health import answers_from_host
    from deadpool_protocol.subjects import PING_INBOX
    from deadpool_runtime import server_urls
    from deadpool_runtime.bus import tls_options

    nkey, _ = _role_files(args, args.role)
    try:
        nc = await nats.connect(
            servers=server_urls(args.nats),
            nkeys_seed=nkey or None,
            allow_reconnect=False,
            connect_timeout=2,
            inbox_prefix=PING_INBOX,
            **tls_options(),
        )
    except Exception as exc:  # no server, refused credentials: unhealthy, and why
        print(f"deadpool ping: cannot connect to {args.nats}: {exc}", file=sys.stderr)
        return 1
    try:
        if await answers_from_host(nc, args.service):
            return 0
        print(f"deadpool ping: no {args.service} on this host answered", file=sys.stderr)
        return 1
    finally:
        await nc.close()


async def _status(args: argparse.Namespace) -> int:
    import nats

    from deadpool_cli.status_view import show_status
    from deadpool_runtime import server_urls
    from deadpool_runtime.bus import tls_options

    nkey, _ = _role_files(args, "admin")
    nc = await nats.connect(servers=server_urls(args.nats), nkeys_seed=nkey or None, **tls_options())
    stop = asyncio.Event()
    if args.watch:  # Ctrl-C ends the watch after the view being drawn, never by cancelling a request in flight
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    try:
        return await show_status(
            nc, args.job, as_json=args.json, watch_s=args.interval_s if args.watch else 0.0, stop=stop
        )
    finally:
        await nc.close()
