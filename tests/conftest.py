"""The suite's layers and how `make test` spreads them over pytest-xdist's two workers.

Layers: every test is marked by its directory, `unit` (no process, no network: `pytest -m unit`),
`integration` (a real nats-server and real processes) or `chaos` (the short chaos run). A marker set
in a conftest's `pytestmark` reaches no test, so they are set here, at collection.

Nearly every test starts real processes that take the machine's CPU (each imports torch) and times
real detections, so two of them at once would slow each other into false verdicts: they all run on one
worker, one after another, in collection order. A module in `BESIDE_OTHERS` spends minutes waiting on
purpose (JetStream held away for longer than 120 s) with almost no CPU meanwhile: it runs on the other
worker, in parallel with the rest, instead of adding its minutes to the run. Without `-n`, this file
changes nothing.

The split is xdist's own hook (a scheduler choosing each test's worker by its module), not
`--dist loadgroup`: that one renames test ids, which pytest 9.2 no longer lets it do, so every test
lands on either worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

BESIDE_OTHERS = frozenset({"tests/integration/test_jetstream_outage.py"})
"""Modules that mostly wait (measured: the JetStream outage test, 145 s at under 10 % of a core)."""


LAYERS = ("unit", "integration", "chaos")
"""The directories under tests/, each its own marker."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        if tests in item.path.parents and (layer := item.path.relative_to(tests).parts[0]) in LAYERS:
            item.add_marker(layer)


class SerialBesideWaiting(LoadScopeScheduling):  # type: ignore[misc]
    """Two units of work: the modules that mostly wait, and everything else in collection order."""

    def _split_scope(self, nodeid: str) -> str:
        return "beside_others" if nodeid.split("::", 1)[0] in BESIDE_OTHERS else "serial"


@pytest.hookimpl(optionalhook=True)  # unknown with -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> SerialBesideWaiting:
    return SerialBesideWaiting(config, log)
