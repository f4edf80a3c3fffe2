"""What the compiled CPU kernels share: the jit decorator's fallback and disk-cache keys,
and the fast exp."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pagedinfer.kernels.cpu import numba_support


def test_without_a_writable_cache_directory_it_compiles_in_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_njit = numba_support.numba.njit

    def njit(*args: object, cache: bool = False, **options: object) -> object:
        if cache:  # what numba raises when no cache locator is writable
            raise RuntimeError("cannot cache function: no locator available")
        return real_njit(*args, **options)

    monkeypatch.setattr(numba_support.numba, "njit", njit)

    @numba_support.jit()
    def add_one(x: np.ndarray) -> None:
        for i in range(x.shape[0]):
            x[i] += 1.0

    values = np.zeros(3)
    add_one(values)
    assert values.tolist() == [1.0, 1.0, 1.0]


@numba_support.jit()
def _exp(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    numba_support.exp_into(x, out, np.empty(x.shape[0], dtype=np.int32))
    return out


def test_exp_is_within_fp32_rounding_over_its_range() -> None:
    x = np.concatenate(
        [np.linspace(-87.0, 0.0, 100_001), [0.0, -0.0, -1e-30, -0.34657359, -0.34657360]]
    ).astype(np.float32)
    exact = np.exp(x.astype(np.float64))
    relative = np.abs(_exp(x).astype(np.float64) - exact) / exact
    assert relative.max() < 3e-7  # a few fp32 ulps (one ulp is 6e-8 to 1.2e-7)
    assert _exp(np.zeros(1, dtype=np.float32))[0] == 1.0


def test_exp_below_its_range_gives_the_smallest_value_not_zero_or_nan() -> None:
    x = np.array([-88.0, -1000.0, -np.inf], dtype=np.float32)
    out = _exp(x)
    assert np.all(out == _exp(np.array([-87.0], dtype=np.float32))[0])
    assert np.all((out > 0) & (out < 1e-37))


@numba_support.jit()
def _prefetch_then_sum(x: np.ndarray, indices: np.ndarray) -> float:
    for i in indices:
        numba_support.prefetch(x, i)
    return x.sum()


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_a_snake_deal_gives_every_task_to_one_worker(workers: int) -> None:
    for tasks in range(13):
        turns = (tasks + workers - 1) // workers
        dealt = [
            [
                t
                for t in (numba_support.snake_task(turn, w, workers) for turn in range(turns))
                if t < tasks
            ]
            for w in range(workers)
        ]
        assert sorted(t for share in dealt for t in share) == list(range(tasks))


def test_a_snake_deal_evens_out_tasks_sorted_by_cost() -> None:
    costs = list(range(32, 0, -1))  # largest first, as the attention plans sort them
    shares = [
        sum(costs[numba_support.snake_task(turn, w, 2)] for turn in range(16)) for w in range(2)
    ]
    assert shares == [264, 264]  # round-robin: 272 against 256


def test_prefetch_is_only_a_hint_even_far_outside_the_array() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    indices = np.array([0, 11, 12, -1, 1 << 40, -(1 << 40)], dtype=np.int64)
    assert _prefetch_then_sum(x, indices) == 66.0
    assert x.tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()


def test_prefetch_takes_only_c_contiguous_arrays() -> None:
    with pytest.raises(numba_support.numba.errors.TypingError):
        _prefetch_then_sum(np.zeros((4, 4), dtype=np.float32)[:, ::2], np.zeros(1, np.int64))


@numba_support.jit(fastmath=numba_support.FASTMATH)
def _fma_then_sum(y: np.ndarray, x: np.ndarray, a: float) -> float:
    # Inside a fast-math kernel, as the kernels call them.
    tile = numba_support.stack_array((2, 4))
    numba_support.lanes_copy(tile[0], y, 4)
    numba_support.lanes_fma(tile[0], x, a, 4)
    numba_support.lanes_copy(tile[1], tile[0], 4)
    numba_support.lanes_copy(y, tile[1], 4)
    return numba_support.lanes_sum(y, 4)


def test_lane_ops_round_each_step_once_even_in_a_fast_math_kernel() -> None:
    # (1 + 2^-12)^2 - (1 + 2^-11) is 2^-24 with one rounding, 0 with two.
    near_one = np.float32(1 + 2**-12)
    y = np.array([-(1 + 2**-11), 0.0, 0.0, 0.0], dtype=np.float32)
    x = np.array([near_one, 0.0, 0.0, 0.0], dtype=np.float32)
    assert _fma_then_sum(y, x, near_one) == np.float32(2**-24)
    assert y[0] == np.float32(2**-24)


def test_lanes_sum_adds_by_halving() -> None:
    # (1e8 + -1e8) + (1 + 1) = 2; in order, 1e8 + 1 would lose the 1.
    y = np.array([1e8, 1.0, -1e8, 1.0], dtype=np.float32)
    assert _fma_then_sum(y, np.zeros(4, dtype=np.float32), 0.0) == 2.0


@numba_support.jit(fastmath=numba_support.FASTMATH)
def _fma_where(y: np.ndarray, x: np.ndarray, a: float) -> None:
    numba_support.lanes_fma_where(y, x, a, 4)


def test_fma_where_skips_zero_weights_even_against_nan() -> None:
    y = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    _fma_where(y, np.array([0.0, 0.5, 0.0, 2.0], dtype=np.float32), np.nan)
    assert y[0] == 1.0 and y[2] == 3.0
    assert np.isnan(y[1]) and np.isnan(y[3])


def test_lane_ops_take_only_c_contiguous_float32_rows() -> None:
    with pytest.raises(numba_support.numba.errors.TypingError):
        _fma_where(np.zeros(8, dtype=np.float32)[::2], np.zeros(4, dtype=np.float32), 1.0)


def test_kernels_made_by_factories_keep_one_disk_cache_key_across_processes() -> None:
    """numba keys a closure kernel's disk cache on its pickled closure values. They pickle
    to the same bytes in every process (helpers and intrinsics with stable ids, fast-math
    flags in a fixed order), or every process would compile those kernels again."""
    code = (
        "import hashlib\n"
        "from numba.core.serialize import dumps\n"
        "from pagedinfer.kernels.cpu import fused_step, grid_gemm, paged_decode, paged_verify\n"
        "gemm = grid_gemm.gemm_all_rows('affine4', 576, (288, 576), True)\n"
        "shape = fused_step.StepShape(256, 4, 2, 64, 512, 512, 16)\n"
        "orders = tuple(grid_gemm.fixed_order(k) for k in (256, 256, 256, 512, 256))\n"
        "step = fused_step._kernel(shape, ('affine4',) * 4 + ('scaled8',), (None,) * 4, orders, 2)\n"
        "decode, verify = (m.compiled_kernel(16, 9, 3, 64) for m in (paged_decode, paged_verify))\n"
        "for kernel in (decode, verify, gemm, step):\n"
        "    cells = tuple(cell.cell_contents for cell in kernel.py_func.__closure__)\n"
        "    print(hashlib.sha256(dumps(cells)).hexdigest())\n"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    ]
    assert len(runs[0].split()) == 4
    assert runs[0] == runs[1]


def test_kernels_made_by_one_factory_keep_cache_files_of_their_own() -> None:
    """numba numbers the variants of one function in one index as it saves them; two
    processes compiling different variants at once could give two of them one file, and a
    later process ran one variant's code for the other. Each variant has its own files."""
    from pagedinfer.kernels.cpu import grid_gemm

    kernels = [
        grid_gemm.gemm_kernel("affine4", rows, 256, ends, True)
        for rows in (1, 2)
        for ends in ((256,), (128, 256))
    ]
    names = {kernel._cache._cache_file._index_name for kernel in kernels}
    assert len(names) == len(kernels)


def test_a_prebuilt_kernel_cache_is_copied_into_the_writable_one_once(tmp_path) -> None:
    """An image's read-only cache seeds the pod's writable NUMBA_CACHE_DIR on first start."""
    prebuilt, target = tmp_path / "prebuilt", tmp_path / "cache"
    (prebuilt / "pagedinfer" / "kernels").mkdir(parents=True)
    (prebuilt / "pagedinfer" / "kernels" / "step.nbi").write_bytes(b"index")
    assert numba_support.seed_disk_cache(str(prebuilt), str(target))
    assert (target / "pagedinfer" / "kernels" / "step.nbi").read_bytes() == b"index"
    (target / "pagedinfer" / "kernels" / "step.nbi").write_bytes(b"newer")
    assert not numba_support.seed_disk_cache(str(prebuilt), str(target))  # seeded already
    assert (target / "pagedinfer" / "kernels" / "step.nbi").read_bytes() == b"newer"
    assert not numba_support.seed_disk_cache(str(prebuilt), str(prebuilt))
    assert not numba_support.seed_disk_cache(str(tmp_path / "missing"), str(target))
