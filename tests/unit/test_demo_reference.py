"""`deadpool demo --reference-from`: an earlier run's reference is reused only for the same training."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from deadpool_cli.demo import REFERENCE_RUN, TRAINING_FILE, DemoConfig, reused_reference, training_of


def earlier_run(tmp_path: Path, cfg: DemoConfig) -> Path:
    (tmp_path / REFERENCE_RUN).mkdir()
    (tmp_path / REFERENCE_RUN / TRAINING_FILE).write_text(json.dumps(training_of(cfg)))
    return tmp_path


def test_the_reference_of_the_same_training_is_reused_whatever_the_fault(tmp_path: Path) -> None:
    trained = DemoConfig(model_size="tiny", steps=24, fault="reset")
    run_dir = earlier_run(tmp_path, trained)
    cfg = replace(trained, fault="hang", kill_step=3, stores=3, reference_from=str(run_dir))
    assert reused_reference(cfg) == run_dir / REFERENCE_RUN


@pytest.mark.parametrize("change", [{"steps": 25}, {"seed": 1}, {"nproc": 2}, {"model_size": "small"}])
def test_the_reference_of_another_training_is_refused(tmp_path: Path, change: dict[str, object]) -> None:
    trained = DemoConfig(model_size="tiny", steps=24)
    run_dir = earlier_run(tmp_path, trained)
    with pytest.raises(ValueError, match="it trained"):
        reused_reference(replace(trained, reference_from=str(run_dir), **change))  # type: ignore[arg-type]


def test_a_run_dir_without_a_finished_reference_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no finished reference run there"):
        reused_reference(DemoConfig(reference_from=str(tmp_path)))
