"""guidellm, a load generator nobody here wrote, drives the HTTP API: a short
concurrency sweep over streamed chat completions.

guidellm streams `/v1/chat/completions` with `max_completion_tokens`, `ignore_eos`,
`stop: null` and `stream_options.include_usage`, counts tokens with the model's own
tokenizer, and reports requests as successful, errored or incomplete. Its summary must
show every request successful, each with the output length it asked for, at a nonzero
rate; afterwards the server holds no request and no KV block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_http_api import Api, vllm_value
from test_server import start_server, stop_server

pytestmark = pytest.mark.slow

STREAMS = (1, 4)  # the sweep: one stream, then four at once
REQUESTS = 6  # per level
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("loadgen-server"))
    yield server
    stop_server(server)


def base_url(server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def served_model(server) -> str:
    return Api(server).request("GET", "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def report(server, default_model_dir: Path, tmp_path_factory) -> tuple[dict, str]:
    """guidellm's JSON report and its console summary of one sweep."""
    work = tmp_path_factory.mktemp("guidellm")
    output = work / "benchmarks.json"
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": base_url(server),
                "model": served_model(server),
                "request_format": "/v1/chat/completions",
                "http2": False,
                "timeout": 300,
            },
            "tokenizer": {"kind": "huggingface_auto", "model": str(default_model_dir)},
            "profile": {"kind": "concurrent"},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": PROMPT_TOKENS,
                    "output_tokens": OUTPUT_TOKENS,
                }
            ],
            "constraints": [{"kind": "max_requests", "count": REQUESTS}],
            "seed": {"kind": "static", "value": 42},
            "outputs": [{"kind": "json", "path": str(output)}],
        },
        "benchmarks": [{"profile.streams": n} for n in STREAMS],
    }
    (work / "scenario.json").write_text(json.dumps(scenario))
    guidellm = Path(sys.executable).with_name("guidellm")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(work / "hf"), "OMP_NUM_THREADS": "1"}  # fmt: skip
    run = subprocess.run(
        [str(guidellm), "run", "--scenario", str(work / "scenario.json"), "--disable-progress"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    console = run.stdout + run.stderr
    assert run.returncode == 0, f"guidellm failed:\n{console[-6000:]}\n{server.log_tail()}"
    assert output.is_file(), f"guidellm wrote no report:\n{console[-6000:]}"
    return json.loads(output.read_text()), console


def test_sweep_runs_one_benchmark_per_concurrency_level(report):
    benchmarks = report[0]["benchmarks"]
    assert [b["config"]["strategy"]["streams"] for b in benchmarks] == list(STREAMS)


def test_every_request_succeeds_with_the_asked_output_length(report):
    for benchmark in report[0]["benchmarks"]:
        streams = benchmark["config"]["strategy"]["streams"]
        made = benchmark["scheduler_metrics"]["requests_made"]
        # Every request the generator made succeeded. How many it makes is its own: its
        # max_requests constraint has stopped one short (5 of 6) on a loaded machine.
        assert made["errored"] == made["incomplete"] == 0, f"at {streams} streams"
        assert made["successful"] == made["total"] >= REQUESTS - 1, f"at {streams} streams"
        metrics = benchmark["metrics"]
        assert metrics["request_totals"]["errored"] == 0
        # ignore_eos and max_completion_tokens were honoured, as the usage reports them.
        outputs = metrics["output_token_count"]["successful"]
        assert outputs["min"] == outputs["max"] == OUTPUT_TOKENS, f"at {streams} streams"
        assert metrics["prompt_token_count"]["successful"]["min"] >= PROMPT_TOKENS


def test_summary_shows_nonzero_throughput_and_latencies(report):
    for benchmark in report[0]["benchmarks"]:
        metrics = benchmark["metrics"]
        assert metrics["output_tokens_per_second"]["successful"]["mean"] > 0
        assert metrics["requests_per_second"]["successful"]["mean"] > 0
        assert metrics["time_to_first_token_ms"]["successful"]["mean"] > 0
        # Streamed token by token: more than one chunk per request, so gaps exist.
        assert metrics["inter_token_latency_ms"]["successful"]["mean"] > 0
        assert metrics["request_streaming_iterations_count"]["successful"]["min"] > 1
    console = report[1]
    assert "Server Throughput Statistics" in console
    assert "Benchmarking complete" in console


def test_server_is_idle_and_holds_no_blocks_afterwards(report, server):
    server.wait_all_blocks_free()
    metrics = Api(server).metrics()
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc"):  # fmt: skip
        assert vllm_value(metrics, gauge) == 0, gauge
