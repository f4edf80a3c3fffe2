"""benchmarks/startup.py: its arguments, its targets table, and one warm server start
at toy size whose JSON carries every figure (speed is not asserted: it is printed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "startup.py"


@pytest.fixture(scope="module")
def startup():
    spec = importlib.util.spec_from_file_location("startup_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_defaults_run_cold_then_warm_for_both_commands(startup):
    args = startup.parse_args([])
    assert args.modes == ["cold", "warm"] and args.commands == ["serve", "generate"]
    args = startup.parse_args(["--modes", "warm,cold", "--commands", "generate", "--",
                               "--max-num-seqs", "8"])  # fmt: skip
    assert args.modes == ["cold", "warm"]  # a warm run needs its cold one first
    assert args.serve_args == ["--max-num-seqs", "8"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modes", "lukewarm"], "--modes takes a comma-separated list of cold, warm"),
        (["--commands", ""], "--commands takes"),
        (["--caches", "environment"], "cannot give cold runs"),
        (["--streams", "0"], "--streams must be at least 1"),
    ],
)
def test_bad_arguments_are_named(startup, capsys, argv, message):
    with pytest.raises(SystemExit):
        startup.parse_args(argv)
    assert message in capsys.readouterr().err


def test_targets_compare_the_worst_run_of_each_kind(startup):
    runs = [
        {"mode": "cold", "command": "serve", "serving_s": 41.0, "peak_rss_under_load_mib": 1200},
        {"mode": "warm", "command": "serve", "serving_s": 4.0, "peak_rss_under_load_mib": 1700},
        {"mode": "warm", "command": "serve", "serving_s": 6.0, "peak_rss_under_load_mib": 1000},
        {"mode": "warm", "command": "generate", "answer_s": 7.5},
    ]
    met = startup.targets_met(runs)
    assert met["warm_serve_serving_s"] == {"target": 5.0, "measured": 6.0, "met": False}
    assert met["cold_serve_serving_s"]["met"] is False
    assert met["warm_generate_answer_s"] == {"target": 8.0, "measured": 7.5, "met": True}
    assert met["peak_rss_under_load_gib"]["measured"] == round(1700 / 1024, 3)
    assert startup.targets_met(runs[3:]).keys() == {"warm_generate_answer_s"}


def test_the_tree_peak_counts_a_grandchilds_memory(startup):
    """A process whose child holds 300 MiB: the sampled peak of the tree counts it."""
    script = (
        "import subprocess, sys;"
        "subprocess.run([sys.executable, '-c', "
        "'import time; b = bytearray(300 << 20); time.sleep(3)'])"
    )
    process = subprocess.Popen([sys.executable, "-c", script])
    tree = startup.TreePeak(process.pid, interval_s=0.05)
    process.wait(60)
    assert tree.stop() > 300


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_warm_server_start_reports_every_figure(tmp_path, default_model_dir):
    out = tmp_path / "startup.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(SCRIPT), "--modes", "warm", "--commands", "serve",
            "--caches", "environment", "--streams", "2", "--max-tokens", "2",
            "--json", str(out), "--", "--kv-cache-memory", "32MiB", "--max-num-seqs", "4"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=880)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout)
    assert json.loads(out.read_text()) == printed
    (run,) = printed["runs"]
    assert run["mode"] == "warm" and run["command"] == "serve"
    assert 0 < run["listening_s"] <= run["serving_s"] <= run["first_token_s"]
    assert run["num_blocks"] > 0
    assert run["load"]["streams"] == 2 and run["load"]["output_tokens"] == 4
    assert 0 < run["rss_serving_mib"] <= run["peak_rss_start_mib"]
    assert run["peak_rss_under_load_mib"] >= run["rss_after_load_mib"] > 0
    # Sampled PSS: libraries mapped by other processes (this one) count in part.
    assert run["peak_tree_rss_mib"] > run["rss_serving_mib"] * 0.5
    assert set(printed["targets"]) == {"warm_serve_serving_s", "peak_rss_under_load_gib"}
    assert printed["settings"]["engine_args"] == [
        "--kv-cache-memory",
        "32MiB",
        "--max-num-seqs",
        "4",
    ]
