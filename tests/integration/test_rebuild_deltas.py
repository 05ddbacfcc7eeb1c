"""A member takes a rebuild from its delta when it holds the generation before, hears whole rebuilds
only while it holds none a delta can go from, and takes the whole command when a delta does not go
from what it holds (a placement it missed, a notice with no base). Placements within a generation go
the same way: from their deltas, and whole only when a delta does not apply.

A real member control link on a real nats-server; the test plays the swapper: its hello answer, and
each command and placement whole and as its delta (`rebuild_delta.delta_of`,
`placement_delta.placement_delta_of`), as the swapper publishes them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from nats.aio.client import Client

from deadpool.control_link import ControlLink
from deadpool.member_config import MemberConfig
from deadpool_protocol import (
    Placement,
    PlacementDelta,
    Rebuild,
    RebuildDelta,
    StoreAddress,
    Subjects,
    encode,
)
from deadpool_protocol.placement_delta import placement_delta_of, placement_notice
from deadpool_protocol.rebuild_delta import delta_of, notice_of
from tests.integration import member_links

JOB = "rebuild-deltas"
S = Subjects.for_job(JOB)
WAIT_S = 20.0
RETRANSMIT_S = 0.2
STORES = [StoreAddress(f"s{i}", "127.0.0.1", 5000 + i) for i in range(3)]
RANKS = ["m0", "m1", "m2", "m3"]


def command(generation: int, ranks: list[str], placement: list[list[str]], spares: list[str]) -> Rebuild:
    return Rebuild(
        JOB, generation, len(ranks), ranks, spares, ranks[0], "127.0.0.1", 4000, 7, STORES, placement, "", time.time()
    )


async def member_link(nc: Client, nats_url: str) -> ControlLink:
    return await member_links.member_link(nc, nats_url, MemberConfig(JOB, nats_url, "m1", "l0", 1, 4, "h0"))


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        await asyncio.sleep(0.01)


async def sent_until_held(nc: Client, link: ControlLink, whole: Rebuild, delta: RebuildDelta) -> Rebuild:
    """Publish `delta` then `whole` as the swapper does, again every `RETRANSMIT_S` (its retransmission)
    until the member holds their generation; what it holds."""
    deadline = time.monotonic() + WAIT_S
    while True:
        await nc.publish(S.rebuild_delta, encode(delta))
        await nc.publish(S.rebuild, encode(whole))
        held = await asyncio.to_thread(link.wait_command, whole.generation - 1, RETRANSMIT_S)
        if isinstance(held, Rebuild) and held.generation == whole.generation:
            return held
        assert time.monotonic() < deadline, f"generation {whole.generation} not held within {WAIT_S} s"


async def test_a_member_takes_each_next_generation_from_its_delta_and_the_whole_one_when_it_cannot(
    nc: Client, nats_url: str
) -> None:
    link = await member_link(nc, nats_url)
    try:
        assert link.hears_whole_rebuilds(), "a member that holds no command hears whole ones"
        first = command(1, RANKS, [["s0", "s1"], ["s1", "s2"], ["s2", "s0"], ["s0", "s1"]], ["m4", "m5"])
        assert await sent_until_held(nc, link, first, notice_of(first)) == first  # a formation: no base
        await until(lambda: not link.hears_whole_rebuilds(), "the member leaves whole rebuilds once it holds one")

        # m2's rank goes to the spare m4, and its stores change: the delta alone is published.
        second = command(2, ["m0", "m1", "m4", "m3"], [*first.placement[:2], ["s1", "s0"], first.placement[3]], ["m5"])
        delta = delta_of(second, 1, 0, first.ranks, first.placement)
        assert (delta.moved, delta.movers, delta.replaced) == ([2], ["m4"], [2])
        await nc.publish(S.rebuild_delta, encode(delta))
        assert await asyncio.to_thread(link.wait_command, 1, WAIT_S) == second
        assert link.rebuilds_from_deltas == 1 and not link.hears_whole_rebuilds()

        # A placement within generation 2 (its delta) moves the base: the next delta goes from its version 1.
        moved = [["s2", "s1"], *second.placement[1:]]
        placed = Placement(JOB, 2, 1, STORES, moved, "a store lost")
        await nc.publish(S.placement_delta, encode(placement_delta_of(placed, 0, second.placement)))
        await until(lambda: link.latest_placement() == placed, "the placement taken from its delta")
        third = command(3, second.ranks, moved, ["m5"])
        await nc.publish(S.rebuild_delta, encode(delta_of(third, 2, 1, second.ranks, moved)))
        assert await asyncio.to_thread(link.wait_command, 2, WAIT_S) == third
        assert link.rebuilds_from_deltas == 2

        # A delta that goes from a placement this member never heard (version 2 of generation 3): it
        # hears whole rebuilds again, and takes the whole command from the next retransmission.
        unheard = [third.placement[0], ["s0", "s2"], *third.placement[2:]]
        fourth = command(4, ["m0", "m5", "m4", "m3"], unheard, [])
        wrong_base = delta_of(fourth, 3, 2, third.ranks, unheard)
        assert await sent_until_held(nc, link, fourth, wrong_base) == fourth
        assert link.rebuilds_from_deltas == 2, "the whole command, not a delta gone from another base"
        await until(lambda: not link.hears_whole_rebuilds(), "the member leaves whole rebuilds again")

        # A delta whose result is not the swapper's command (its digest) is refused the same way.
        fifth = command(5, fourth.ranks, fourth.placement, [])
        forged = dataclasses.replace(delta_of(fifth, 4, 0, fourth.ranks, fourth.placement), digest="0" * 32)
        assert await sent_until_held(nc, link, fifth, forged) == fifth
        assert link.rebuilds_from_deltas == 2
    finally:
        await asyncio.to_thread(link.close)


async def placed_until_held(nc: Client, link: ControlLink, whole: Placement, delta: PlacementDelta) -> None:
    """Publish `delta` then `whole` as the swapper does, again every `RETRANSMIT_S` (its retransmission),
    until the member holds `whole`."""
    deadline = time.monotonic() + WAIT_S
    while link.latest_placement() != whole:
        await nc.publish(S.placement_delta, encode(delta))
        await nc.publish(S.placement, encode(whole))
        await asyncio.sleep(RETRANSMIT_S)
        assert time.monotonic() < deadline, f"placement {whole.version} not held within {WAIT_S} s"


async def test_a_member_takes_each_placement_from_its_delta_and_the_whole_one_when_it_cannot(
    nc: Client, nats_url: str
) -> None:
    link = await member_link(nc, nats_url)
    try:
        first = command(1, RANKS, [["s0", "s1"], ["s1", "s2"], ["s2", "s0"], ["s0", "s1"]], ["m4"])
        await sent_until_held(nc, link, first, notice_of(first))
        assert not link.hears_whole_placements(), "a member hears placements as their deltas"

        # s2 lost: its ranks' copies move; the delta alone is published.
        one = Placement(JOB, 1, 1, STORES, [["s0", "s1"], ["s1", "s0"], ["s1", "s0"], ["s0", "s1"]], "s2 lost")
        await nc.publish(S.placement_delta, encode(placement_delta_of(one, 0, first.placement)))
        await until(lambda: link.latest_placement() == one, "the placement taken from its delta")
        assert link.placements_from_deltas == 1 and not link.hears_whole_placements()

        # A delta from version 2, which this member never heard: it hears whole placements until the
        # whole one comes (the next retransmission), then leaves them.
        two = [["s2", "s1"], *one.placement[1:]]
        three = Placement(JOB, 1, 3, STORES, [*two[:3], ["s2", "s0"]], "s0 lost")
        await placed_until_held(nc, link, three, placement_delta_of(three, 2, two))
        assert link.placements_from_deltas == 1, "the whole placement, not a delta gone from another base"
        await until(lambda: not link.hears_whole_placements(), "the member leaves whole placements again")

        # A notice (a leader that took over holds no delta) and a forged digest: whole, the same way.
        four = Placement(JOB, 1, 4, STORES, [["s0"], *three.placement[1:]], "sent again")
        await placed_until_held(nc, link, four, placement_notice(four))
        five = Placement(JOB, 1, 5, STORES, [["s1"], *four.placement[1:]], "s0 lost")
        forged = dataclasses.replace(placement_delta_of(five, 4, four.placement), digest="0" * 32)
        await placed_until_held(nc, link, five, forged)
        assert link.placements_from_deltas == 1

        await until(lambda: not link.hears_whole_placements(), "whole placements left after the fifth")

        # A retransmitted delta of the placement held changes nothing; the next one applies to it.
        await nc.publish(S.placement_delta, encode(placement_delta_of(five, 4, four.placement)))
        six = Placement(JOB, 1, 6, STORES, [["s2"], *five.placement[1:]], "s1 lost")
        await nc.publish(S.placement_delta, encode(placement_delta_of(six, 5, five.placement)))
        await until(lambda: link.latest_placement() == six, "the sixth taken from its delta")
        assert link.placements_from_deltas == 2 and not link.hears_whole_placements()
    finally:
        await asyncio.to_thread(link.close)
