"""CPU threads: the container's CPU quota caps torch's pool unless the operator chose."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedinfer.service import OPENMP_SPIN_COUNT
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.threads import cgroup_cpu_limit, configure_cpu_threads, openmp_spin


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def cgroup_v2(tmp_path: Path, cpu_max: str) -> Path:
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    return tmp_path


def cgroup_v1(tmp_path: Path, quota: int, period: int) -> Path:
    (tmp_path / "cpu").mkdir(parents=True)
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return tmp_path


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(cgroup_v2(tmp_path, "250000 100000")) == 2.5


def test_cgroup_v2_without_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(cgroup_v2(tmp_path, "max 100000")) is None


def test_cgroup_v1_quota_and_unlimited(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(cgroup_v1(tmp_path / "a", 150000, 100000)) == 1.5
    assert cgroup_cpu_limit(cgroup_v1(tmp_path / "b", -1, 100000)) is None


def test_no_cgroup_files_or_garbage_mean_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path) is None
    assert cgroup_cpu_limit(cgroup_v2(tmp_path, "lots")) is None


def test_quota_caps_the_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(4)
    assert configure_cpu_threads(None, cgroup_v2(tmp_path, "150000 100000")) == 1
    assert torch.get_num_threads() == 1


def test_quota_above_the_visible_cpus_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    assert configure_cpu_threads(None, cgroup_v2(tmp_path, "800000 100000")) == 2


def test_explicit_choices_win_over_the_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = cgroup_v2(tmp_path, "100000 100000")
    assert configure_cpu_threads(3, root) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert configure_cpu_threads(None, root) == 2  # OMP_NUM_THREADS is the operator's


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_thread_counts_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="num_threads must be a positive integer"):
        EngineConfig(num_threads=bad)  # type: ignore[arg-type]


def spin_setting(env: dict[str, str], torch_first: bool = False) -> str:
    """GOMP_SPINCOUNT as libgomp would read it in a fresh process that imports the
    engine's package (after torch when torch_first)."""
    code = "import os\n"
    code += "import torch\n" if torch_first else ""
    code += "import pagedinfer.service\nprint(os.environ.get('GOMP_SPINCOUNT', 'unset'))\n"
    keep = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**keep, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_openmp_threads_spin_briefly_unless_the_operator_chose() -> None:
    """OpenMP's threads must not hold a core long after torch's ops: the engine's own
    kernel threads need it (pagedinfer.service sets libgomp's spin before torch loads)."""
    assert spin_setting({}) == OPENMP_SPIN_COUNT
    assert spin_setting({"GOMP_SPINCOUNT": "1000"}) == "1000"
    assert spin_setting({"OMP_WAIT_POLICY": "ACTIVE"}) == "unset"
    # Once torch is loaded libgomp has read its settings: nothing is set that would not hold.
    assert spin_setting({}, torch_first=True) == "unset"


def test_the_spin_reported_is_the_setting_libgomp_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert openmp_spin() == "default"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert openmp_spin() == "PASSIVE"
    monkeypatch.setenv("GOMP_SPINCOUNT", "30000")  # libgomp takes the count over the policy
    assert openmp_spin() == "30000"
