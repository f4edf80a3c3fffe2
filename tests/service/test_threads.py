"""CPU threads: the container's CPU quota caps torch's pool unless the operator chose."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedinfer.service.config import EngineConfig
from pagedinfer.service.openmp import OPENMP_SPIN_COUNT, spin_env
from pagedinfer.service.threads import (
    MAX_THREADS_PER_CPU,
    cgroup_cpu_limit,
    configure_cpu_threads,
    openmp_spin,
)


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


@pytest.mark.parametrize(
    ("environ", "torch_loaded", "expected"),
    [
        ({}, False, {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}),
        ({"GOMP_SPINCOUNT": "1000"}, False, {}),  # the operator's count stands
        ({"OMP_WAIT_POLICY": "ACTIVE"}, False, {}),  # and so does their policy
        ({}, True, {}),  # libgomp has read its settings: nothing that would not hold
    ],
)
def test_openmp_threads_spin_briefly_unless_the_operator_chose(
    environ: dict[str, str], torch_loaded: bool, expected: dict[str, str]
) -> None:
    """OpenMP's threads must not hold a core long after torch's ops: the engine's own
    kernel threads need it."""
    assert spin_env(environ, torch_loaded) == expected


def run_fresh(code: str) -> list[str]:
    """The printed lines of `code` run in a fresh interpreter, without the operator's
    OpenMP settings."""
    keep = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", code], env=keep, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_importing_the_package_changes_no_environment_variable() -> None:
    code = (
        "import os, sys\n"
        "before = dict(os.environ)\n"
        "import pagedinfer.service, pagedinfer.service.llm, pagedinfer.service.cli\n"
        "print(dict(os.environ) == before, 'torch' in sys.modules)\n"
    )
    assert run_fresh(code) == ["True", "False"]


def test_the_engine_entry_points_set_the_spin_before_torch_loads() -> None:
    """`pagedinfer serve`/`generate` and the offline `LLM` set it as they start, before
    they import torch (a bad argument stops each right after)."""
    cli = (
        "import os, sys\n"
        "from pagedinfer.service import cli\n"
        "try:\n"
        "    cli.main(['generate', '--no-such-flag'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(os.environ.get('GOMP_SPINCOUNT', 'unset'))\n"
    )
    assert run_fresh(cli) == [OPENMP_SPIN_COUNT]
    offline = (
        "import os\n"
        "from pagedinfer.service import LLM\n"
        "try:\n"
        "    LLM(block_size=0)\n"
        "except ValueError:\n"
        "    pass\n"
        "print(os.environ.get('GOMP_SPINCOUNT', 'unset'))\n"
    )
    assert run_fresh(offline) == [OPENMP_SPIN_COUNT]
    simulate = cli.replace("'generate'", "'simulate'")  # no engine: nothing to set
    assert run_fresh(simulate) == ["unset"]


def test_the_spin_reported_is_the_setting_libgomp_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert openmp_spin() == "default"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert openmp_spin() == "PASSIVE"
    monkeypatch.setenv("GOMP_SPINCOUNT", "30000")  # libgomp takes the count over the policy
    assert openmp_spin() == "30000"


def test_threads_far_past_the_cpus_are_refused_naming_the_flag() -> None:
    before = torch.get_num_threads()
    too_many = MAX_THREADS_PER_CPU * (os.cpu_count() or 1) + 1
    with pytest.raises(ValueError, match=f"--num-threads {too_many} is far more than"):
        configure_cpu_threads(too_many)
    assert torch.get_num_threads() == before
