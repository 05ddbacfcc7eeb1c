"""Every exception class DeadPool defines is a `DeadPoolError`, so `except DeadPoolError` catches all
of ours, and keeps the built-in base it had, so code that caught it by that base still does."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from deadpool_protocol import DeadPoolError

PACKAGES = (
    "deadpool_protocol",
    "deadpool_runtime",
    "deadpool",
    "deadpool_cli",
    "deadpool_detector",
    "deadpool_swapper",
    "deadpool_store",
)
SKIPPED_MODULES = frozenset({"deadpool_cli.__main__"})
"""Modules that run something when imported."""
BUILT_IN_BASES = {
    "ProtocolError": ValueError,
    "BucketRebuildError": ValueError,
    "DeviceShortageError": ValueError,
    "TreeError": TypeError,
    "JobFailedError": RuntimeError,
    "MemberFencedError": RuntimeError,
    "MemberCannotContinueError": RuntimeError,
    "StoreClientError": RuntimeError,
    "RecordTooLargeError": RuntimeError,
}
"""A sample of the bases callers catch by: each must stay."""


def exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in PACKAGES:
        package = importlib.import_module(name)
        modules = [package.__name__] + [
            m.name for m in pkgutil.walk_packages(package.__path__, prefix=f"{name}.") if m.name not in SKIPPED_MODULES
        ]
        for module_name in modules:
            module = importlib.import_module(module_name)
            for attr, value in vars(module).items():
                if (
                    inspect.isclass(value)
                    and issubclass(value, BaseException)
                    and value.__module__.split(".")[0] in PACKAGES
                ):
                    found[f"{value.__module__}.{attr}"] = value
    return found


def test_every_exception_class_of_ours_is_a_deadpool_error() -> None:
    classes = exception_classes()
    assert len(classes) >= 25, sorted(classes)  # the walk found them: 27 when this was written
    outside = sorted(name for name, cls in classes.items() if not issubclass(cls, DeadPoolError))
    assert outside == []


@pytest.mark.parametrize(("name", "base"), sorted(BUILT_IN_BASES.items()))
def test_each_keeps_the_built_in_base_it_is_caught_by(name: str, base: type[BaseException]) -> None:
    matches = [cls for qualified, cls in exception_classes().items() if qualified.endswith(f".{name}")]
    assert matches, name
    assert all(issubclass(cls, base) for cls in matches)
