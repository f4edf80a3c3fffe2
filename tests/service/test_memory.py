"""KV cache sizing from the memory limit: the rule as a table, and the readers of /proc
and the cgroup filesystem over fake trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedinfer.service import memory
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.memory import Footprint, GiB, HostMemory, MiB
from pagedinfer.service.models.llama import ModelConfig

BLOCK = 720 * 1024  # one 16-token block of the embedded model in fp32
LAYERS = 30


def smollm2() -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, num_layers=LAYERS,
        num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
        rms_norm_eps=1e-5, rope_theta=1e5, rope_scaling=None, tie_word_embeddings=True,
        attention_bias=False, max_position_embeddings=8192,
    )  # fmt: skip


def limited(limit: int, available: int = 64 * GiB) -> HostMemory:
    return HostMemory(limit=limit, source="memory.max", available=available)


def footprint(resident: int, activations: int = 100 * MiB, pending: int = 0) -> Footprint:
    return Footprint(resident=resident, pending=pending, activations=activations)


def expected_with_limit(usable: int, model: Footprint) -> int:
    left = usable - int(usable * memory.HEADROOM) - model.resident - model.pending
    return int((left - model.activations - memory.SERVING_ALLOWANCE) / (1 + 2 / LAYERS))


@pytest.mark.parametrize(
    ("limit", "model"),
    [
        (2 * GiB, footprint(700 * MiB)),
        (2 * GiB, footprint(700 * MiB, pending=300 * MiB)),
        (6 * GiB, footprint(1200 * MiB, 500 * MiB)),
        (16 * GiB, footprint(3 * GiB, 400 * MiB, pending=1 * GiB)),
    ],
)
def test_the_budget_is_the_limit_less_headroom_footprint_and_scratch(limit, model):
    plan = memory.plan_kv_cache(limited(limit), model, BLOCK, LAYERS, 256)
    assert plan.budget == expected_with_limit(limit, model)
    assert plan.num_blocks == plan.budget // BLOCK
    # What the process may end up holding stays inside the limit, headroom spare.
    peak = model.resident + model.pending + model.activations + memory.SERVING_ALLOWANCE
    assert peak + plan.budget * (1 + 2 / LAYERS) <= limit * (1 - memory.HEADROOM)


def test_a_host_with_less_available_than_the_limit_bounds_the_budget():
    host = limited(16 * GiB, available=3 * GiB)
    plan = memory.plan_kv_cache(host, footprint(1 * GiB), BLOCK, LAYERS, 256)
    assert plan.budget == expected_with_limit(4 * GiB, footprint(1 * GiB))
    assert "available memory 4.00 GiB" in plan.reason


def test_the_log_line_names_every_term():
    model = footprint(700 * MiB, pending=300 * MiB)
    plan = memory.plan_kv_cache(limited(3 * GiB), model, BLOCK, LAYERS, 256)
    for text in ("3.00 GiB (memory.max)", "holds 700 MiB", "builds 300 MiB more",
                 "take 100 MiB", "headroom 10%"):  # fmt: skip
        assert text in plan.reason
    assert plan.reason.startswith(f"KV cache budget {plan.budget / GiB:.2f} GiB from")


@pytest.mark.parametrize(
    ("available", "budget"),
    [
        (64 * GiB, memory.NO_LIMIT_KV_CAP),  # plenty: the cap
        (
            1 * GiB,
            int((GiB // 2 - 100 * MiB - memory.SERVING_ALLOWANCE) / (1 + 2 / LAYERS)),
        ),  # a share of what is available, less what is still to come
    ],
)
def test_without_a_limit_a_share_of_the_available_memory_capped(available, budget):
    host = HostMemory(limit=None, source="no cgroup memory limit", available=available)
    plan = memory.plan_kv_cache(host, footprint(700 * MiB), BLOCK, LAYERS, 16)
    assert plan.budget == budget


def test_a_limit_that_cannot_hold_the_model_and_a_block_per_sequence_is_refused():
    with pytest.raises(ValueError) as err:
        memory.plan_kv_cache(limited(1 * GiB), footprint(900 * MiB), BLOCK, LAYERS, 256)
    message = str(err.value)
    assert "cannot hold the model and one KV block per sequence" in message
    assert "1.00 GiB (memory.max)" in message and "--max-num-seqs" in message
    # The limit it names does hold the model and 256 blocks.
    needed = int(float(message.split("a limit of at least ")[1].split(" GiB")[0]) * GiB) + 10 * MiB
    assert memory.plan_kv_cache(limited(needed), footprint(900 * MiB), BLOCK, LAYERS, 256)
    # Fewer sequences fit where 256 do not.
    plan = memory.plan_kv_cache(limited(1400 * MiB), footprint(900 * MiB), BLOCK, LAYERS, 16)
    assert plan.num_blocks >= 16
    with pytest.raises(ValueError, match="one KV block per sequence"):
        memory.plan_kv_cache(limited(1400 * MiB), footprint(900 * MiB), BLOCK, LAYERS, 256)


def test_what_the_backend_still_builds_is_reserved():
    model = footprint(700 * MiB, pending=300 * MiB)
    with_pending = memory.plan_kv_cache(limited(2 * GiB), model, BLOCK, LAYERS, 16)
    without = memory.plan_kv_cache(limited(2 * GiB), footprint(700 * MiB), BLOCK, LAYERS, 16)
    assert without.budget - with_pending.budget == pytest.approx(
        300 * MiB / (1 + 2 / LAYERS), abs=1
    )


def test_a_compiling_child_fits_where_the_limit_holds_it_beside_the_model():
    """The flagship example's 2 GiB limit holds the model served on its dense weights
    with a KV block per sequence, but not a compiling child beside them: the server
    then compiles first. More memory, or no limit, holds both."""
    dense = footprint(1034 * MiB, activations=123 * MiB)
    assert memory.plan_kv_cache(limited(2 * GiB), dense, BLOCK, LAYERS, 256)
    assert not memory.child_compile_fits(limited(2 * GiB), dense, BLOCK, LAYERS, 256)
    assert memory.child_compile_fits(limited(3 * GiB), dense, BLOCK, LAYERS, 256)
    unlimited = HostMemory(limit=None, source="no cgroup memory limit", available=16 * GiB)
    assert memory.child_compile_fits(unlimited, dense, BLOCK, LAYERS, 256)
    # A child fits at a limit exactly where a plan that reserves it holds the blocks.
    for limit in range(1800 * MiB, 2600 * MiB, 50 * MiB):
        reserved = footprint(1034 * MiB, activations=123 * MiB, pending=memory.COMPILE_CHILD_BYTES)
        try:
            memory.plan_kv_cache(limited(limit), reserved, BLOCK, LAYERS, 256)
            holds = True
        except ValueError:
            holds = False
        assert memory.child_compile_fits(limited(limit), dense, BLOCK, LAYERS, 256) == holds


def test_backend_pending_bytes_by_mode():
    model = smollm2()
    weights = 30 * (576 * (576 + 384) + 576 * 576 + 3 * 576 * 1536) + 49152 * 576
    assert memory.gemm_weights(model) == weights
    assert memory.backend_pending_bytes(model, "grid", 4) == int(
        weights * memory.GRID_BYTES_PER_WEIGHT
    )
    assert memory.backend_pending_bytes(model, "mkl", 4) == 4 * weights
    assert memory.backend_pending_bytes(model, "onednn", 2) == 2 * weights
    assert memory.backend_pending_bytes(model, "dense", 4) == 0
    with pytest.raises(ValueError, match="unknown CPU backend mode 'fast'"):
        memory.backend_pending_bytes(model, "fast", 4)


def test_activations_grow_with_the_step_and_the_logit_rows():
    """Every sampled row's logits, plus the sampler's copies of one chunk of rows."""
    from pagedinfer.service.sampler import SAMPLE_CHUNK_ROWS

    model = smollm2()
    small = memory.activation_bytes(model, EngineConfig(max_num_batched_tokens=64), 4)
    default = memory.activation_bytes(model, EngineConfig(), 4)
    per_token = (3 * 576 + 2 * 576 + 2 * 192 + 3 * 1536) * 4
    row = 49152 * 4
    chunk = SAMPLE_CHUNK_ROWS * memory.LOGITS_COPIES * row
    assert default == 512 * per_token + 256 * row + chunk  # 256 sequences' rows
    assert small == 64 * per_token + 64 * row + chunk  # no more rows than tokens
    drafts = EngineConfig(max_num_seqs=16, num_speculative_tokens=4)
    assert memory.activation_bytes(model, drafts, 4) == 512 * per_token + 80 * row + chunk
    few = EngineConfig(max_num_seqs=4)
    assert memory.activation_bytes(model, few, 4) == 512 * per_token + 4 * row * (
        1 + memory.LOGITS_COPIES
    )


@pytest.mark.parametrize(
    ("text", "limit"),
    [
        ("max\n", None),
        ("2147483648\n", 2 * GiB),
        ("9223372036854771712\n", None),  # cgroup v1's "unlimited"
        (f"{64 * GiB}\n", None),  # no less than the machine's memory: no limit
    ],
)
def test_limit_files_parse(text, limit):
    assert memory.parse_limit(text, total=64 * GiB) == limit


def test_a_garbled_limit_file_is_named():
    with pytest.raises(ValueError, match="not a cgroup memory limit: 'lots'"):
        memory.parse_limit("lots", total=GiB)


def test_cgroup_paths_of_v2_hybrid_and_v1_hosts():
    assert memory.cgroup_paths("0::/kubepods/pod1/c1\n") == ("/kubepods/pod1/c1", None)
    hybrid = "4:memory:/docker/abc\n1:cpu,cpuacct:/docker/abc\n0::/docker/abc\n"
    assert memory.cgroup_paths(hybrid) == ("/docker/abc", "/docker/abc")
    assert memory.cgroup_paths("5:cpuset:/\n3:memory,kmem:/x\n") == (None, "/x")


def fake_proc(root: Path, cgroup: str, total: int = 64 * GiB, available: int = 60 * GiB) -> Path:
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "meminfo").write_text(
        f"MemTotal: {total // 1024} kB\nMemFree: 1 kB\nMemAvailable: {available // 1024} kB\n"
    )
    (proc / "self" / "status").write_text("Name:\tpython\nVmHWM:\t 2048 kB\nVmRSS:\t 1024 kB\n")
    return proc


def write(path: Path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name_value in text.split(";"):
        name, value = name_value.split("=")
        (path / name).write_text(value + "\n")


def test_v2_the_smallest_limit_of_the_cgroup_and_its_parents(tmp_path):
    proc = fake_proc(tmp_path, "0::/kubepods/pod1/c1\n")
    cg = tmp_path / "cgroup"
    write(cg / "kubepods", f"memory.max={8 * GiB}")
    write(cg / "kubepods/pod1", f"memory.max={3 * GiB}")
    write(cg / "kubepods/pod1/c1", f"memory.max=max;memory.high={2 * GiB + 1}")
    host = memory.read_host_memory(proc, cg)
    assert host == HostMemory(2 * GiB + 1, str(cg / "kubepods/pod1/c1/memory.high"), 60 * GiB)


def test_v2_inside_a_cgroup_namespace_reads_the_mount_root(tmp_path):
    proc = fake_proc(tmp_path, "0::/\n")
    cg = tmp_path / "cgroup"
    write(cg, f"memory.max={2 * GiB}")
    assert memory.read_host_memory(proc, cg).limit == 2 * GiB


def test_v2_a_path_missing_under_the_mount_means_the_root_is_our_cgroup(tmp_path):
    proc = fake_proc(tmp_path, "0::/system.slice/docker-abc.scope\n")
    cg = tmp_path / "cgroup"
    write(cg, f"memory.max={GiB}")
    assert memory.read_host_memory(proc, cg).limit == GiB


def test_v1_limit_in_bytes_with_unlimited_parents(tmp_path):
    proc = fake_proc(tmp_path, "4:memory:/docker/abc\n0::/docker/abc\n")
    cg = tmp_path / "cgroup"
    write(cg / "memory", "memory.limit_in_bytes=9223372036854771712")
    write(cg / "memory/docker/abc", f"memory.limit_in_bytes={6 * GiB}")
    host = memory.read_host_memory(proc, cg)
    assert host.limit == 6 * GiB
    assert host.source.endswith("memory/docker/abc/memory.limit_in_bytes")


def test_no_limit_anywhere(tmp_path):
    proc = fake_proc(tmp_path, "4:memory:/\n0::/\n", available=5 * GiB)
    cg = tmp_path / "cgroup"
    write(cg, "memory.max=max")
    write(cg / "memory", "memory.limit_in_bytes=9223372036854771712")
    assert memory.read_host_memory(proc, cg) == HostMemory(None, "no cgroup memory limit", 5 * GiB)


def test_the_cgroup_root_comes_from_the_environment(tmp_path, monkeypatch):
    proc = fake_proc(tmp_path, "0::/\n")
    write(tmp_path / "elsewhere", f"memory.max={3 * GiB}")
    monkeypatch.setenv(memory.CGROUP_ROOT_ENV, str(tmp_path / "elsewhere"))
    assert memory.read_host_memory(proc).limit == 3 * GiB


def test_resident_bytes_reads_vmrss(tmp_path):
    proc = fake_proc(tmp_path, "0::/\n")
    assert memory.resident_bytes(proc) == 1024 * 1024
    assert memory.resident_bytes() > 10 * MiB  # this interpreter, for real


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zeroed_cpu_tensors_are_zero_separate_and_writable(dtype):
    import torch

    dtype = getattr(torch, dtype)
    tensors = memory.zeroed_cpu_tensors(4, (5, 16, 3, 8), dtype)
    assert [(t.shape, t.dtype, t.is_contiguous()) for t in tensors] == [
        (torch.Size([5, 16, 3, 8]), dtype, True)
    ] * 4
    tensors[2][1, 3] = 7.0
    tensors[2].index_copy_(0, torch.tensor([4]), tensors[2].index_select(0, torch.tensor([1])))
    assert [float(t.abs().sum()) for t in tensors] == [0.0, 0.0, 7.0 * 2 * 3 * 8, 0.0]
    assert all(t.data_ptr() % 64 == 0 for t in tensors)


def test_zeroed_cpu_tensors_become_resident_without_being_written():
    """The background thread faults the pages in: the process holds the cache from the
    start, not only once serving has written it."""
    import os
    import time

    import torch

    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    if release < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    before = memory.resident_bytes()
    tensors = memory.zeroed_cpu_tensors(2, (64, MiB // 4), torch.float32)
    deadline = time.monotonic() + 30
    while memory.resident_bytes() - before < 120 * MiB and time.monotonic() < deadline:
        time.sleep(0.05)
    assert memory.resident_bytes() - before >= 120 * MiB
    assert float(tensors[1].abs().sum()) == 0.0
