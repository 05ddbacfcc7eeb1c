"""A watch counts each incident once, however often it is said (incidents are published at least once)."""

from __future__ import annotations

from typing import Any, cast

import pytest
import structlog

from deadpool_cli.job_watch import JobWatch
from deadpool_protocol import Incident

pytestmark = pytest.mark.unit

NO_MSG = cast(Any, None)


def incident(incident_id: str, rank: int, t_first_step: float = 0.0) -> Incident:
    return Incident("j", 2, incident_id, rank, "m0", "m2", "exit", 1.0, 1.1, 1.2, 2.0, 7, 0, {}, {}, t_first_step)


async def test_an_incident_said_again_takes_the_place_of_the_first() -> None:
    watch = JobWatch(cast(Any, None), "j", structlog.get_logger())
    await watch._on_incident(incident("j-1", 0), NO_MSG)
    await watch._on_incident(incident("j-2", 3), NO_MSG)
    await watch._on_incident(incident("j-1", 0, t_first_step=3.0), NO_MSG)
    assert [(i.incident_id, i.t_first_step) for i in watch.incidents] == [("j-1", 3.0), ("j-2", 0.0)]
