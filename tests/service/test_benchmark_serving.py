"""benchmarks/serving.py end to end at toy size, so that it cannot rot: it starts its own
server, streams the workload over HTTP at each concurrency level, runs the offline API
on the same work, and prints one JSON with the HTTP/offline ratio and saves a plot.

Speed is the benchmark's business, not the test's: only the shape and the token counts
are checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"
REQUESTS = 3
CHAT_PROMPTS = {
    "prompts": [
        {"output_tokens": 4, "messages": [{"role": "user", "content": "Why is the sky blue?"}]},
        {
            "output_tokens": 3,
            "messages": [
                {"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Name a prime number."},
            ],
        },
    ]
}


def serving(directory: Path, *flags: str) -> tuple[dict, Path]:
    """serving.py's JSON and plot for a toy-size run in `directory`."""
    plot = directory / "serving.png"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", "--max-model-len", "128", "--threads", "1",
         "--ratio-concurrency", "2", "--kv-cache-memory", str(64 * 2**20),
         "--plot", str(plot), *flags],
        cwd=directory, env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, f"serving.py failed:\n{result.stderr[-6000:]}"
    return json.loads(result.stdout), plot


@pytest.fixture(scope="module")
def run(tmp_path_factory, default_model_dir) -> tuple[dict, Path]:
    return serving(
        tmp_path_factory.mktemp("serving-bench"),
        *("--num-requests", str(REQUESTS), "--prompt-mean", "16", "--output-mean", "4"),
        *("--concurrency", "1,2"),
    )


def test_sweep_streams_every_token_at_each_level(run):
    summary, _ = run
    workload = summary["workload"]
    assert workload["requests"] == REQUESTS
    assert list(summary["http"]) == ["1", "2", str(REQUESTS)]  # the sweep, then all at once
    for level, result in summary["http"].items():
        assert result["concurrency"] == int(level)
        assert result["errors"] == 0
        assert result["successful"] == REQUESTS
        assert result["output_tokens"] == workload["output_tokens"]
        assert result["prompt_tokens"] == workload["prompt_tokens"]
        assert result["output_tokens_per_s"] > 0
        for key in ("ttft", "e2e"):  # each spans at least one forward pass
            assert 0 < result[f"{key}_p50_s"] <= result[f"{key}_p99_s"]
        # Tokens of one step may reach the client in one read: a gap may be zero.
        for key in ("itl", "tpot"):
            assert 0 <= result[f"{key}_p50_s"] <= result[f"{key}_p99_s"]


def test_offline_api_runs_the_same_work_and_the_ratio_is_reported(run):
    summary, _ = run
    offline = summary["offline"]
    assert offline["output_tokens"] == summary["workload"]["output_tokens"]
    assert offline["max_num_seqs"] == 2
    ratio = summary["ratio"]
    assert ratio["concurrency"] == 2
    expected = summary["http"]["2"]["output_tokens_per_s"] / offline["output_tokens_per_s"]
    assert ratio["http_vs_offline_output_tokens_per_s"] == pytest.approx(expected, abs=1e-3)
    assert ratio["meets_target"] == (ratio["http_vs_offline_output_tokens_per_s"] >= 0.9)


def test_machine_load_and_plot_are_recorded(run):
    summary, plot = run
    assert summary["machine"]["load_average_at_start"] >= 0
    assert summary["server"]["started_here"] is True
    assert summary["server"]["cpu_executor"] == "serving"  # measured on the compiled path
    assert plot.is_file() and plot.stat().st_size > 0


def test_chat_workload_streams_chat_completions_with_the_templates_token_count(
    tmp_path, default_model_dir
):
    """Messages go to /v1/chat/completions; every usage must count exactly the prompt's
    tokens under the model's chat template (as the offline API gets them), so the two
    sides do the same work."""
    prompts = tmp_path / "chat.json"
    prompts.write_text(json.dumps(CHAT_PROMPTS))
    summary, _ = serving(
        tmp_path, "--workload", "chat", "--chat-prompts", str(prompts), "--num-requests", "2",
        "--concurrency", "2",
    )  # fmt: skip
    assert summary["server"]["endpoint"] == "/v1/chat/completions"
    assert summary["workload"]["output_tokens"] == 7
    (result,) = summary["http"].values()
    assert result["errors"] == 0
    assert result["output_tokens"] == 7
    assert result["prompt_tokens"] == summary["workload"]["prompt_tokens"]
    assert summary["offline"]["output_tokens"] == 7


def test_structured_runs_are_compared_with_free_ones(tmp_path, default_model_dir):
    results, _ = serving(
        tmp_path, "--structured", "--no-offline", "--concurrency", "2",
        *("--num-requests", str(REQUESTS), "--prompt-mean", "16", "--output-mean", "4"),
    )  # fmt: skip
    structured = results["structured"]
    assert structured["http"]["errors"] == 0
    assert structured["http"]["output_tokens"] == results["http"]["2"]["output_tokens"]
    assert structured["constrained_vs_free_output_tokens_per_s"] > 0
    assert set(structured["compile_ms"]) == {"tokenizer", "schema_first", "schema_cached"}
