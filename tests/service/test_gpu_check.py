"""The GPU check (scripts/gpu_check.sh) cannot rot: its dry run, the same steps on CPU at
toy sizes, must pass with every section; and the engine must serve where a GPU host
leaves numba and the control plane's packages out."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up while defined
_spec.loader.exec_module(gpu_check)

SECTIONS = ["kernel_tests", "kernel_cases", "engine", "bandwidth", "throughput"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = out / gpu_check.LOG_NAME
    detail = result.stdout[-3000:] + result.stderr[-3000:]
    if log.is_file():
        detail += log.read_text()[-6000:]
    assert result.returncode == 0, detail
    return json.loads((out / gpu_check.RESULT_NAME).read_text()), out


@pytest.mark.slow
def test_every_section_runs_and_passes(dry_run: tuple[dict[str, Any], Path]) -> None:
    report, out = dry_run
    assert report["mode"] == "dry-run"
    assert report["passed"] is True
    assert list(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert section["status"] == "passed", (name, section)
        assert section["checks"] and all(c["passed"] for c in section["checks"]), name
        assert section["skipped"] == [], name
        # Each section imported pagedinfer through the folder of links, as on a GPU host.
        assert section["device"]["pagedinfer_from"] == "links", name
        # ... and with the packages a GPU host may lack made unimportable.
        assert section["device"]["made_absent"] == list(gpu_check.NOT_NEEDED.values()), name
    assert report["host"]["missing"] == []
    log = (out / gpu_check.LOG_NAME).read_text()
    for name in SECTIONS:
        assert f"===== {name}: passed" in log


@pytest.mark.slow
def test_kernel_sections_cover_the_serving_shapes(dry_run: tuple[dict[str, Any], Path]) -> None:
    report, _ = dry_run
    tests = report["sections"]["kernel_tests"]
    assert tests["tests"]["passed"] > 0 and tests["tests"]["failed"] == 0
    assert tests["device"]["triton_interpreter"] is True
    cases = report["sections"]["kernel_cases"]
    rows = cases["cases"]
    assert len(rows) == len(gpu_check.DRY_PLAN.kernel_cases)
    assert all(r["relative_error"] <= r["tolerance"] and r["finite"] for r in rows)
    assert {r["num_heads"] // r["num_kv_heads"] for r in rows} >= {1, 4, 8}
    assert {r["head_dim"] for r in rows} == {64, 128}
    assert {r["block_size"] for r in rows} == {16, 32}
    assert {r["dtype"] for r in rows} == {"bfloat16", "float32"}
    assert any(r["num_splits"] > 1 for r in rows)  # the split-KV decode ran
    # A prefill chunk after a block-aligned prefix hit: new tokens after cached blocks.
    assert any(
        q > 1 and (s - q) > 0 and (s - q) % r["block_size"] == 0
        for r in rows
        for s, q in zip(r["seq_lens"], r["query_lens"], strict=True)
    )
    assert cases["engine_on_triton"]["triton_served"] is True
    assert cases["engine_on_triton"]["identical"] == cases["engine_on_triton"]["sequences"]


@pytest.mark.slow
def test_engine_section_compares_every_model_dtype_and_scenario(
    dry_run: tuple[dict[str, Any], Path],
) -> None:
    models = dry_run[0]["sections"]["engine"]["models"]
    assert set(models) == {m.name for m in gpu_check.DRY_PLAN.models}
    for name, model in models.items():
        assert model["params"] > 0
        for dtype in ("float32", "bfloat16"):
            run = model[dtype]
            for scenario in ("batched", "prefix_caching", "preemption"):
                assert run[scenario]["passed"] is True, (name, dtype, scenario)
                assert run[scenario]["lengths_ok"] is True
            assert run["batched"]["preemptions"] == 0
            assert run["preemption"]["preemptions"] > 0
            assert min(run["prefix_caching"]["cached_tokens"]) >= 16
        # fp32 on the CPU's torch path: the same tokens as transformers, every one.
        fp32 = model["float32"]["batched"]
        assert fp32["identical"] == fp32["sequences"]


@pytest.mark.slow
def test_speed_sections_report_both_systems_and_the_decode_grid(
    dry_run: tuple[dict[str, Any], Path],
) -> None:
    report, out = dry_run
    speed = report["sections"]["throughput"]
    for system in ("paged", "hf_continuous"):
        assert speed[system]["output_tokens"] == speed["setup"]["output_tokens"]
        assert speed[system]["output_tokens_per_s"] > 0
    assert speed["paged_over_hf_continuous"] > 0
    bandwidth = report["sections"]["bandwidth"]
    assert bandwidth["decode"] and all(r["paged_over_contiguous"] > 0 for r in bandwidth["decode"])
    assert all("pct_of_peak" in r for r in bandwidth["decode"])
    assert (out / "kernels_gpu_smoke.json").is_file()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_check.py"),
            str(tmp_path),
            "--sections",
            "nope",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "unknown sections: nope" in result.stderr


def test_import_shim_maps_every_package_dir(tmp_path: Path) -> None:
    shim = gpu_check.make_import_shim(tmp_path / "shim")
    package = shim / "pagedinfer"
    assert not (package / "__init__.py").exists()  # a namespace package, as installed
    assert {p.name for p in package.iterdir()} == {"service", "kernels", "operator"}
    assert (package / "service").resolve() == REPO / "service"


GENERATE = """
import json, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # importing it fails; importlib.util.find_spec says absent
import pagedinfer.service.engine  # noqa: F401
from pagedinfer.service import LLM, SamplingParams

llm = LLM(sys.argv[2], max_model_len=128, num_gpu_blocks=32, max_num_batched_tokens=32)
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
outputs = llm.generate(json.loads(sys.argv[3]), params)
print(json.dumps([o.outputs[0].token_ids for o in outputs]))
"""


def test_engine_serves_without_numba_and_the_control_plane(make_tiny_model) -> None:
    """The engine imports and generates with numba, kopf, kubernetes_asyncio, the
    OpenTelemetry packages and the rest of gpu_check's NOT_NEEDED unimportable, as a GPU
    host may have them."""
    import torch
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("llama")
    absent = [*gpu_check.NOT_NEEDED.values(), "llvmlite"]
    prompts = [[5, 6, 7, 8, 9], list(range(300, 340))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", GENERATE, ",".join(absent), str(path), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    tokens = json.loads(result.stdout.strip().splitlines()[-1])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    for prompt, got in zip(prompts, tokens, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            want = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
            )
        assert got == want[0, len(prompt) :].tolist()
