"""What the model's GEMMs and decode attention cost on this machine, and the floors on
run time that follow.

Everything here times the model's own weights, and attention at its shapes, through
this machine's libraries (MKL and oneDNN, through torch), with nothing else in the
way: no norms, sampling, scheduling or engine Python around them.

- `gemm_curve` and `lm_head_seconds`: the layer GEMMs of one forward pass at a token
  count, and the LM head at a row count, through the engine's own code (the CPU
  executor's GEMMs where it serves, `kernels.cpu.gemms`, else the model's `Linear`
  modules). Replayed at a run's own passes, they give the part of that run that was
  GEMMs; the rest is everything else the engine does.
- `best_gemm_curves`: the same GEMMs in the fastest form the library offers at each
  size, whichever an engine could choose (either weight layout, either operand order,
  MKL- or oneDNN-packed weights for that batch size or for the engine's), timed from a
  dense copy of the model inside whole passes.
- `schedule_floor`: a lower bound on the GEMM time of any engine that decodes one token
  per sequence per forward pass (no speculative decoding), whatever its schedule.
- `attention_slot_seconds` and `decode_context_slots`: the least a decode token's
  attention can cost per context position and layer, in the fastest form the library
  offers over contiguous K/V (no paging, no gather), and how many such positions the
  workload's decode tokens attend to under any schedule. Their product is a floor on
  the decode attention of any engine; added to the GEMM floor it bounds the whole run
  (module doc, end).
- `best_copy_draft`, `copy_draft_passes` and `copy_draft_schedule`: for speculative
  decoding, whose passes carry several tokens of a sequence, the fewest passes any
  drafter that copies each request's own text can need, given the outputs the model
  gives (`draft_limits.py` times their GEMMs).

Why the floor holds. Request r has p_r prompt tokens and o_r output tokens. Its prompt
goes through the layers in chunks; its first output token comes from the last chunk's
pass and each later one needs a pass of its own that carries the previous token, so its
o_r - 1 decode tokens sit in distinct passes. The most decode tokens any k passes can
hold is then sum_j<=k c_j, with c_j = #{r : o_r - 1 >= j} (Gale-Ryser), and prompt
tokens add at most P = sum p_r. So the tokens per pass, sorted, are majorized by
`token_profile` = (c_1 + P, c_2, c_3, ...): every schedule spreads its tokens at least
as evenly as that profile. Likewise the LM head's rows (one per output token, each
request's in distinct passes) are majorized by `row_profile` = (e_1, e_2, ...), with
e_j = #{r : o_r >= j}.

A pass of m rows costs at least s(m): the measured time at the largest measured size
<= m, taken no larger than any measured time above it (more rows never cost less; a
measurement that breaks that is trusted at its lower value), and never less than m rows
at the best rate seen. For any concave g with g(0) = 0 and g <= s, Karamata's
inequality gives sum_j s(m_j) >= sum_j g(m_j) >= sum_j g(profile_j) for every schedule.
`schedule_floor` finds the concave g that makes the right-hand side largest (a linear
program); where s is concave it is s itself and the floor is sum_j s(profile_j).

Attention. Decode token j of request r (1 <= j < o_r) sits at position p_r + j - 1 and
attends, in every layer, to the p_r + j positions up to it, whatever pass it is in: the
workload fixes the total, `decode_context_slots`. Per position the cost falls with the
batch (fixed per-call costs are shared) until the K/V stop fitting in the caches; the
least cost seen over a grid spanning every batch a decode pass can have (1 to all the
requests, contexts up to the longest) is what every position is charged.
Prompt tokens' attention is left out (it is cheaper per position, and the floor stays a
floor without it). The run's floor is the GEMM floor plus this one: an engine runs each
layer's attention between its q/k/v and o GEMMs, each op on all cores.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linprog
from scipy.sparse import diags

from pagedinfer.kernels.cpu.gemms import (
    MKL_BATCH_HINT,
    ONEDNN_BATCH_HINT,
    MklGemm,
    OneDnnGemm,
    mkl_fp32_available,
)


def _best_time(fn, repeats: int) -> float:
    fn()  # warm: first-touch allocations, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def serving_gemms(model, executor=None) -> list[tuple]:
    """Each layer's (q/k/v, o, gate/up, down) GEMMs as the engine runs them: the CPU
    executor's where it serves (`executor.active`), else the model's `Linear` modules.
    Each is callable on x and has `add_into(out, x)`."""
    if executor is not None and executor.active:
        return [(lay.qkv, lay.o, lay.gate_up, lay.down) for lay in executor.layers]
    return [layer.linears() for layer in model.layers]


@torch.inference_mode()
def layer_gemm_seconds(model, tokens: int, repeats: int = 3, executor=None) -> float:
    """One forward pass's layer GEMMs (q/k/v, o, gate/up, down of every layer) at `tokens`
    rows, as the engine runs them (`serving_gemms`)."""
    config = model.config
    dtype = model.embed_tokens.weight.dtype
    x = torch.randn(tokens, config.hidden_size, dtype=dtype)
    residual = torch.zeros(tokens, config.hidden_size, dtype=dtype)
    attn_out = torch.randn(tokens, config.num_heads * config.head_dim, dtype=dtype)
    act = torch.randn(tokens, config.intermediate_size, dtype=dtype)

    layers = serving_gemms(model, executor)

    def run() -> None:
        for qkv, o, gate_up, down in layers:
            qkv(x)
            o.add_into(residual, attn_out)
            gate_up(x)
            down.add_into(residual, act)

    return _best_time(run, repeats)


def layer_flops_per_token(model) -> int:
    """2 x the weights of the layer GEMMs: their FLOPs for one token."""
    # A weight the CPU executor holds has its dense copy on the meta device: its shape
    # is still there.
    return 2 * sum(linear.weight.numel() for layer in model.layers for linear in layer.linears())


@torch.inference_mode()
def lm_head_seconds(
    model, rows: int, repeats: int = 3, greedy: bool = False, executor=None
) -> float:
    """The vocabulary projection of `rows` hidden states, as the engine computes it (the
    CPU executor's LM head where it serves, else the model's): their logits, or for
    greedy rows (greedy) their argmax, which the executor may pick without the logits
    (`kernels.cpu.greedy_argmax`: its time on random rows is that on the model's own
    within a few percent)."""
    hidden = torch.randn(rows, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype)
    if executor is None or not executor.active:
        return _best_time(lambda: model.compute_logits(hidden), repeats)
    if greedy and executor.argmax is not None:
        from pagedinfer.kernels.cpu import greedy_argmax

        weights = executor.argmax
        return _best_time(lambda: greedy_argmax.lm_head_argmax(hidden, weights), repeats)
    return _best_time(lambda: executor.lm_head(hidden).float(), repeats)


def gemm_curve(
    model, token_counts: Iterable[int], repeats: int = 3, executor=None
) -> dict[int, float]:
    """Layer GEMM seconds at each token count (measured once per distinct count), as the
    engine runs them (`serving_gemms`)."""
    return {m: layer_gemm_seconds(model, m, repeats, executor) for m in sorted(set(token_counts))}


def gemm_forms(
    weight: torch.Tensor, rows: int
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every way this machine's library can compute x @ weight.T for x of `rows` rows.

    weight: [out_features, in_features]. Each form returns the product as [rows, out]
    (a transposed view where the library computes its transpose). The layouts an engine
    could store are both made here, and packed weights are packed for this row count.
    """
    weight = weight.contiguous()
    weight_io = weight.t().contiguous()
    forms: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "x @ W^T": lambda x: torch.mm(x, weight.t()),
        "(W @ x^T)^T": lambda x: torch.mm(weight, x.t()).t(),
        "x @ W_io": lambda x: torch.mm(x, weight_io),
        "(W_io^T @ x^T)^T": lambda x: torch.mm(weight_io.t(), x.t()).t(),
    }
    # Packed for this row count, and for the engine's batch size: any batch runs on either.
    if weight.device.type == "cpu" and mkl_fp32_available(weight.dtype):
        for hint in sorted({rows, MKL_BATCH_HINT}):
            forms[f"MKL packed for {hint}"] = MklGemm.of(weight, None, hint)
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        for hint in sorted({rows, ONEDNN_BATCH_HINT}):
            forms[f"oneDNN packed for {hint}"] = OneDnnGemm.of(weight, None, hint)
    return forms


def _require_dense(model) -> None:
    weights = [linear.weight for layer in model.layers for linear in layer.linears()]
    if any(w.is_meta for w in (*weights, model.lm_head_weight())):
        raise ValueError(
            "the fastest forms are timed from dense weights, and this model's went to a CPU "
            "executor: time a model of its own (load_model, no executor prepared on it)"
        )


@torch.inference_mode()
def best_gemm_curves(
    model, token_counts: Iterable[int], row_counts: Iterable[int], repeats: int = 3
) -> tuple[dict[int, float], dict[int, float]]:
    """The layer GEMMs of one pass at each token count, and the LM head at each row
    count, each GEMM kind in its fastest form. `model`: with its dense weights (as
    `load_model` gives it, no CPU executor activated on it).

    Timed inside whole passes, as a forward pass runs them: q/k/v, o, gate/up and down
    of the first layer, then of the next, and so on, then the LM head, every GEMM in
    one form of `gemm_forms`. Each kind's calls are timed one by one and summed; for
    each kind (and the LM head) the least sum over forms and repeats counts. So each
    weight comes from wherever the rest of a pass left the caches, not from a cache
    kept warm by timing one kind on its own.
    """
    _require_dense(model)
    kinds = [
        [linear.weight for linear in kind]
        for kind in zip(*(layer.linears() for layer in model.layers), strict=True)
    ]
    token_counts, row_counts = set(token_counts), set(row_counts)
    layers: dict[int, float] = {}
    lm_head: dict[int, float] = {}
    for m in sorted(token_counts | row_counts):
        layers[m], lm_head[m] = _in_pass_seconds(kinds, model.lm_head_weight(), m, repeats)
    return (
        {m: t for m, t in layers.items() if m in token_counts},
        {m: t for m, t in lm_head.items() if m in row_counts},
    )


def _in_pass_seconds(
    kinds: list[list[torch.Tensor]], lm_weight: torch.Tensor, rows: int, repeats: int
) -> tuple[float, float]:
    """One pass at `rows` (`best_gemm_curves`): the layer GEMMs' least time, the sum of
    each kind's fastest form, and the LM head's in its fastest form."""
    per_layer = list(zip(*([gemm_forms(w, rows) for w in ws] for ws in kinds), strict=True))
    lm_forms = gemm_forms(lm_weight, rows)
    inputs = [torch.randn(rows, weights[0].shape[1], dtype=lm_weight.dtype) for weights in kinds]
    hidden = torch.randn(rows, lm_weight.shape[1], dtype=lm_weight.dtype)
    best = [float("inf")] * len(kinds)
    best_lm = float("inf")
    for name in lm_forms:
        for repeat in range(repeats + 1):  # the first warms up
            spent = [0.0] * len(kinds)
            for layer in per_layer:
                for k, forms in enumerate(layer):
                    start = time.perf_counter()
                    forms[name](inputs[k])
                    spent[k] += time.perf_counter() - start
            start = time.perf_counter()
            lm_forms[name](hidden)
            lm_seconds = time.perf_counter() - start
            if repeat:
                best = [min(b, t) for b, t in zip(best, spent, strict=True)]
                best_lm = min(best_lm, lm_seconds)
    return sum(best), best_lm


def decode_attention_forms(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> dict[str, Callable[[], torch.Tensor]]:
    """Every way this machine's library can compute one decode step's attention.

    query [seqs, heads, head_dim], one new token per sequence; key and value [seqs,
    kv_heads, ctx, head_dim], contiguous, every position visible (no padding, no mask).
    Each form returns [seqs, heads, head_dim].
    """
    seqs, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    # The query heads that share a KV head, as that head's query rows: K/V read once each.
    folded = query.view(seqs, kv_heads, heads // kv_heads, head_dim)

    def matmul_softmax_matmul() -> torch.Tensor:
        scores = torch.matmul(folded, key.transpose(-1, -2)).mul_(scale).softmax(dim=-1)
        return torch.matmul(scores, value).view(seqs, heads, head_dim)

    return {
        "SDPA, query heads folded per KV head": lambda: F.scaled_dot_product_attention(
            folded, key, value, scale=scale
        ).view(seqs, heads, head_dim),
        "SDPA with GQA": lambda: F.scaled_dot_product_attention(
            query.view(seqs, heads, 1, head_dim), key, value, scale=scale, enable_gqa=True
        ).view(seqs, heads, head_dim),
        "matmul, softmax, matmul": matmul_softmax_matmul,
    }


@torch.inference_mode()
def attention_slot_seconds(
    config,
    seq_counts: Iterable[int],
    context_lens: Iterable[int],
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
) -> tuple[float, tuple[int, int]]:
    """The least seconds per (decode token, context position, layer), and where it was seen.

    For each number of sequences and context length: one decode step of every layer, each
    layer with K/V of its own (as a forward pass reads them), in each form of
    `decode_attention_forms`; the fastest form counts. Returns the least cost per
    position over the grid, and the (sequences, context) it came from.
    """
    seq_counts, context_lens = sorted(set(seq_counts)), sorted(set(context_lens))
    if not seq_counts or not context_lens or min(seq_counts) < 1 or min(context_lens) < 1:
        raise ValueError(
            f"need at least one sequence count and one context length, each at least 1 "
            f"(got {seq_counts} and {context_lens})"
        )
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    best, where = float("inf"), (0, 0)
    for seqs in seq_counts:
        for ctx in context_lens:
            per_layer = [
                decode_attention_forms(
                    torch.randn(seqs, heads, head_dim, dtype=dtype),
                    torch.randn(seqs, kv_heads, ctx, head_dim, dtype=dtype),
                    torch.randn(seqs, kv_heads, ctx, head_dim, dtype=dtype),
                    head_dim**-0.5,
                )
                for _ in range(config.num_layers)
            ]
            per_slot = _fastest_of(per_layer, repeats) / (seqs * ctx * config.num_layers)
            if per_slot < best:
                best, where = per_slot, (seqs, ctx)
    return best, where


def _fastest_of(per_layer: list[dict[str, Callable[[], torch.Tensor]]], repeats: int) -> float:
    """The least time, over the forms, to run one form in every layer in turn."""
    return min(
        _best_time(lambda name=name: [forms[name]() for forms in per_layer], repeats)
        for name in per_layer[0]
    )


def decode_context_slots(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> int:
    """Context positions the decode tokens attend to in one layer, under any schedule
    (module doc): sum over requests of sum_{1 <= j < o_r} (p_r + j)."""
    _check_lengths(prompt_lens, output_lens)
    return sum(
        (o - 1) * p + (o - 1) * o // 2 for p, o in zip(prompt_lens, output_lens, strict=True)
    )


def token_profile(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> list[int]:
    """The profile that majorizes every schedule's tokens per forward pass (module doc)."""
    _check_lengths(prompt_lens, output_lens)
    longest = max(output_lens)
    profile = [sum(1 for o in output_lens if o - 1 >= j) for j in range(1, longest)]
    prompts = sum(prompt_lens)
    return [profile[0] + prompts, *profile[1:]] if profile else [prompts]


def row_profile(output_lens: Sequence[int]) -> list[int]:
    """The profile that majorizes every schedule's LM-head rows per pass (module doc)."""
    _check_lengths([1] * len(output_lens), output_lens)
    return [sum(1 for o in output_lens if o >= j) for j in range(1, max(output_lens) + 1)]


def best_copy_draft(text: Sequence[int], known: int, max_tokens: int) -> int:
    """How many of text[known:] the best draft copied from the text's own tokens gets
    kept: the longest a <= max_tokens with text[j:j + a] == text[known:known + a] for some
    j < known that follows an earlier occurrence of the last known token
    (text[j - 1] == text[known - 1]).

    text: a request's prompt and its whole output; known: how many of them the model has
    seen. A copy may run past `known` into its own tokens, as a repeating text does
    (j + a > known): those are the draft's own earlier guesses, which hold wherever the
    draft is kept. A prompt-lookup, n-gram or suffix-tree draft, and each branch of a
    tree of them, is such a copy: the tokens after an earlier occurrence of the text's
    last n >= 1 tokens. None is kept longer than the best of them all.
    """
    if not 0 < known <= len(text) or max_tokens < 0:
        raise ValueError(f"need 0 < known <= {len(text)} and max_tokens >= 0")
    limit = min(max_tokens, len(text) - known)
    last = text[known - 1]
    best = 0
    for j in range(1, known):
        if text[j - 1] != last:
            continue
        a = 0
        while a < limit and text[j + a] == text[known + a]:
            a += 1
        best = max(best, a)
        if best == limit:
            break
    return best


def copy_draft_passes(prompt: Sequence[int], output: Sequence[int], max_draft: int) -> list[int]:
    """The tokens of each decode pass of one request, in the fewest passes that any
    drafter copying the request's own text (`best_copy_draft`) can need with drafts of up
    to max_draft tokens, each pass as full as such a schedule allows. They sum to
    len(output) - 1: the first output token comes from the prompt's pass.

    A pass that knows `done` output tokens can end with any count up to done + 1 + the
    best copy's length (a shorter draft is a prefix of it); the fewest passes to the end
    follow by dynamic programming from the last token back.
    """
    _check_lengths([len(prompt)], [len(output)])
    text = [*prompt, *output]
    end = len(output)
    reach = [0] * end
    for done in range(1, end):
        room = end - done - 1  # no draft runs past the last output token
        reach[done] = done + 1 + best_copy_draft(text, len(prompt) + done, min(max_draft, room))
    fewest = [0] * (end + 1)
    for done in range(end - 1, 0, -1):
        fewest[done] = 1 + min(fewest[done + 1 : reach[done] + 1])
    passes, done = [], 1
    while done < end:
        # The furthest next count that still finishes in the fewest passes.
        step = max(n for n in range(done + 1, reach[done] + 1) if fewest[n] == fewest[done] - 1)
        passes.append(step - done)
        done = step
    return passes


def copy_draft_schedule(
    prompt_lens: Sequence[int], decode_passes: Sequence[Sequence[int]]
) -> list[tuple[int, int]]:
    """Passes (tokens, LM-head rows) of a whole workload, given each request's decode
    passes (`copy_draft_passes`): every prompt in one first pass (one row each, for its
    first output token), then the requests' decode passes side by side from the second
    pass on. Every token of a decode pass needs its logits (each verifies the draft token
    after it)."""
    if not decode_passes or len(prompt_lens) != len(decode_passes):
        raise ValueError(
            f"need one prompt length per request's passes, and at least one request "
            f"(got {len(prompt_lens)} and {len(decode_passes)})"
        )
    longest = max(len(p) for p in decode_passes)
    decode = [sum(p[j] for p in decode_passes if j < len(p)) for j in range(longest)]
    return [(sum(prompt_lens), len(prompt_lens)), *((m, m) for m in decode)]


def _check_lengths(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> None:
    if not output_lens or len(prompt_lens) != len(output_lens):
        raise ValueError(
            f"need one prompt length per output length, and at least one request "
            f"(got {len(prompt_lens)} and {len(output_lens)})"
        )
    if min(prompt_lens) < 1 or min(output_lens) < 1:
        raise ValueError("every request needs at least one prompt token and one output token")


def staircase(curve: dict[int, float], seconds_per_unit: float, upto: int) -> np.ndarray:
    """s[m] for m = 0..upto: the least a pass of m rows can cost (module doc); s[0] = 0.

    curve: measured seconds at some row counts, including 1. seconds_per_unit: the
    least one row can cost (at the best rate seen).
    """
    if 1 not in curve:
        raise ValueError("the curve must include one row per pass (m = 1)")
    measured = sorted(curve)
    # More rows never cost less: a measured time above a point caps what it may claim.
    capped, lowest = {}, float("inf")
    for m in reversed(measured):
        lowest = min(lowest, curve[m])
        capped[m] = lowest
    s = np.zeros(upto + 1)
    below = 0
    for m in range(1, upto + 1):
        while below + 1 < len(measured) and measured[below + 1] <= m:
            below += 1
        s[m] = max(capped[measured[below]], m * seconds_per_unit)
    return s


def schedule_floor(costs: np.ndarray, profile: Sequence[int]) -> float:
    """The largest sum_j g(profile_j) over concave g with g(0) = 0 and g <= costs.

    costs: s[0..M] from `staircase`, M at least the profile's largest entry. By the
    module doc this is at most the GEMM time of any schedule whose passes the profile
    majorizes.
    """
    if not profile or min(profile) < 1:
        raise ValueError("the profile needs at least one pass, each of at least one row")
    top = max(profile)
    if top >= len(costs):
        raise ValueError(f"the costs stop at {len(costs) - 1} rows; the profile needs {top}")
    n = top + 1
    if n == 2:
        return len(profile) * float(costs[1])
    weight = np.bincount(np.asarray(profile), minlength=n).astype(float)
    # Concave: g(m - 1) - 2 g(m) + g(m + 1) <= 0 for every inner m. In milliseconds, so
    # the solver's absolute tolerances are far below the figures.
    concave = diags([1.0, -2.0, 1.0], [0, 1, 2], shape=(n - 2, n))
    bounds = [(0.0, 0.0)] + [(None, 1e3 * float(costs[m])) for m in range(1, n)]
    result = linprog(-weight, A_ub=concave, b_ub=np.zeros(n - 2), bounds=bounds, method="highs")
    if result.status != 0:
        raise RuntimeError(f"the floor's linear program failed: {result.message}")
    return -result.fun / 1e3
