"""Every NATS subject DeadPool uses, in one place.

Job-scoped subjects are `deadpool.<job>.<topic>`; services that serve every job subscribe with `*` in
the job position (see `Subjects.any_job`). Stores are shared by jobs and announce themselves on a
job-less subject of their own. A subject names who may publish on it (a job, a store): the server lets
each key publish on its own only, and the services check that the message names the same
(`codec.subject_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass

from deadpool_protocol.names import require_name

__all__ = [
    "PING_INBOX",
    "PREFIX",
    "STORE_STATUS",
    "SWAPPER_STATUS",
    "Subjects",
    "service_inbox",
    "store_announce",
    "store_replicate",
    "store_reserve",
]

PREFIX = "deadpool"
SERVICE_TOPICS = frozenset({"store", "swapper"})
"""The subjects `deadpool.store.…` and `deadpool.swapper.…` are the services' own, not a job's: no job
may take these names."""
STORE_STATUS = f"{PREFIX}.store.*.announce"
"""Every store's announcements (`store_announce`): what the swapper and operators subscribe to."""
SWAPPER_STATUS = f"{PREFIX}.swapper.status"


PING_INBOX = f"_INBOX.{PREFIX}-ping"
"""The replies to a health check (`deadpool ping`): every service's key may read them (they say which
instances answered, nothing secret), so each can check its own with its own key."""


def store_announce(store: str) -> str:
    """Where store `store` announces itself (`StoreStatus`): its key may publish there and nowhere else
    of the kind, so a store cannot announce another's name."""
    return f"{PREFIX}.store.{require_name(store, 'store')}.announce"


def service_inbox(role: str, instance: str = "") -> str:
    """The reply subjects of a service's own requests (its NATS `inbox_prefix`): a service reads its own
    replies only, never a job's (which carry the job's token and seal key)."""
    name = f"{role}.{require_name(instance, 'instance')}" if instance else role
    return f"_INBOX.{PREFIX}-{name}"


def store_replicate(store: str) -> str:
    """Where the swapper asks one store to copy a snapshot to another (`Replicate`)."""
    return f"{PREFIX}.store.{require_name(store, 'store')}.replicate"


def store_reserve(store: str) -> str:
    """Where the swapper tells a store which ranks' snapshots it placed there, and their sizes (`Reserve`)."""
    return f"{PREFIX}.store.{require_name(store, 'store')}.reserve"


@dataclass(frozen=True)
class Subjects:
    """The subjects of one job (or of every job when `job` is `*`)."""

    job: str

    @classmethod
    def for_job(cls, job: str) -> Subjects:
        if job in SERVICE_TOPICS:
            raise ValueError(f"job {job!r}: a name kept for the services' own subjects")
        return cls(require_name(job, "job"))

    @classmethod
    def any_job(cls) -> Subjects:
        return cls("*")

    def _s(self, topic: str) -> str:
        return f"{PREFIX}.{self.job}.{topic}"

    @property
    def inbox(self) -> str:
        """The prefix of the reply subjects of the job's members' requests (their NATS `inbox_prefix`):
        per job, so that a job's member credentials can be let read its own replies and no other's."""
        return f"_INBOX.{PREFIX}.{self.job}"

    # members -> services
    @property
    def hello(self) -> str:
        """Request/reply: a member registers with the swapper."""
        return self._s("member.hello")

    @property
    def heartbeat(self) -> str:
        return self._s("member.heartbeat")

    @property
    def member_error(self) -> str:
        return self._s("member.error")

    @property
    def member_done(self) -> str:
        return self._s("member.done")

    @property
    def rebuild_ack(self) -> str:
        return self._s("member.ack")

    @property
    def step_resumed(self) -> str:
        """A rank's first completed step of a generation (`StepResumed`)."""
        return self._s("member.resumed")

    @property
    def snapshot_interval(self) -> str:
        """A rank's snapshot interval, to its peers (`SnapshotInterval`)."""
        return self._s("member.interval")

    # launchers
    @property
    def run_start(self) -> str:
        """Request/reply: a launcher starts a run of the job (`RunStart`)."""
        return self._s("launcher.run")

    @property
    def child_exit(self) -> str:
        return self._s("launcher.exit")

    @property
    def heartbeat_batch(self) -> str:
        """A launcher's batch of its members' heartbeats (one message per host per period)."""
        return self._s("launcher.heartbeats")

    @property
    def rebuild_ack_batch(self) -> str:
        """A launcher's batch of its members' rebuild acks (`RebuildAckBatch`), an event."""
        return self._s("launcher.acks")

    @property
    def step_resumed_batch(self) -> str:
        """A launcher's batch of its members' first steps of a generation (`StepResumedBatch`), an event."""
        return self._s("launcher.resumed")

    def launcher_step_resumed(self, launcher: str) -> str:
        """Request/reply: where a launched member sends its first step of a generation: to its launcher,
        which batches them and answers once the batch holding it is stored."""
        return self._s(f"launcher.{require_name(launcher, 'launcher')}.resumed")

    def launcher_ack(self, launcher: str) -> str:
        """Where a launched member sends its rebuild ack: to its launcher, which batches them."""
        return self._s(f"launcher.{require_name(launcher, 'launcher')}.ack")

    def launcher_heartbeat(self, launcher: str) -> str:
        """Where a launched member sends its heartbeats: to its launcher, which batches them."""
        return self._s(f"launcher.{require_name(launcher, 'launcher')}.heartbeat")

    def fence(self, launcher: str) -> str:
        """Request/reply: the swapper asks one launcher to SIGKILL a member."""
        return self._s(f"launcher.{require_name(launcher, 'launcher')}.fence")

    # services -> services and members
    @property
    def failure(self) -> str:
        return self._s("failure")

    @property
    def rebuild(self) -> str:
        return self._s("rebuild")

    @property
    def rebuild_delta(self) -> str:
        """Each rebuild as its changes from the generation before (`RebuildDelta`), beside it whole."""
        return self._s("rebuild_delta")

    @property
    def void(self) -> str:
        """The swapper's notice that a generation will not (or no longer) train: `GenerationVoid`."""
        return self._s("void")

    @property
    def placement(self) -> str:
        """The swapper's new snapshot placement within a generation (`Placement`)."""
        return self._s("placement")

    @property
    def placement_delta(self) -> str:
        """Each placement as its changes from the one before (`PlacementDelta`), beside it whole."""
        return self._s("placement_delta")

    @property
    def commit(self) -> str:
        return self._s("commit")

    @property
    def finished(self) -> str:
        return self._s("finished")

    @property
    def incident(self) -> str:
        return self._s("incident")

    @property
    def straggler(self) -> str:
        return self._s("straggler")

    @property
    def group_broken(self) -> str:
        """The detector's verdict that a generation's group broke with every member alive."""
        return self._s("group.broken")

    def snapshot_complete_by(self, store: str) -> str:
        """Where store `store` reports the job's snapshots it sealed (`SnapshotComplete`)."""
        return self._s(f"snapshot.complete.{require_name(store, 'store')}")

    @property
    def snapshot_complete(self) -> str:
        """Every store's reports of the job's sealed snapshots (`snapshot_complete_by`)."""
        return self._s("snapshot.complete.*")
