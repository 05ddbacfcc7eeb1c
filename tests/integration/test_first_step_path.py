"""A member's first step of a generation reaches the swapper's stream however its launcher behaves: the
launcher answers once it stored its batch (the member stores nothing itself); no launcher listens, or
one hears and never answers: the member stores the step as an event of its own.

A real member control link on a real nats-server with the events stream; the test plays the swapper's
hello answer and the launcher.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from deadpool import control_link
from deadpool.control_link import ControlLink
from deadpool.member_config import MemberConfig
from deadpool_protocol import StepResumed, Subjects, decode
from deadpool_protocol.events import EVENTS_STREAM
from tests.integration import member_links

JOB = "first-step-path"
S = Subjects.for_job(JOB)
LAUNCHER = "l0"
RESULT_WAIT_S = 20.0


async def member_link(nc: Client, nats_url: str) -> ControlLink:
    config = MemberConfig(JOB, nats_url, "m0", LAUNCHER, 0, 1, "h0", heartbeat_via_launcher=True)
    return await member_links.member_link(nc, nats_url, config)


async def stored_by_the_member(nc: Client) -> StepResumed | None:
    """The first step the member stored as an event of its own, if any."""
    try:
        stored = await nc.jetstream().get_last_msg(EVENTS_STREAM, S.step_resumed)
    except NotFoundError:
        return None
    assert stored.data is not None
    return decode(stored.data, StepResumed)


async def say_first_step(link: ControlLink) -> StepResumed:
    resumed = StepResumed(JOB, 2, "m0", 0, 8, time.time())
    held = await asyncio.wait_for(asyncio.wrap_future(link.step_resumed(resumed)), RESULT_WAIT_S)
    assert held, "the first step was neither taken by the launcher nor stored"
    return resumed


async def test_a_launcher_that_answers_holds_the_first_step_and_the_member_stores_nothing(
    nc: Client, nats_url: str
) -> None:
    heard: list[StepResumed] = []

    async def launcher(msg: Msg) -> None:
        heard.append(decode(msg.data, StepResumed))
        await msg.respond(b"stored")

    await nc.subscribe(S.launcher_step_resumed(LAUNCHER), cb=launcher)
    link = await member_link(nc, nats_url)
    try:
        resumed = await say_first_step(link)
        assert heard == [resumed]
        assert await stored_by_the_member(nc) is None
    finally:
        await asyncio.to_thread(link.close)


@pytest.mark.parametrize("launcher", ["none listens", "hears and never answers"])
async def test_without_the_launchers_answer_the_member_stores_its_first_step_itself(
    nc: Client, nats_url: str, launcher: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control_link, "RESUMED_ANSWER_S", 0.5)
    heard: list[Msg] = []

    async def silent_launcher(msg: Msg) -> None:
        heard.append(msg)

    if launcher == "hears and never answers":
        await nc.subscribe(S.launcher_step_resumed(LAUNCHER), cb=silent_launcher)
    link = await member_link(nc, nats_url)
    try:
        resumed = await say_first_step(link)
        assert await stored_by_the_member(nc) == resumed
        assert len(heard) == (1 if launcher == "hears and never answers" else 0)
    finally:
        await asyncio.to_thread(link.close)
