"""`pagedinfer simulate`: the fragmentation benchmark on a small trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedinfer.service import cli
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.simulate import make_trace, simulate


def test_trace_is_seeded_sharegpt_like_and_fits_max_model_len() -> None:
    trace = make_trace(3000, seed=1, max_model_len=2048)
    assert trace == make_trace(3000, seed=1, max_model_len=2048)
    assert trace != make_trace(3000, seed=2, max_model_len=2048)
    mean_prompt = sum(len(r.prompt_token_ids) for r in trace) / len(trace)
    mean_output = sum(r.num_output_tokens for r in trace) / len(trace)
    assert 161 * 0.85 < mean_prompt < 161 * 1.15
    assert 338 * 0.85 < mean_output < 338 * 1.15
    assert all(len(r.prompt_token_ids) + r.num_output_tokens <= 2048 for r in trace)
    assert all(r.num_output_tokens >= 1 and r.prompt_token_ids for r in trace)
    arrivals = [r.arrival_step for r in trace]
    assert arrivals == sorted(arrivals)


def test_every_request_finishes_with_its_predetermined_length() -> None:
    trace = make_trace(40, seed=3, max_model_len=256, mean_prompt=40, mean_output=60)
    config = EngineConfig(block_size=16, max_model_len=256)
    result = simulate(trace, config, num_blocks=64)
    assert result.steps == len(result.running) == len(result.waste_pct)
    assert result.running[-1] == 0
    # Decode is one token per step, so the longest request bounds the step count below.
    assert result.steps >= max(r.num_output_tokens for r in trace)


def test_simulate_json_shows_paging_beats_contiguous(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "frag.png"
    argv = ["simulate", "--json", "--num-requests", "80", "--plot", str(plot)]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    paged, contiguous = summary["paged"], summary["contiguous"]
    for figures in (paged, contiguous):
        assert set(figures) >= {
            "kv_waste_pct",
            "mean_running",
            "peak_running",
            "steps",
            "preemptions",
        }
    assert paged["kv_waste_pct"] <= 4.0
    assert contiguous["kv_waste_pct"] >= 50.0
    # A short trace ends in a long tail of a few long requests, so compare peaks here.
    assert contiguous["peak_running"] == 12  # the default budget holds 12 reservations
    assert paged["peak_running"] >= 3 * contiguous["peak_running"]
    assert paged["mean_running"] > contiguous["mean_running"]
    assert paged["steps"] < contiguous["steps"]
    assert contiguous["preemptions"] == 0
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_simulate_refuses_bad_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--block-size", "0", "--plot", ""]) == 2
    assert "block_size" in capsys.readouterr().err
    assert cli.main(["simulate", "--num-blocks", "5", "--plot", ""]) == 2
    assert "num_blocks" in capsys.readouterr().err
