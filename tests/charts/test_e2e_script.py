"""scripts/e2e_kind.sh: skips cleanly without a cluster, and refers to what exists.

The end-to-end run itself needs a real cluster and Docker, which CI does not have.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import yaml
from chart_tools import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "e2e_kind.sh"


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_without_a_reachable_cluster_it_skips_and_succeeds(tmp_path: Path):
    # A kubectl that cannot reach any cluster, first on PATH.
    fake = tmp_path / "kubectl"
    fake.write_text("#!/bin/sh\necho 'The connection to the server was refused' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "skipped" in result.stdout
    assert "docker" not in result.stdout + result.stderr


def test_script_applies_an_example_that_exists_under_the_name_it_waits_for():
    text = SCRIPT.read_text()
    example = re.search(r"^EXAMPLE=(\S+)$", text, re.M).group(1)
    name = re.search(r"^NAME=(\S+)$", text, re.M).group(1)
    isvc = yaml.safe_load((REPO_ROOT / example).read_text())
    assert isvc["metadata"]["name"] == name
    assert "replicas" in isvc["spec"], "the scale-up step patches replicas away"
    assert "image" not in isvc["spec"], "it must run the image under test, the chart's image"
