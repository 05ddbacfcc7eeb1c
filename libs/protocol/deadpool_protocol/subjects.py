"""Every NATS subject DeadPool uses, in one place.

Job-scoped subjects are `deadpool.<job>.<topic>`; services that serve every job subscribe with `*` in
the job position (see `Subjects.any_job`). Stores are shared by jobs and announce themselves on a
job-less subject.
"""

from __future__ import annotations

from dataclasses import dataclass

from deadpool_protocol.names import require_name

__all__ = ["PREFIX", "STORE_STATUS", "SWAPPER_STATUS", "Subjects", "store_replicate"]

PREFIX = "deadpool"
STORE_STATUS = f"{PREFIX}.store.status"
SWAPPER_STATUS = f"{PREFIX}.swapper.status"


def store_replicate(store: str) -> str:
    """Where the swapper asks one store to copy a snapshot to another (`Replicate`)."""
    return f"{PREFIX}.store.{require_name(store, 'store')}.replicate"


@dataclass(frozen=True)
class Subjects:
    """The subjects of one job (or of every job when `job` is `*`)."""

    job: str

    @classmethod
    def for_job(cls, job: str) -> Subjects:
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
    def void(self) -> str:
        """The swapper's notice that a generation will not (or no longer) train: `GenerationVoid`."""
        return self._s("void")

    @property
    def placement(self) -> str:
        """The swapper's new snapshot placement within a generation (`Placement`)."""
        return self._s("placement")

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

    @property
    def snapshot_complete(self) -> str:
        return self._s("snapshot.complete")
