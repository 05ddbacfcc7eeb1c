"""One source per default: a knob's default is written once, in its part's config, and the command line,
the local stack and the members' environment all read it from there.

Each test compares what a reader gets when nobody sets the knob with the config's own field default
(value and type), so a default typed a second time, and then changed in one place only, fails here."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from deadpool.launcher import LaunchConfig
from deadpool.member_config import ENV, MemberConfig, host_name
from deadpool_cli.demo import DemoConfig
from deadpool_cli.main import _parser
from deadpool_cli.stack import StackConfig
from deadpool_detector import DetectorServiceConfig
from deadpool_detector.core import DetectorConfig
from deadpool_store import StoreConfig
from deadpool_swapper import SwapperConfig, SwapperServiceConfig


def field_defaults(cls: type[Any]) -> dict[str, Any]:
    """Each field of the dataclass `cls` that has a default, with it."""
    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return defaults


def typed(values: dict[str, Any]) -> dict[str, tuple[Any, type[Any]]]:
    """Compared with its type: a default of 300 where the config says 300.0 is a second source too."""
    return {name: (value, type(value)) for name, value in values.items()}


def parsed(*argv: str) -> dict[str, Any]:
    """The options `deadpool ARGV` ends with when no other is given."""
    return vars(_parser().parse_args(list(argv)))


def same_defaults(
    options: dict[str, Any], cls: type[Any], expected: set[str], renamed: dict[str, str] | None = None
) -> None:
    """Every option named as a field of `cls` (or renamed to one) defaults to that field's default, and
    `expected` are among them (the comparison reaches the options it is meant for)."""
    defaults = field_defaults(cls)
    renamed = renamed or {}
    options = {renamed.get(name, name): value for name, value in options.items()}
    shared = options.keys() & defaults.keys()
    assert expected <= shared, f"{cls.__name__}: {sorted(expected - shared)} not compared"
    assert typed({n: options[n] for n in shared}) == typed({n: defaults[n] for n in shared})


DETECTOR_KNOBS = {
    "heartbeat_timeout_s",
    "hang_factor",
    "hang_floor_s",
    "first_step_s",
    "regroup_after_s",
    "rebuild_lag_s",
    "rebuild_max_s",
    "straggler_window",
}


def test_the_detector_command_defaults_to_the_detector_config() -> None:
    options = parsed("detector", "--nats", "nats://x")
    same_defaults(options, DetectorConfig, DETECTOR_KNOBS)
    same_defaults(options, DetectorServiceConfig, {"js_replicas"})


def test_the_swapper_command_defaults_to_the_swapper_config() -> None:
    options = parsed("swapper", "--nats", "nats://x")
    same_defaults(options, SwapperConfig, {"replication", "last_call_s"})
    same_defaults(options, SwapperServiceConfig, {"trace_file", "js_replicas", "last_call_s"})
    # `SwapperServiceConfig.replication` repeats `SwapperConfig.replication` (services/swapper is not this
    # test's to change); until it reads it, the two must at least agree
    assert SwapperServiceConfig.replication == SwapperConfig.replication


def test_the_store_command_defaults_to_the_store_config() -> None:
    options = parsed("store", "--nats", "nats://x", "--id", "s")
    same_defaults(
        options,
        StoreConfig,
        {"host", "port", "advertise_host", "capacity_bytes", "nice", "node", "unsealed_max_s"},
    )


def test_the_launch_command_defaults_to_the_launcher_and_member_configs() -> None:
    options = parsed("launch", "--nproc", "1", "train.py")
    # Left out, they are derived from the node's place (`node_plan`, tested in test_node_plan.py).
    assert options.pop("world_size") is None and options.pop("rank_offset") is None
    same_defaults(
        options,
        LaunchConfig,
        {"rendezvous_host", "respawns", "collective_timeout_s", "hold_without_stores_s"},
        renamed={"run_id": "run"},
    )
    # The member's own rendezvous default (loopback) serves a member started without a launcher; a
    # launcher always sets it, from its own ('': the route to NATS).
    del options["rendezvous_host"]
    same_defaults(
        options,
        MemberConfig,
        {"durable_dir", "durable_every_steps", "durable_every_s", "durable_grid_steps", "durable_keep", "resume_from"},
    )


def test_the_demo_command_defaults_to_the_demo_config() -> None:
    options = parsed("demo")
    knobs = set(field_defaults(DemoConfig)) - {"script", "reference", "host_copy"}  # no option; --no-…
    same_defaults(options, DemoConfig, knobs)
    assert options["no_reference"] is not DemoConfig.reference
    assert options["no_host_copy"] is not DemoConfig.host_copy


def test_the_demo_config_reads_what_it_shares_with_the_stack_and_the_detector() -> None:
    assert typed({"stores": DemoConfig.stores}) == typed({"stores": StackConfig.stores})
    assert typed({"hang_factor": DemoConfig.hang_factor}) == typed({"hang_factor": DetectorConfig.hang_factor})


def test_the_up_command_defaults_to_the_stack_config_but_for_its_own_two_services() -> None:
    options = parsed("up")
    # `up` runs two swappers and two detectors on purpose, where a StackConfig alone runs one of each
    options = {k: v for k, v in options.items() if k not in ("swappers", "detectors", "credentials", "trace_file")}
    same_defaults(options, StackConfig, {"stores", "nats_nodes"})
    assert parsed("up")["swappers"] == parsed("up")["detectors"] == 2


def test_the_stack_config_defaults_to_the_parts_configs() -> None:
    stack = field_defaults(StackConfig)
    detector = field_defaults(DetectorConfig)
    knobs = {"heartbeat_timeout_s", "hang_factor", "hang_floor_s", "first_step_s", "straggler_window"}
    assert typed({k: stack[k] for k in knobs}) == typed({k: detector[k] for k in knobs})
    assert typed({"replication": stack["replication"]}) == typed({"replication": SwapperConfig.replication})
    assert typed({"capacity": stack["store_capacity_bytes"]}) == typed({"capacity": StoreConfig.capacity_bytes})


@pytest.mark.parametrize(
    "stack",
    [
        StackConfig(workdir=Path("w")),
        StackConfig(
            workdir=Path("w"),
            heartbeat_timeout_s=2.0,
            hang_factor=7.5,
            hang_floor_s=3.0,
            first_step_s=30.0,
            straggler_window=100,
            replication=1,
            store_capacity_bytes=1 << 20,
            trace_file="t.jsonl",
            nats_nodes=3,
        ),
    ],
    ids=["defaults", "set"],
)
def test_the_stack_starts_each_part_with_its_own_values(stack: StackConfig) -> None:
    detector = parsed("detector", "--nats", "nats://x", *stack.detector_args())
    knobs = ("heartbeat_timeout_s", "hang_factor", "hang_floor_s", "first_step_s", "straggler_window")
    assert {k: detector[k] for k in knobs} == {k: getattr(stack, k) for k in knobs}
    swapper = parsed("swapper", "--nats", "nats://x", *stack.swapper_args())
    assert (swapper["replication"], swapper["trace_file"]) == (stack.replication, stack.trace_file)
    assert detector["js_replicas"] == swapper["js_replicas"] == stack.js_replicas
    store = parsed("store", "--nats", "nats://x", *stack.store_args(1))
    assert (store["id"], store["capacity_bytes"]) == ("store-1", stack.store_capacity_bytes)


REQUIRED_ENV: dict[str, str] = {ENV.JOB: "job", ENV.NATS_URL: "nats://x", ENV.MEMBER: "m-1", ENV.WORLD_SIZE: "2"}


def test_a_member_with_only_the_required_variables_has_every_default() -> None:
    from_env = MemberConfig.from_env(dict(REQUIRED_ENV))
    direct = MemberConfig(
        job="job", nats_url="nats://x", member="m-1", launcher="", rank_hint=-1, world_size=2, host=host_name()
    )
    assert from_env.host == host_name()  # the machine's name: no default of MemberConfig's
    names = [f.name for f in dataclasses.fields(MemberConfig)]
    assert typed({n: getattr(from_env, n) for n in names}) == typed({n: getattr(direct, n) for n in names})
    assert from_env.rank_hint == -1  # a spare's: no rank asked for


BOOLEANS: dict[str, str] = {
    ENV.SNAPSHOT_PARTITION: "snapshot_partition",
    ENV.HEARTBEAT_VIA_LAUNCHER: "heartbeat_via_launcher",
}
ON = ["1", "true", "yes", "on", "True", "YES", " 1"]
OFF = ["0", "false", "no", "off", "False", "NO", "0 "]


@pytest.mark.parametrize("key", sorted(BOOLEANS))
@pytest.mark.parametrize(("value", "expected"), [(v, True) for v in ON] + [(v, False) for v in OFF])
def test_every_boolean_variable_reads_the_same_spellings(key: str, value: str, expected: bool) -> None:
    assert getattr(MemberConfig.from_env({**REQUIRED_ENV, key: value}), BOOLEANS[key]) is expected


@pytest.mark.parametrize("key", sorted(BOOLEANS))
@pytest.mark.parametrize("value", ["2", "y", "enable", "tru", "-1"])
def test_a_boolean_variable_that_is_no_boolean_is_refused_by_name(key: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{key}={value!r} is not a boolean"):
        MemberConfig.from_env({**REQUIRED_ENV, key: value})


def test_what_the_launcher_writes_keeps_its_meaning() -> None:
    """The launcher sets both as '1' or '0': read as before the two ways became one."""
    on = MemberConfig.from_env({**REQUIRED_ENV, **dict.fromkeys(BOOLEANS, "1")})
    off = MemberConfig.from_env({**REQUIRED_ENV, **dict.fromkeys(BOOLEANS, "0")})
    assert on.snapshot_partition and on.heartbeat_via_launcher
    assert not off.snapshot_partition and not off.heartbeat_via_launcher


def test_an_unset_or_empty_boolean_variable_keeps_its_default() -> None:
    defaults = (MemberConfig.snapshot_partition, MemberConfig.heartbeat_via_launcher)
    for env in (dict(REQUIRED_ENV), {**REQUIRED_ENV, **dict.fromkeys(BOOLEANS, "")}):
        config = MemberConfig.from_env(env)
        assert (config.snapshot_partition, config.heartbeat_via_launcher) == defaults
