"""One GPU per member, spares included: what the launcher detects, plans and refuses (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deadpool.cuda_devices import DevicePlan, DeviceShortageError, detect_devices, plan_devices


def test_detection_reads_cuda_visible_devices_first_then_the_driver(tmp_path: Path) -> None:
    driver = tmp_path / "gpus"
    for bus in ("0000:3b:00.0", "0000:5e:00.0"):
        (driver / bus).mkdir(parents=True)
    assert detect_devices({}, driver, tmp_path) == ["0", "1"]
    assert detect_devices({"CUDA_VISIBLE_DEVICES": "4, 6"}, driver, tmp_path) == ["4", "6"]
    assert detect_devices({"CUDA_VISIBLE_DEVICES": ""}, driver, tmp_path) == []
    assert detect_devices({"CUDA_VISIBLE_DEVICES": "2,-1,3"}, driver, tmp_path) == ["2"]  # CUDA stops at -1


def test_detection_falls_back_to_device_files_and_finds_none_on_a_cpu_host(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    assert detect_devices({}, tmp_path / "absent", dev) == ["0", "1"]
    assert detect_devices({}, tmp_path / "absent", tmp_path / "absent") == []


def test_every_member_spares_included_gets_its_own_device_and_sees_it_at_its_local_rank() -> None:
    plan = plan_devices("auto", 3, 1, ["0", "1", "2", "3", "4"])
    assert plan is not None and plan.devices == ("0", "1", "2", "3")
    assert [plan.env_for(slot) for slot in (0, 3)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "DEADPOOL_DEVICE": "0"},
        {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "DEADPOOL_DEVICE": "3"},
    ]
    listed = plan_devices("5,7,6", 2, 1, [])
    assert listed is not None and [listed.index_of(slot) for slot in range(3)] == [0, 1, 2]
    assert listed.env_for(2)["CUDA_VISIBLE_DEVICES"] == "5,7,6"
    assert plan_devices("2", 1, 1, ["3", "4", "5"]) == DevicePlan(("3", "4"))


def test_a_host_with_fewer_devices_than_ranks_plus_spares_is_refused_saying_what_to_do() -> None:
    with pytest.raises(DeviceShortageError, match=r"2 GPU\(s\) for 2 rank\(s\) \+ 1 spare.*--gpus none"):
        plan_devices("auto", 2, 1, ["0", "1"])
    with pytest.raises(DeviceShortageError, match="only 2"):
        plan_devices("3", 2, 1, ["0", "1"])
    with pytest.raises(DeviceShortageError, match="2 device"):
        plan_devices("0,1", 2, 1, ["0", "1", "2"])
    with pytest.raises(ValueError, match="comma list"):
        plan_devices("0,,1", 2, 1, [])


def test_a_cpu_job_gets_no_devices_and_only_an_explicit_list_may_share_one() -> None:
    assert plan_devices("auto", 4, 1, []) is None
    assert plan_devices("none", 4, 1, ["0", "1"]) is None
    assert plan_devices("0", 4, 1, ["0"]) is None
    shared = plan_devices("0,0,0", 2, 1, ["0"])  # gloo on one GPU (the GPU check with one device)
    assert shared is not None and [shared.env_for(slot)["DEADPOOL_DEVICE"] for slot in range(3)] == ["0"] * 3
    assert shared.visible == ("0",)
    with pytest.raises(DeviceShortageError):
        plan_devices("auto", 2, 1, ["0", "0", "1"])  # a count of distinct devices, not of entries
