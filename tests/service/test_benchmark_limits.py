"""The run-time floors of benchmarks/limits.py: the bound must hold and must not be loose.

The benchmark quotes these floors as what no engine can beat on this machine's matmul
library, so the tests check the bound against schedules computed by brute force.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedinfer.service.loader import load_model

_path = Path(__file__).resolve().parents[2] / "benchmarks" / "limits.py"
_spec = importlib.util.spec_from_file_location("benchmark_limits", _path)
limits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(limits)


def cheapest_schedules(
    prompts: list[int], outputs: list[int], token_cost, row_cost
) -> tuple[float, float]:
    """By brute force over every schedule: the least total token_cost(tokens of a pass)
    and the least total row_cost(LM-head rows of a pass).

    A schedule runs passes until all is done. In each pass a request either sends a
    chunk of its remaining prompt (its last chunk yields its first output token, one
    LM-head row), or, from the pass after its prompt is done, one decode token (one more
    output token, one row), or sits out.
    """

    @functools.cache
    def cheapest(state: tuple[tuple[int, int], ...], cost_of: str) -> float:
        if all(left == 0 and decodes == 0 for left, decodes in state):
            return 0.0
        options = []
        for left, decodes in state:
            if left:
                options.append(
                    [
                        (chunk, int(chunk == left), (left - chunk, decodes))
                        for chunk in range(left + 1)
                    ]
                )
            elif decodes:
                options.append([(0, 0, (0, decodes)), (1, 1, (0, decodes - 1))])
            else:
                options.append([(0, 0, (0, 0))])
        best = float("inf")
        for choice in itertools.product(*options):
            tokens = sum(tokens for tokens, _, _ in choice)
            if tokens == 0:
                continue
            rows = sum(rows for _, rows, _ in choice)
            cost = token_cost(tokens) if cost_of == "tokens" else (row_cost(rows) if rows else 0.0)
            best = min(best, cost + cheapest(tuple(after for _, _, after in choice), cost_of))
        return best

    start = tuple((p, o - 1) for p, o in zip(prompts, outputs, strict=True))
    return cheapest(start, "tokens"), cheapest(start, "rows")


WORKLOADS = [([2, 3], [3, 2]), ([1, 2, 3], [1, 3, 2]), ([3, 1, 2], [4, 1, 2]), ([2, 2], [3, 3])]


def floors(prompts, outputs, curve, row_curve, per_unit):
    tokens = limits.token_profile(prompts, outputs)
    rows = limits.row_profile(outputs)
    return (
        limits.schedule_floor(limits.staircase(curve, per_unit, max(tokens)), tokens),
        limits.schedule_floor(limits.staircase(row_curve, per_unit, max(rows)), rows),
    )


def test_profiles_count_decode_tokens_and_rows() -> None:
    # Request 0: 3 prompt tokens, 3 outputs (2 decode tokens); request 1: 2 and 1 (none).
    assert limits.token_profile([3, 2], [3, 1]) == [1 + 5, 1]
    assert limits.row_profile([3, 1]) == [2, 1, 1]
    assert limits.token_profile([4], [1]) == [4]  # one output: the prompt's pass only


def test_staircase_trusts_the_lower_of_two_contradicting_measurements() -> None:
    s = limits.staircase({1: 5.0, 2: 9.0, 3: 7.0, 5: 12.0}, 1.0, 13)
    assert s[0] == 0.0
    assert list(s[1:7]) == [5.0, 7.0, 7.0, 7.0, 12.0, 12.0]
    assert s[13] == 13.0  # the best rate's line


def test_concave_costs_give_exactly_the_profiles_cost() -> None:
    cost = {m: 4.0 + 3.0 * math.sqrt(m) for m in range(1, 60)}
    profile = limits.token_profile([10, 7, 5], [6, 3, 9])
    floor = limits.schedule_floor(limits.staircase(cost, 0.0, max(profile)), profile)
    assert floor == pytest.approx(sum(cost[m] for m in profile), rel=1e-6)


@pytest.mark.parametrize("prompts,outputs", WORKLOADS)
def test_affine_costs_are_tight_to_one_pass(prompts, outputs) -> None:
    # t(m) = 10 + 2m: a schedule of K passes costs 10K + 2N, and every schedule needs a
    # pass for the longest prompt and one per later output token. The relaxation lets a
    # prompt share a pass with its own decodes: it is one pass's fixed cost short.
    cost = {m: 10.0 + 2.0 * m for m in range(1, 40)}
    floor, row_floor = floors(prompts, outputs, cost, cost, 2.0)
    cheapest, cheapest_rows = cheapest_schedules(prompts, outputs, cost.get, cost.get)
    assert floor <= cheapest + 1e-9
    assert cheapest - floor == pytest.approx(10.0)
    assert row_floor == pytest.approx(cheapest_rows)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prompts,outputs", WORKLOADS)
def test_floor_is_at_most_every_brute_force_schedule(prompts, outputs, seed) -> None:
    """Measured curves are neither concave nor monotone: the floor must stay below the
    cheapest schedule anyway, and not far below it (the bound is not vacuous)."""
    rng = random.Random(seed)
    cost, level = {}, 3.0
    for m in range(1, 40):
        level += rng.uniform(0.0, 2.5)
        cost[m] = level * rng.uniform(0.85, 1.0)  # noise: sometimes cheaper than m - 1
    floor, row_floor = floors(prompts, outputs, cost, cost, 0.3)
    cheapest, cheapest_rows = cheapest_schedules(prompts, outputs, cost.get, cost.get)
    assert floor <= cheapest + 1e-9
    assert row_floor <= cheapest_rows + 1e-9
    assert floor >= 0.6 * cheapest
    assert row_floor >= 0.6 * cheapest_rows


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="m = 1"):
        limits.staircase({2: 1.0}, 0.1, 10)
    with pytest.raises(ValueError, match="one prompt length per output length"):
        limits.token_profile([3], [2, 2])
    with pytest.raises(ValueError, match="one output token"):
        limits.row_profile([2, 0])
    with pytest.raises(ValueError, match="costs stop at 3 rows"):
        limits.schedule_floor(limits.staircase({1: 1.0}, 0.1, 3), [5, 1])


def copied_draft(text: list[int], known: int, start: int, length: int) -> list[int]:
    """The draft a copying drafter builds from text[:known]: the tokens from `start` on,
    continuing into its own earlier guesses past the end of what it knows."""
    draft: list[int] = []
    for a in range(length):
        source = start + a
        draft.append(text[source] if source < known else draft[source - known])
    return draft


@pytest.mark.parametrize("seed", range(30))
def test_best_copy_draft_is_the_best_copy_a_drafter_can_build(seed) -> None:
    rng = random.Random(seed)
    text = [rng.randrange(3) for _ in range(rng.randrange(2, 16))]
    for known in range(1, len(text) + 1):
        for max_tokens in (0, 1, 3, 8):
            expected = 0
            for start in range(1, known):
                if text[start - 1] != text[known - 1]:  # not after the last token
                    continue
                draft = copied_draft(text, known, start, max_tokens)
                kept = 0
                while kept < len(draft) and known + kept < len(text):
                    if draft[kept] != text[known + kept]:
                        break
                    kept += 1
                expected = max(expected, kept)
            assert limits.best_copy_draft(text, known, max_tokens) == expected


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("max_draft", [1, 2, 5])
def test_copy_draft_passes_are_the_fewest(seed, max_draft) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
    output = [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
    passes = limits.copy_draft_passes(prompt, output, max_draft)
    assert sum(passes) == len(output) - 1
    assert all(1 <= p <= max_draft + 1 for p in passes)
    # Breadth first over every count of kept tokens a pass can end with.
    text, end = prompt + output, len(output)
    frontier, steps = {1}, 0
    while end not in frontier:
        frontier = {
            nxt
            for done in frontier
            for nxt in range(
                done + 1,
                done
                + 2
                + limits.best_copy_draft(text, len(prompt) + done, min(max_draft, end - done - 1)),
            )
        }
        steps += 1
    assert len(passes) == steps
    # Each pass's end is reachable from the previous one.
    done = 1
    for p in passes:
        room = end - done - 1
        assert p <= 1 + limits.best_copy_draft(text, len(prompt) + done, min(max_draft, room))
        done += p


def test_copied_drafts_need_a_pass_per_token_of_new_text_and_few_for_a_loop() -> None:
    prompt = [100, 101, 102]
    novel = list(range(10))  # nothing repeats: no copy is ever kept
    assert limits.copy_draft_passes(prompt, novel, 4) == [1] * 9
    loop = [7, 8, 9] * 8  # after one period every draft holds, up to its length
    assert limits.copy_draft_passes(prompt, loop, 4) == [1, 1, 1, 5, 5, 5, 5]
    schedule = limits.copy_draft_schedule(
        [3, 2], [limits.copy_draft_passes(p, o, 4) for p, o in ((prompt, novel), ([5, 6], loop))]
    )
    assert schedule[0] == (5, 2)  # every prompt in the first pass, a row per request
    decode = [m for m, _ in schedule[1:]]
    assert all(m == r for m, r in schedule[1:])
    assert sum(decode) == (len(novel) - 1) + (len(loop) - 1)
    assert len(decode) == 9  # the novel request sets the count


def test_copy_draft_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="known"):
        limits.best_copy_draft([1, 2], 0, 3)
    with pytest.raises(ValueError, match="known"):
        limits.best_copy_draft([1, 2], 1, -1)
    with pytest.raises(ValueError, match="one output token"):
        limits.copy_draft_passes([1], [], 2)
    with pytest.raises(ValueError, match="one prompt length per request's passes"):
        limits.copy_draft_schedule([1], [[2], [3]])


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_every_gemm_form_computes_the_product(rows: int) -> None:
    weight = torch.randn(24, 40)
    x = torch.randn(rows, 40)
    forms = limits.gemm_forms(weight, rows)
    assert {"x @ W^T", "(W @ x^T)^T", "x @ W_io", "(W_io^T @ x^T)^T"} <= set(forms)
    for name, form in forms.items():
        out = form(x)
        assert out.shape == (rows, 24), name
        torch.testing.assert_close(out, x @ weight.t(), rtol=1e-4, atol=1e-4, msg=name)


def test_measures_the_models_own_gemms(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(str(make_tiny_model("llama")), torch.device("cpu"), torch.float32).model
    cfg = model.config
    per_layer = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer += cfg.num_heads * cfg.head_dim * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    assert limits.layer_flops_per_token(model) == 2 * cfg.num_layers * per_layer
    # Every GEMM of every layer runs, at the token count asked, through the model's code.
    seen: list[tuple[int, int]] = []
    for layer in model.layers:
        for linear in layer.linears():
            forward, add_into = linear.forward, linear.add_into

            def record_forward(x, linear=linear, forward=forward):
                seen.append((id(linear), x.shape[0]))
                return forward(x)

            def record_add_into(out, x, linear=linear, add_into=add_into):
                seen.append((id(linear), x.shape[0]))
                add_into(out, x)

            monkeypatch.setattr(linear, "forward", record_forward)
            monkeypatch.setattr(linear, "add_into", record_add_into)
    curve = limits.gemm_curve(model, [4, 1, 4], repeats=1)
    assert sorted(curve) == [1, 4]
    linears = {id(linear) for layer in model.layers for linear in layer.linears()}
    for tokens in (1, 4):
        # Once to warm up and once timed, for each distinct token count.
        calls = [linear for linear, rows in seen if rows == tokens]
        assert sorted(calls) == sorted(2 * list(linears))


def test_measures_the_executors_gemms_where_it_serves(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a CPU executor serving, the GEMMs timed are its own (the model's dense ones
    are released), each at the token count asked, and the LM head is its LM head."""
    from pagedinfer.kernels import cpu

    model = load_model(str(make_tiny_model("llama")), torch.device("cpu"), torch.float32).model
    executor = cpu.prepare(model, block_size=16)
    if executor is None:
        pytest.skip("no CPU executor on this machine (no MKL for fp32)")
    assert executor.active
    seen: list[tuple[int, int]] = []

    class Recording:
        def __init__(self, gemm) -> None:
            self.gemm = gemm

        def __call__(self, x):
            seen.append((id(self), x.shape[0]))
            return self.gemm(x)

        def add_into(self, out, x) -> None:
            seen.append((id(self), x.shape[0]))
            self.gemm.add_into(out, x)

    recorders = []
    for layer in executor.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            recorder = Recording(getattr(layer, name))
            monkeypatch.setattr(layer, name, recorder)
            recorders.append(id(recorder))
    lm_head = Recording(executor.lm_head)
    monkeypatch.setattr(executor, "lm_head", lm_head)
    curve = limits.gemm_curve(model, [4, 1, 4], repeats=1, executor=executor)
    assert sorted(curve) == [1, 4]
    for tokens in (1, 4):
        calls = [gemm for gemm, rows in seen if rows == tokens]
        assert sorted(calls) == sorted(2 * recorders)  # warm-up and timed
    seen.clear()
    assert limits.lm_head_seconds(model, 3, repeats=1, executor=executor) > 0
    assert seen == [(id(lm_head), 3)] * 2
    if executor.argmax is None:  # greedy rows then take the logits too
        seen.clear()
        limits.lm_head_seconds(model, 3, repeats=1, greedy=True, executor=executor)
        assert seen == [(id(lm_head), 3)] * 2


def test_fastest_forms_are_timed_from_dense_weights(make_tiny_model: Callable[..., Path]) -> None:
    from pagedinfer.kernels import cpu

    path = str(make_tiny_model("llama"))
    dense = load_model(path, torch.device("cpu"), torch.float32).model
    curve, lm_head = limits.best_gemm_curves(dense, [3, 1], [2, 1], repeats=1)
    assert sorted(curve) == [1, 3] and all(t > 0 for t in curve.values())
    assert sorted(lm_head) == [1, 2] and all(t > 0 for t in lm_head.values())
    if cpu.prepare(dense, block_size=16) is None:
        pytest.skip("no CPU executor on this machine (no MKL for fp32): the weights stay")
    with pytest.raises(ValueError, match="went to a CPU executor"):
        limits.best_gemm_curves(dense, [1], [1])


def test_decode_context_slots_count_each_decode_tokens_context() -> None:
    # Request 0: prompt 3, outputs 3: decode tokens at positions 3 and 4 see 4 and 5
    # positions. Request 1 has one output: no decode token.
    assert limits.decode_context_slots([3, 2], [3, 1]) == 4 + 5
    rng = random.Random(0)
    prompts = [rng.randint(1, 50) for _ in range(20)]
    outputs = [rng.randint(1, 50) for _ in range(20)]
    by_position = sum(p + j for p, o in zip(prompts, outputs, strict=True) for j in range(1, o))
    assert limits.decode_context_slots(prompts, outputs) == by_position
    with pytest.raises(ValueError, match="one prompt length per output length"):
        limits.decode_context_slots([3], [2, 2])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3)])
def test_every_decode_attention_form_computes_attention(heads: int, kv_heads: int) -> None:
    seqs, ctx, head_dim, scale = 3, 11, 8, 0.3
    query = torch.randn(seqs, heads, head_dim)
    key = torch.randn(seqs, kv_heads, ctx, head_dim)
    value = torch.randn(seqs, kv_heads, ctx, head_dim)
    # One head at a time: query head h reads KV head h // (heads / kv_heads).
    expected = torch.empty(seqs, heads, head_dim)
    for s in range(seqs):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            weights = torch.softmax(key[s, kv] @ query[s, h] * scale, dim=0)
            expected[s, h] = weights @ value[s, kv]
    forms = limits.decode_attention_forms(query, key, value, scale)
    assert len(forms) >= 3
    for name, form in forms.items():
        torch.testing.assert_close(form(), expected, rtol=1e-4, atol=1e-5, msg=name)


def test_attention_slot_cost_is_the_least_over_the_grid(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_model(str(make_tiny_model("llama")), torch.device("cpu")).model.config
    # Every (sequences, context) of the grid is timed, with K/V for every layer, and
    # the cost per position of the cheapest one is returned, with where it was seen.
    timed: list[tuple[int, int, int]] = []
    keys_seen: list[int] = []  # the context length of each set of forms made
    fake_seconds = {(1, 4): 8.0, (1, 16): 8.0, (2, 4): 2.0, (2, 16): 48.0}

    def fake_best_time(fn, repeats):
        out = fn()
        seqs, ctx = out[0].shape[0], keys_seen[-1]
        timed.append((seqs, ctx, len(out)))
        return fake_seconds[(seqs, ctx)]

    forms = limits.decode_attention_forms

    def recording_forms(query, key, value, scale):
        keys_seen.append(key.shape[2])
        return forms(query, key, value, scale)

    monkeypatch.setattr(limits, "_best_time", fake_best_time)
    monkeypatch.setattr(limits, "decode_attention_forms", recording_forms)
    per_slot, where = limits.attention_slot_seconds(config, [2, 1, 2], [16, 4])
    layers = config.num_layers
    assert where == (2, 4)
    assert per_slot == pytest.approx(2.0 / (2 * 4 * layers))
    assert {(s, c) for s, c, _ in timed} == set(fake_seconds)
    assert all(n == layers for _, _, n in timed)  # one call per layer
    with pytest.raises(ValueError, match="at least one sequence count"):
        limits.attention_slot_seconds(config, [], [4])
    with pytest.raises(ValueError, match="each at least 1"):
        limits.attention_slot_seconds(config, [1], [0])


def test_attention_slot_cost_is_measured(make_tiny_model: Callable[..., Path]) -> None:
    config = load_model(str(make_tiny_model("llama")), torch.device("cpu")).model.config
    per_slot, where = limits.attention_slot_seconds(config, [1, 3], [8, 32], repeats=1)
    assert where in {(1, 8), (1, 32), (3, 8), (3, 32)}
    assert 0 < per_slot < 1e-3


def test_fastest_forms_are_timed_inside_whole_passes(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each form runs every layer's GEMMs in forward order, then the LM head: the order
    a pass reads the weights in, so each comes from where the rest of the pass left
    the caches."""
    dense = load_model(str(make_tiny_model("llama")), torch.device("cpu")).model
    names = {id(dense.lm_head_weight()): "lm"}
    for i, layer in enumerate(dense.layers):
        for kind, linear in zip(("qkv", "o", "gate_up", "down"), layer.linears(), strict=True):
            names[id(linear.weight)] = f"{kind}{i}"
    calls: list[tuple[str, str]] = []

    def recording_forms(weight, rows):
        name = names[id(weight)]  # the parameter itself, [out, in]

        def form(label):
            return lambda x: calls.append((label, name)) or x @ weight.t()

        return {"a": form("a"), "b": form("b")}

    monkeypatch.setattr(limits, "gemm_forms", recording_forms)
    limits.best_gemm_curves(dense, [2], [2], repeats=1)
    one_pass = [
        f"{kind}{i}" for i in range(len(dense.layers)) for kind in ("qkv", "o", "gate_up", "down")
    ] + ["lm"]
    # Form a warms up and is timed once, then form b the same.
    assert calls == [(label, n) for label in "ab" for _ in range(2) for n in one_pass]


def test_draft_limits_refuses_bad_options(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(_path.parent))
    draft_limits = importlib.import_module("draft_limits")
    not_a_summary = tmp_path / "other.json"
    not_a_summary.write_text('{"results": []}')
    bf16 = tmp_path / "bf16.json"
    bf16.write_text('{"machine": {"dtype": "bfloat16", "matmul_gflops_best": 900.0}}')
    for argv, message in (
        (["--draft-tokens", "0"], "--draft-tokens must be at least 1, got 0"),
        (["--draft-tokens", "4,x"], "comma-separated integers, got '4,x'"),
        (["--baseline", str(tmp_path / "missing.json")], "cannot read"),
        (["--baseline", str(not_a_summary)], "is not a throughput.py JSON summary"),
        (["--baseline", str(bf16)], "must be a float32 run"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            draft_limits.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def _load_benchmark(name: str):
    import sys

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))  # step_profile imports limits as the benchmarks do
    try:
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", bench / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
    return module


def test_a_step_profile_sums_each_phase_over_the_workers() -> None:
    """Two workers' cycles (at 1e9 a second) in three phases: work and wait are the mean
    over the workers, the compiled step the busier worker's total, the GEMM rate the
    layer FLOPs over the GEMM phases' work."""
    import numpy as np

    step_profile = _load_benchmark("step_profile")
    phases = step_profile.fused_step.PHASES
    cycles = np.zeros((2, len(phases), 2), dtype=np.int64)
    qkv, gate_up, attention = (phases.index(p) for p in ("qkv", "gate_up", "attention"))
    cycles[0, qkv] = (2e9, 0)
    cycles[1, qkv] = (1e9, 1e9)
    cycles[:, gate_up] = (3e9, 0)
    cycles[0, attention] = (1e9, 0)
    kind = {"steps": 4, "tokens": 100, "seconds": 8.0, "cycles": cycles}
    summary = step_profile._summary(kind, 1e9, flops_per_token=4e9, matmul_gflops=200.0)
    assert summary["phases"]["qkv"] == {"work_s": 1.5, "wait_s": 0.5}
    assert summary["phases"]["attention"] == {"work_s": 0.5, "wait_s": 0.0}
    assert summary["compiled_step_s"] == 6.0  # the first worker: 2 + 3 + 1
    assert summary["outside_compiled_step_s"] == 2.0
    assert summary["wait_s"] == 0.5
    assert summary["layer_gemm_gflops"] == 88.9  # 100 tokens x 4 GFLOP over 4.5 s
    assert summary["layer_gemm_share_of_matmul_rate"] == 0.444


def test_a_step_profile_needs_the_fused_step(make_tiny_model: Callable[..., Path]) -> None:
    """With q/k/v biases the CPU executor runs no fused step: nothing to profile."""
    from pagedinfer.service.config import EngineConfig

    step_profile = _load_benchmark("step_profile")
    path = str(make_tiny_model("llama", attention_bias=True))
    config = EngineConfig(model=path, max_model_len=64)
    engine = step_profile.profiling_engine(config)
    assert not engine.config.enable_prefix_caching
    with pytest.raises(RuntimeError, match="gets no fused step"):
        step_profile.profile_run(engine, [[5, 6]], [2], [[7]], [1])


def test_a_step_profile_counts_the_fused_steps_of_a_toy_run(
    make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny fp32 model on no grid gets the fused step from its weights in tile layout: the
    profiled turn's prompt and decode steps are counted, and their cycles come from the
    executor's step_profile, which is cleared after the run."""
    from pagedinfer.kernels import torch_ops
    from pagedinfer.service.config import EngineConfig

    if not torch_ops.compiled_kernels():
        pytest.skip("the fused step needs the compiled kernels")
    step_profile = _load_benchmark("step_profile")
    config = EngineConfig(model=str(make_tiny_model("llama")), max_model_len=64)
    engine = step_profile.profiling_engine(config)
    executor = engine.runner.executor
    assert executor is not None and executor.fused is not None
    counted: list[dict] = []  # the raw counts each summary is made from
    summary = step_profile._summary

    def recording_summary(kind: dict, *args: object) -> dict:
        counted.append(kind)
        return summary(kind, *args)

    monkeypatch.setattr(step_profile, "_summary", recording_summary)
    result = step_profile.profile_run(engine, [[5, 6, 7], [8, 9]], [3, 2], [[7]], [2])
    assert executor.step_profile is None
    prompt, decode = result["prompt_steps"], result["decode_steps"]
    # Both prompts in one step, then one decode step with both and one with the longer.
    assert (prompt["steps"], prompt["tokens"]) == (1, 5)
    assert (decode["steps"], decode["tokens"]) == (2, 3)
    assert set(prompt["phases"]) == set(decode["phases"]) == set(step_profile.fused_step.PHASES)
    qkv = step_profile.fused_step.PHASES.index("qkv")
    assert len(counted) == 2
    for kind in counted:
        assert (kind["cycles"][:, qkv, 0] > 0).all()  # every worker ran each step's q/k/v
