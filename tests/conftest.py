"""The suite's layers and how `make test` spreads them over pytest-xdist's two workers.

Layers: every test is marked by its directory, `unit` (no process, no network: `pytest -m unit`),
`integration` (a real nats-server and real processes) or `chaos` (the short chaos run). A marker set
in a conftest's `pytestmark` reaches no test, so they are set here, at collection.

Nearly every test starts real processes that take the machine's CPU (each imports torch) and times
real detections, so two of them at once would slow each other into false verdicts: they all run on one
worker, one after another, in collection order. A module in `BESIDE_OTHERS` spends most of its time
waiting on purpose (JetStream held away for longer than 120 s, a detector's 30 s bound) with little
CPU meanwhile: it runs on the other worker, in parallel with the rest, instead of adding its minutes
to the run. Without `-n`, this file changes nothing.

The split is xdist's own hook (a scheduler choosing each test's worker by its module), not
`--dist loadgroup`: that one renames test ids, which pytest 9.2 no longer lets it do, so every test
lands on either worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

BESIDE_OTHERS = frozenset(
    {
        "tests/integration/test_jetstream_outage.py",
        "tests/integration/test_stuck_rebuild.py",
        "tests/integration/test_store_returns.py",
        "tests/integration/test_store_replication.py",
        "tests/integration/test_swapper_service.py",
    }
)
"""Modules that mostly wait, measured with each test's CPU (the test process's and its reaped
descendants') over its wall time, run alone: the JetStream outage 145 s at under 10 % of a core; the
stuck rebuild 39 s at 47 % (it waits the detector's 30 s `rebuild_lag_s`; it passed 20 runs in a row
beside a busy loop on each core); a store's returns 18 s at 39 %; store replication 13 s at 22-27 %.
The tests of the serial queue take 1.7-1.9 cores, so the other candidates (the straggler test at 64 %,
a NATS node lost at 69 %) stay there: it is their timing the load would change. The swapper service's
tests (14 s; the two longest at 12 % and 22 %) wait on bounds of 5 s and more, with nothing timed
finer."""


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
