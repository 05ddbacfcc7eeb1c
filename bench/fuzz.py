"""Fuzz everything a peer can send, at length: control messages and data-plane frame headers (random
bytes, and maps shaped like the real ones), and the store's upload protocol as a state machine.

    .venv/bin/python bench/fuzz.py [--cases 100000] [--seed 1] [--only forgeries]

The properties are the CI tests' (`tests/unit/fuzz_properties.py`); here every case runs to the end
instead of stopping at the first failure, and each outcome is counted: `crashes` (an exception other
than the protocol's own refusal; goal 0) and `accepted_forgeries` (an input that must be refused but
was accepted: a non-finite number, a frame beyond the data plane's bounds, a seal whose checksums do
not match the bytes, bytes served that their manifest does not describe; goal 0). The last line is
one JSON object.

A forgery is also a data-plane frame let through by a keyed store with a token that is not its job's
(another job's, one bit off, cut short, made under another key, random); and, for each key a training
or store host holds (a job's, a store's), a well-formed message of any kind, naming its own job or
store or a victim's, on any subject DeadPool listens on, that the server's permissions (the shipped
tables, matched as NATS matches subjects) and the services' subject checks let through although it
is not that key's to say, or a subject that key may read although it carries another's secrets.
tests/integration/test_auth.py checks the same tables against a real server.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, run_state_machine_as_test

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.unit.fuzz_properties import (
    Forgery,
    StoreProtocol,
    check_forged_publication,
    check_forged_read,
    check_frame_bytes,
    check_message_bytes,
    check_token_frame,
    forged_publications,
    forged_reads,
    frame_bodies,
    message_bodies,
    token_frames,
)

GOALS = {"crashes_max": 0, "accepted_forgeries_max": 0, "cases_min": 100_000}


def harvest(
    name: str, strategy: st.SearchStrategy[Any], check: Callable[[Any], bool], cases: int, rng_seed: int
) -> Counter[str]:
    """Run `check` on `cases` inputs, counting accepted, refused, forgeries and crashes."""
    counts: Counter[str] = Counter()
    first: dict[str, str] = {}

    @seed(rng_seed)
    @settings(max_examples=cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(value: Any) -> None:
        try:
            counts["accepted" if check(value) else "refused"] += 1
        except Forgery as exc:
            counts["forgeries"] += 1
            first.setdefault("forgery", f"{exc} <- {value!r:.300}")
        except Exception:
            counts["crashes"] += 1
            first.setdefault("crash", f"{traceback.format_exc(limit=4)} <- {value!r:.300}")

    run()
    for kind, text in first.items():
        print(f"  {name}: first {kind}: {text}", file=sys.stderr)
    return counts


def stateful(sequences: int) -> Counter[str]:
    """Run the store protocol machine for `sequences` sequences of up to 40 steps each; every step
    counts as a case."""
    counts: Counter[str] = Counter()
    runs = {"n": 0, "steps": 0}

    class Counted(StoreProtocol):
        @invariant()
        def count(self) -> None:
            runs["steps"] += 1

        def teardown(self) -> None:
            runs["n"] += 1

    try:
        run_state_machine_as_test(
            Counted,
            settings=settings(
                max_examples=sequences,
                stateful_step_count=40,
                deadline=None,
                database=None,
                derandomize=False,
                suppress_health_check=list(HealthCheck),
            ),
        )
    except Forgery as exc:
        counts["forgeries"] += 1
        print(f"  store protocol: forgery: {exc}", file=sys.stderr)
    except Exception:
        counts["crashes"] += 1
        print(f"  store protocol: crash: {traceback.format_exc(limit=6)}", file=sys.stderr)
    counts["sequences"], counts["steps"] = runs["n"], runs["steps"]
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100_000, help="cases in all (sequences count once)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--only", default="", help="run only the targets whose name starts with this (e.g. forgeries), all cases"
    )
    args = parser.parse_args()
    targets: list[tuple[str, st.SearchStrategy[Any], Callable[[Any], bool]]] = [
        ("messages, random bytes", st.binary(max_size=256), check_message_bytes),
        ("messages, shaped maps", message_bodies(), check_message_bytes),
        ("frames, random bytes", st.binary(max_size=256), check_frame_bytes),
        ("frames, shaped maps", frame_bodies(), check_frame_bytes),
        ("frames, job tokens", token_frames(), check_token_frame),
        ("forgeries, each key", forged_publications(), check_forged_publication),
        ("reads, each key", forged_reads(), check_forged_read),
    ]
    if args.only:
        targets = [target for target in targets if target[0].startswith(args.only)]
    share = args.cases // (len(targets) + (0 if args.only else 1))
    rows: dict[str, Counter[str]] = {}
    started = time.monotonic()
    for name, strategy, check in targets:
        t0 = time.monotonic()
        rows[name] = harvest(name, strategy, check, share, args.seed)
        total = rows[name]["accepted"] + rows[name]["refused"] + rows[name]["forgeries"] + rows[name]["crashes"]
        print(f"{name:26s} {total:7d} cases  {dict(rows[name])}  {time.monotonic() - t0:.1f} s", flush=True)
    t0 = time.monotonic()
    counted = sum(sum(c.values()) for c in rows.values())  # a finite strategy (reads) ends early: all of it
    machine = stateful(max(1, (args.cases - counted) // 20)) if not args.only else Counter()
    print(f"{'store protocol':26s} {machine['steps']:7d} steps in {machine['sequences']} sequences", end="")
    print(f"  {dict(machine)}  {time.monotonic() - t0:.1f} s", flush=True)
    cases = sum(sum(c.values()) for c in rows.values()) + machine["steps"]
    rows["store protocol"] = machine
    result = {
        "cases": cases,
        "crashes": sum(c["crashes"] for c in rows.values()),
        "accepted_forgeries": sum(c["forgeries"] for c in rows.values()),
        "accepted": {name: c["accepted"] for name, c in rows.items() if name != "store protocol"},
        "store_steps": machine["steps"],
        "store_sequences": machine["sequences"],
        "seconds": round(time.monotonic() - started, 1),
        "seed": args.seed,
        "goals": GOALS,
    }
    result["goals_met"] = (
        result["crashes"] <= GOALS["crashes_max"]
        and result["accepted_forgeries"] <= GOALS["accepted_forgeries_max"]
        and result["cases"] >= GOALS["cases_min"]
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
