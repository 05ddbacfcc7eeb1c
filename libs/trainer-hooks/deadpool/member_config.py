"""How a training process learns who it is: environment variables set by `deadpool launch`.

No torch here: the launcher imports this module too.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

from deadpool_protocol import NO_RANK
from deadpool_protocol.errors import DeadPoolError
from deadpool_protocol.names import require_name
from deadpool_protocol.timeouts import COLLECTIVE_TIMEOUT_S_DEFAULT, HEARTBEAT_PERIOD_S_DEFAULT
from deadpool_runtime.credentials import NKEY_ENV
from deadpool_runtime.host import host_name

__all__ = ["ENV", "MemberConfig", "NotLaunchedError", "env_float", "host_name"]


class NotLaunchedError(DeadPoolError, RuntimeError):
    """The process was not started by `deadpool launch`, so it has no job, member id or NATS address."""


class ENV(enum.StrEnum):
    """The variables' names. Unset, each gives `MemberConfig`'s default for its field. A boolean one
    (`SNAPSHOT_PARTITION`, `HEARTBEAT_VIA_LAUNCHER`) is on for 1, true, yes or on and off for 0, false,
    no or off, in any case; any other value is refused (`_env_bool`)."""

    JOB = "DEADPOOL_JOB"
    NATS_URL = "DEADPOOL_NATS_URL"
    NATS_NKEY = NKEY_ENV
    """The job's own NATS nkey seed file (where the server has auth)."""
    MEMBER = "DEADPOOL_MEMBER"
    LAUNCHER = "DEADPOOL_LAUNCHER"
    RUN = "DEADPOOL_RUN"
    """The run of the job the member was started in (its launcher started it: `RunStart`)."""
    RANK_HINT = "DEADPOOL_RANK_HINT"
    WORLD_SIZE = "DEADPOOL_WORLD_SIZE"
    HOST = "DEADPOOL_HOST"
    RENDEZVOUS_HOST = "DEADPOOL_RENDEZVOUS_HOST"
    HEARTBEAT_PERIOD_S = "DEADPOOL_HEARTBEAT_PERIOD_S"
    PG_TIMEOUT_S = "DEADPOOL_PG_TIMEOUT_S"
    REBUILD_WAIT_S = "DEADPOOL_REBUILD_WAIT_S"
    HELLO_WAIT_S = "DEADPOOL_HELLO_WAIT_S"
    RENDEZVOUS_WAIT_S = "DEADPOOL_RENDEZVOUS_WAIT_S"
    BACKEND = "DEADPOOL_BACKEND"
    SNAPSHOT_EVERY = "DEADPOOL_SNAPSHOT_EVERY"
    SNAPSHOT_BUDGET = "DEADPOOL_SNAPSHOT_BUDGET"
    SNAPSHOT_PARTITION = "DEADPOOL_SNAPSHOT_PARTITION"
    SNAPSHOT_CHAIN = "DEADPOOL_SNAPSHOT_CHAIN"
    SNAPSHOT_STREAM_NICE = "DEADPOOL_SNAPSHOT_STREAM_NICE"
    STATS_DIR = "DEADPOOL_STATS_DIR"
    SNAPSHOT_WAIT_S = "DEADPOOL_SNAPSHOT_WAIT_S"
    DURABLE_DIR = "DEADPOOL_DURABLE_DIR"
    DURABLE_EVERY_STEPS = "DEADPOOL_DURABLE_EVERY_STEPS"
    DURABLE_KEEP = "DEADPOOL_DURABLE_KEEP"
    DURABLE_EVERY_S = "DEADPOOL_DURABLE_EVERY_S"
    DURABLE_GRID_STEPS = "DEADPOOL_DURABLE_GRID_STEPS"
    RESUME_FROM = "DEADPOOL_RESUME_FROM"
    HEARTBEAT_VIA_LAUNCHER = "DEADPOOL_HEARTBEAT_VIA_LAUNCHER"
    LOCAL_INDEX = "DEADPOOL_LOCAL_INDEX"
    """The member's slot on its host (0 .. ranks + spares - 1; a respawn takes its dead member's)."""
    HOST_COPY_DIR = "DEADPOOL_HOST_COPY_DIR"
    """The launcher's directory for the job's host-local crash copies (`host_copy`); unset: none."""
    DEVICE = "DEADPOOL_DEVICE"
    """The index of the member's own GPU among those it sees (`cuda_devices`), when it was given one."""


@dataclass(frozen=True)
class MemberConfig:
    job: str
    nats_url: str
    member: str
    launcher: str
    rank_hint: int
    world_size: int
    host: str
    rendezvous_host: str = "127.0.0.1"
    run: str = ""
    """The run of the job this member belongs to ('' where no launcher started one)."""
    heartbeat_period_s: float = HEARTBEAT_PERIOD_S_DEFAULT
    pg_timeout_s: float = COLLECTIVE_TIMEOUT_S_DEFAULT
    """How long a collective may block before gloo/NCCL gives up: the last line of defence. Aborting a
    broken group releases blocked collectives at once, except one case gloo cannot interrupt (a
    collective's send still waiting for a peer that has left, see docs/architecture.md); that member
    stays blocked until this timeout."""
    rebuild_wait_s: float = 300.0
    """How long a member that left a broken collective, or could not form a generation, waits for the
    swapper's next command: a last resort (the swapper answers every failure within seconds)."""
    hello_wait_s: float = 600.0
    """How long a member waits for the swapper to answer its hello (no swapper leads: DeadPool is not
    up, or its JetStream is away); past it the member ends saying so, like torchrun's join timeout."""
    rendezvous_wait_s: float = 0.0
    """How long a member keeps trying to reach a generation's rendezvous store (unless the generation
    is superseded first); 0 means the collective timeout."""
    backend: str = ""
    """'gloo' or 'nccl'; empty means nccl when CUDA is available, else gloo."""
    snapshot_chunk_bytes: int = 4 * 1024 * 1024
    snapshot_every: int | None = None
    """Stream a snapshot after every `snapshot_every`-th step; None (the default, `auto`): every K-th,
    K chosen by the job within `snapshot_budget` (`deadpool.snapshot_cadence`); 0 turns per-step
    snapshots off (the step-0 snapshot taken when the job forms stays, so a failure still has a step
    to go back to)."""
    snapshot_budget: float = 0.01
    """The share of step time a step may wait for the previous snapshot stream before its own is
    skipped and the interval grows (adaptive interval only)."""
    snapshot_partition: bool = True
    """Under data parallelism, snapshot only this rank's share of the replicated parameters."""
    snapshot_chain: bool = True
    """Upload each snapshot once, to its first store, which passes it on to the others store to store
    (`deadpool_protocol.dataplane`); off: the member uploads to each of its R stores itself."""
    snapshot_stream_nice: int = 0
    """CPU niceness of the thread that streams snapshots (0-19; 0: like training). Raise it only where
    training saturates the CPU and step time matters more than snapshot freshness: see
    `deadpool.snapshot_worker`."""
    snapshot_wait_s: float = 60.0
    """How long a capture may wait for the previous snapshot to finish streaming (every rank snapshots
    every step it is due, so commits keep pace: see `deadpool.snapshot_worker`); past it, the uploads
    in progress are abandoned. A lost store's uploads are abandoned long before, when the swapper
    places the snapshots elsewhere."""
    durable_dir: str = ""
    """Persist snapshots there as `torch.distributed.checkpoint` files (`deadpool.durable_tier`); '' off."""
    durable_every_steps: int = 100
    """Persist every N steps (0: only by time)."""
    durable_every_s: float = 0.0
    """Persist every T seconds too (0: off), at the next step on a grid of `durable_grid_steps`."""
    durable_grid_steps: int = 10
    durable_keep: int = 3
    """Persisted steps each rank keeps."""
    resume_from: str = ""
    """A durable directory the job starts from when it forms (the newest step every rank has intact)."""
    heartbeat_via_launcher: bool = False
    """Send heartbeats to the launcher, which batches its members' beats (set by `deadpool launch`)."""
    stats_dir: str = ""
    """If set, each member writes its per-step timings there as `<member>.json` when it closes."""
    nats_nkey: str = ""
    """The job's own NATS nkey seed file ('' where the server has no auth)."""
    host_copy_dir: str = ""
    """Where the member's snapshot buffers live as files in the host's shared memory, so that they
    outlive it (`deadpool.host_copy`; set by `deadpool launch`); '' keeps them in the process."""

    def __post_init__(self) -> None:
        require_name(self.job, "job")
        require_name(self.member, "member")
        if self.launcher:
            require_name(self.launcher, "launcher")
        if self.run:
            require_name(self.run, "run")
        if self.world_size < 1:
            raise ValueError("world_size must be at least 1")
        if not (0 < self.heartbeat_period_s < self.rebuild_wait_s):
            raise ValueError("heartbeat_period_s must be positive and below rebuild_wait_s")
        if self.pg_timeout_s <= 3 * self.heartbeat_period_s:
            raise ValueError(
                f"pg_timeout_s ({self.pg_timeout_s}) must be well above heartbeat_period_s "
                f"({self.heartbeat_period_s}): see deadpool_protocol.timeouts"
            )
        if self.hello_wait_s <= 0:
            raise ValueError("hello_wait_s must be positive")
        if self.rendezvous_wait_s < 0:
            raise ValueError("rendezvous_wait_s must not be negative")
        if self.rendezvous_wait_s == 0:
            object.__setattr__(self, "rendezvous_wait_s", self.pg_timeout_s)
        if self.snapshot_every is not None and self.snapshot_every < 0:
            raise ValueError("snapshot_every must be 0 (off), a positive number of steps, or None (auto)")
        if not 0 <= self.snapshot_budget < 1:
            raise ValueError(f"snapshot_budget is a share of step time, from 0 to below 1: {self.snapshot_budget}")
        if self.durable_every_steps < 0 or self.durable_every_s < 0 or self.durable_keep < 1:
            raise ValueError("durable_every_steps and durable_every_s must not be negative, durable_keep positive")
        if self.durable_dir and not (self.durable_every_steps or self.durable_every_s):
            raise ValueError("a durable tier persists every N steps or T seconds: set one of them")
        if self.durable_grid_steps < 1:
            raise ValueError("durable_grid_steps must be at least 1")
        if self.snapshot_wait_s <= 0:
            raise ValueError("snapshot_wait_s must be positive")
        if not 0 <= self.snapshot_stream_nice <= 19:
            raise ValueError(f"snapshot_stream_nice must be 0 to 19, not {self.snapshot_stream_nice}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MemberConfig:
        env = os.environ if env is None else env
        missing = [k for k in (ENV.JOB, ENV.NATS_URL, ENV.MEMBER, ENV.WORLD_SIZE) if not env.get(k)]
        if missing:
            raise NotLaunchedError(
                f"{', '.join(missing)} not set: start this script with `deadpool launch --nproc N --spares S "
                "script.py` (or set the DEADPOOL_* variables yourself)"
            )
        return cls(
            job=env[ENV.JOB],
            nats_url=env[ENV.NATS_URL],
            nats_nkey=_env_str(env, ENV.NATS_NKEY, cls.nats_nkey),
            member=env[ENV.MEMBER],
            launcher=_env_str(env, ENV.LAUNCHER, ""),
            run=_env_str(env, ENV.RUN, cls.run),
            rank_hint=_env_int(env, ENV.RANK_HINT, NO_RANK),
            world_size=int(env[ENV.WORLD_SIZE]),
            host=env.get(ENV.HOST) or host_name(),
            rendezvous_host=_env_str(env, ENV.RENDEZVOUS_HOST, cls.rendezvous_host),
            heartbeat_period_s=env_float(env, ENV.HEARTBEAT_PERIOD_S, cls.heartbeat_period_s),
            pg_timeout_s=env_float(env, ENV.PG_TIMEOUT_S, cls.pg_timeout_s),
            rebuild_wait_s=env_float(env, ENV.REBUILD_WAIT_S, cls.rebuild_wait_s),
            hello_wait_s=env_float(env, ENV.HELLO_WAIT_S, cls.hello_wait_s),
            rendezvous_wait_s=env_float(env, ENV.RENDEZVOUS_WAIT_S, cls.rendezvous_wait_s),
            backend=_env_str(env, ENV.BACKEND, cls.backend),
            snapshot_every=_env_every(env),
            snapshot_budget=env_float(env, ENV.SNAPSHOT_BUDGET, cls.snapshot_budget),
            snapshot_partition=_env_bool(env, ENV.SNAPSHOT_PARTITION, cls.snapshot_partition),
            snapshot_chain=_env_bool(env, ENV.SNAPSHOT_CHAIN, cls.snapshot_chain),
            snapshot_stream_nice=_env_int(env, ENV.SNAPSHOT_STREAM_NICE, cls.snapshot_stream_nice),
            snapshot_wait_s=env_float(env, ENV.SNAPSHOT_WAIT_S, cls.snapshot_wait_s),
            durable_dir=_env_str(env, ENV.DURABLE_DIR, cls.durable_dir),
            durable_every_steps=_env_int(env, ENV.DURABLE_EVERY_STEPS, cls.durable_every_steps),
            durable_keep=_env_int(env, ENV.DURABLE_KEEP, cls.durable_keep),
            durable_every_s=env_float(env, ENV.DURABLE_EVERY_S, cls.durable_every_s),
            durable_grid_steps=_env_int(env, ENV.DURABLE_GRID_STEPS, cls.durable_grid_steps),
            resume_from=_env_str(env, ENV.RESUME_FROM, cls.resume_from),
            stats_dir=_env_str(env, ENV.STATS_DIR, cls.stats_dir),
            heartbeat_via_launcher=_env_bool(env, ENV.HEARTBEAT_VIA_LAUNCHER, cls.heartbeat_via_launcher),
            host_copy_dir=_env_str(env, ENV.HOST_COPY_DIR, cls.host_copy_dir),
        )


_ENV_TRUE = frozenset({"1", "true", "yes", "on"})
"""The spellings of a boolean variable that turn its setting on (any case)."""
_ENV_FALSE = frozenset({"0", "false", "no", "off"})
"""The spellings that turn it off (any case)."""


def _env_bool(env: Mapping[str, str], key: str, default: bool) -> bool:
    """`key` as a boolean: `default` if unset or empty, on or off for the spellings above, and any other
    value refused (`ValueError` naming the variable), like a malformed number.

    Before this one way, each variable had its own: partitioning was off only for '0', 'false' or
    'no' and on for anything else; heartbeats via the launcher were on only for '1' and off for
    anything else. What the launcher writes ('1', '0') means what it meant; a value one of them read
    one way and the other the other ('true' was off for heartbeats via the launcher) now means what it
    says, and a typo is refused instead of read silently."""
    value = env.get(key, "").strip().lower()
    if not value:
        return default
    if value in _ENV_TRUE:
        return True
    if value in _ENV_FALSE:
        return False
    spellings = ", ".join(sorted(_ENV_TRUE | _ENV_FALSE))
    raise ValueError(f"{key}={env[key]!r} is not a boolean: use one of {spellings}")


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    """`key` as an integer, `default` if unset (an empty or malformed value raises `ValueError`)."""
    value = env.get(key)
    return default if value is None else int(value)


def _env_every(env: Mapping[str, str]) -> int | None:
    """`DEADPOOL_SNAPSHOT_EVERY`: None (the job chooses) if unset or `auto`, else a number of steps."""
    value = env.get(ENV.SNAPSHOT_EVERY)
    return None if value is None or value.strip().lower() == "auto" else int(value)


def env_float(env: Mapping[str, str], key: str, default: float) -> float:
    """`key` as a float, `default` if unset (an empty or malformed value raises `ValueError`)."""
    value = env.get(key)
    return default if value is None else float(value)


def _env_str(env: Mapping[str, str], key: str, default: str) -> str:
    """`key` as it is (empty included), `default` if unset."""
    return env.get(key, default)
