"""`deadpool status JOB [--watch]`: a job as the swapper and the detector see it.

The swapper answers with the job's record (ranks, spares, committed step, stores, incidents); the
detector with what heartbeats tell (each member's step, its last heartbeat's age, the job's median
step time). `--watch` redraws the view every interval until Ctrl-C; a service that does not answer is
shown as such and asked again next time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from deadpool_protocol import SWAPPER_STATUS
from deadpool_protocol.errors import DeadPoolError

__all__ = ["DETECTOR_STATUS", "render", "show_status"]

DETECTOR_STATUS = "deadpool.detector.status"
ANSWER_WAIT_S = 3.0
INCIDENTS_SHOWN = 5
CLEAR_SCREEN = "\x1b[H\x1b[2J"


class NoAnswerError(DeadPoolError, RuntimeError):
    pass


async def _ask(nc: Client, subject: str, payload: bytes) -> Any:
    try:
        msg = await nc.request(subject, payload, timeout=ANSWER_WAIT_S)
    except (NoRespondersError, NatsTimeoutError):
        raise NoAnswerError(f"nobody answered on {subject}") from None
    if msg.headers and msg.headers.get("Nats-Service-Error"):
        raise NoAnswerError(msg.headers["Nats-Service-Error"])
    return json.loads(msg.data)


def render(state: dict[str, Any], watched: dict[str, Any] | None) -> list[str]:
    """The job's view as lines: `state` from the swapper, `watched` the detector's view of the job
    (None when no detector answered)."""
    ended = f", ended: {state['failed_reason']}" if state.get("failed_reason") else ""
    finished = ", finished" if state["finished"] and not ended else ""
    lines = [
        f"job {state['job']}: generation {state['generation']}, world size {state['world_size']}, "
        f"committed step {state['committed_step']}{finished}{ended}",
        f"  swapper leader: {state.get('leader', '?')}",
    ]
    members = (watched or {}).get("watched", {})
    median = (watched or {}).get("median_step_s")
    step_time = f"{median:.3f} s" if isinstance(median, int | float) else "?"
    if watched is None:
        lines.append("  (no detector answered: steps and heartbeats unknown)")
    for rank, member in enumerate(state["ranks"]):
        info = state["members"].get(member, {})
        beat = members.get(member, {})
        seen = (
            f"{_phase(beat)}step {beat['step']}{_crash_copy(beat)}, heartbeat {beat['heartbeat_age_s']:.1f} s ago"
            if beat
            else "no heartbeat yet"
        )
        lines.append(
            f"  rank {rank}: {member} (host {info.get('host', '?')}, pid {info.get('pid', '?')}): {seen}, "
            f"step time {step_time}"
        )
    spares = [f"{name} ({_phase(members[name]).rstrip(', ')})" if name in members else name for name in state["spares"]]
    lines.append(f"  spares: {', '.join(spares) or 'none'}")
    lag, short = state.get("commit_lag_steps", 0), state.get("replicas_short", 0)
    lines.append(f"  commit lag: {lag} step(s) stored past the committed one; ranks short of replicas: {short}")
    if every := _interval([beat for m, beat in members.items() if m in state["ranks"]]):
        lines.append(
            f"  snapshots streamed every {every} step(s): a lost host loses at most {2 * every - 1}, a crashed process "
            "at most 1 where its crash copy is kept"
        )
    placement = state.get("placement", [])
    for store in state["stores"]:
        ranks = [r for r, names in enumerate(placement) if store["store"] in names]
        used, capacity = store.get("used_bytes", 0), store.get("capacity_bytes", 0)
        lines.append(
            f"  store {store['store']} ({store.get('node') or store['host']}:{store['port']}): "
            f"{used / 2**20:.1f} of {capacity / 2**20:.0f} MiB, {store.get('snapshots', 0)} snapshot(s), "
            f"{store.get('unsealed', 0)} upload(s) open, ranks {ranks}"
        )
    if not state["stores"]:
        lines.append("  stores: none alive")
    unprotected = state.get("unprotected")
    if unprotected:
        steps = [beat["step"] for beat in members.values() if beat.get("rank", -1) >= 0]
        since = unprotected["since_committed_step"]
        at_risk = f"{max(steps) - since} step(s) at risk" if steps else "steps at risk unknown (no heartbeats)"
        lines.append(
            f"  UNPROTECTED for {unprotected['for_s']:.0f} s: no snapshot store receives this job's snapshots "
            f"since committed step {since}; {at_risk} (a lost rank restores from the durable tier, if any)"
        )
    for inc in state["incidents"][-INCIDENTS_SHOWN:]:
        lines.append(
            f"  incident {inc['incident_id']}: rank {inc['rank']} {inc['reason']}, downtime {inc['downtime_s']:.3f} s, "
            f"lost {inc['lost_steps']} step(s)"
        )
    return lines


def _interval(beats: list[dict[str, Any]]) -> int:
    """The job's snapshot interval: the longest one its ranks' heartbeats name (0: none named)."""
    named = [b["snapshot_every"] for b in beats if isinstance(b.get("snapshot_every"), int)]
    return max(named, default=0)


def _crash_copy(beat: dict[str, Any]) -> str:
    """' (crash copy: step 41)' from a heartbeat's newest step held whole on its host ('' if none)."""
    local = beat.get("local_step", -1)
    return f" (crash copy: step {local})" if isinstance(local, int) and local >= 0 else ""


def _phase(beat: dict[str, Any]) -> str:
    """'rebuilding (form), ' from a heartbeat's phase and rebuild state ('' from a detector that sends none)."""
    phase, state = beat.get("phase", ""), beat.get("rebuild_state", "")
    if not phase:
        return ""
    return f"{phase} ({state}), " if state else f"{phase}, "


async def _view(nc: Client, job: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    state = await _ask(nc, SWAPPER_STATUS, job.encode())
    try:
        watched = (await _ask(nc, DETECTOR_STATUS, b"")).get(job)
    except NoAnswerError:
        watched = None
    return state, watched


async def show_status(
    nc: Client, job: str, as_json: bool = False, watch_s: float = 0.0, stop: asyncio.Event | None = None
) -> int:
    """Print the job once (exit code 0; 2 if no swapper answered), or every `watch_s` until `stop` is set
    (Ctrl-C). Why an event and not the task's cancellation: under Python 3.11 a cancellation that meets
    a request's reply can be swallowed, and the watch then went on drawing after Ctrl-C."""
    stop = stop or asyncio.Event()
    while not stop.is_set():
        try:
            state, watched = await _view(nc, job)
        except NoAnswerError as exc:
            if not watch_s:
                print(f"no swapper answered: {exc}", file=sys.stderr)
                return 2
            print(f"{CLEAR_SCREEN}job {job}: no swapper answered ({exc}); asking again", flush=True)
        else:
            if as_json:
                print(json.dumps({**state, "detector": watched}, indent=2), flush=True)
            else:
                prefix = CLEAR_SCREEN if watch_s else ""
                print(prefix + "\n".join(render(state, watched)), flush=True)
        if not watch_s:
            return 0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), watch_s)
    return 0
