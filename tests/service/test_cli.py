"""The `pagedinfer` command: bad input is a clear message and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedinfer.service.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_lists_every_subcommand():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("serve", "generate", "simulate", "operator"):
        assert command in result.stdout


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-2"], "top_k"),
        (["--n", "0"], "n"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--stop", ""], "stop"),
        (["--min-p", "2"], "min_p"),
    ],
)
def test_generate_refuses_bad_sampling_flags_naming_the_field(flags, field):
    result = run_cli("generate", "hello", *flags)
    assert result.returncode == 2
    assert f"error: {field}" in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--block-size", "0"], "block_size must be a positive integer"),
        (["--max-num-seqs", "-4"], "max_num_seqs must be a positive integer"),
        (["--max-model-len", "8", "--block-size", "16"], "max_model_len (8) must be at least"),
        (["--kv-cache-memory", "lots"], "not a byte size"),
        (["--num-threads", "0"], "num_threads must be a positive integer"),
    ],
)
def test_serve_refuses_bad_engine_settings_before_loading(flags, message):
    result = run_cli("serve", *flags)
    assert result.returncode == 2
    assert message in result.stderr


def test_unknown_subcommand_fails():
    result = run_cli("fly")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_generate_prints_every_sample_with_its_finish_reason():
    result = run_cli(
        "generate", "Name a colour:", "-n", "2", "--temperature", "0.8", "--seed", "1",
        "--max-tokens", "4", "--ignore-eos", "--max-model-len", "128",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "[0: length]" in result.stdout and "[1: length]" in result.stdout


def test_generate_chat_streams_an_answer():
    result = run_cli(
        "generate", "What is the capital of France?", "--chat", "--max-tokens", "16",
        "--max-model-len", "256",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
