"""Batched sampling: one row of logits per sequence in, one token per sequence out.

Per row, in this order (vLLM's): logit_bias and the min_tokens mask (EOS and stop
tokens cannot be picked before min_tokens); repetition, frequency and presence penalties
on the logits; temperature; top-k; top-p; min-p; then one draw. Greedy rows
(temperature 0) take the argmax of the processed logits and ignore the rest.

Logprobs follow vLLM's convention: they are those of the raw model distribution, the
log_softmax of the logits as they came in, before penalties and temperature. They say
what the model predicted, not what the sampling parameters made of it.

Draws invert the cumulative distribution with one uniform number per row. A seeded
row takes its number from its own generator, exactly one per sampled token, so its
tokens do not depend on what else is in the batch; unseeded rows share one batched
draw from the global RNG.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedinfer.service.sampling_params import SamplingParams

# Below this temperature a row is greedy: dividing by it would only overflow (vLLM's choice).
GREEDY_TEMPERATURE = 1e-5
# How many of the most likely tokens top-k / top-p look at before sorting a whole row.
CANDIDATES = 256


@dataclass
class SamplingRow:
    """What the sampler needs to know about the sequence behind one row of logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far, for the penalties
    generator: torch.Generator | None  # from make_generator; None: the global RNG


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # of the chosen token, when params.logprobs is not None
    top_logprobs: list[tuple[int, float]] | None  # the k most likely (token, logprob)


def make_generator(
    seed: int | None, index: int, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The generator of sample `index` of a request with `seed`; None when unseeded.

    Different indices give independent streams, so the n samples of one seeded request
    differ from each other and each is reproducible on its own.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(_splitmix64(seed * 0x9E3779B97F4A7C15 + index))
    return generator


def _splitmix64(x: int) -> int:
    mask = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def has_logits_processors(params: SamplingParams, num_output_tokens: int = 0) -> bool:
    """Whether logit_bias or min_tokens change the logits of a row that follows this
    many output tokens (the min_tokens mask only applies until they are out)."""
    return bool(params.logit_bias) or num_output_tokens < params.min_tokens


def argmax_only(params: SamplingParams, num_output_tokens: int = 0) -> bool:
    """Whether a row sampled with these parameters, after this many output tokens, needs
    only the argmax of its logits."""
    return (
        is_greedy(params)
        and not has_penalties(params)
        and not has_logits_processors(params, num_output_tokens)
        and params.logprobs is None
        and not params.use_beam_search  # beams rank every token's logprob
    )


def _processed(row: SamplingRow) -> bool:
    """Whether logit_bias or the min_tokens mask changes this row's logits."""
    return has_logits_processors(row.params, len(row.output_token_ids))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of logits [rows, vocab] (the first, on ties; NaN counts as
    the largest), int64 [rows]. On CPU through numpy: its vectorised argmax took 0.25 ms
    for 32 rows of SmolLM2's 49,152 logits, torch's 3 ms."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


# Rows sampled at a time: the copies of the logits that penalties, top-k/top-p and
# logprobs make (`memory.LOGITS_COPIES` of them) stay this many rows large, whatever the
# batch.
SAMPLE_CHUNK_ROWS = 32


class Sampler:
    """Picks the next token of every row of a logits batch, each with its own parameters.

    eos_token_ids: the model's end tokens, which min_tokens keeps from being picked
    (unless a request ignores EOS).
    """

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        self.eos_token_ids = sorted(set(eos_token_ids))

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        tokens: torch.Tensor | None = None,
    ) -> list[SampleResult]:
        """logits: [len(rows), vocab] float32. tokens: None, or int64 [len(rows)] with the
        argmax of rows that need only it (`argmax_only`), their logits rows unwritten, and
        -1 for the others. Returns one result per row, in order."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}"
            )
        if tokens is not None and tokens.shape != (len(rows),):
            raise ValueError(f"tokens must be [{len(rows)}], got {tuple(tokens.shape)}")
        if len(rows) > SAMPLE_CHUNK_ROWS:
            results: list[SampleResult] = []
            for start in range(0, len(rows), SAMPLE_CHUNK_ROWS):
                end = start + SAMPLE_CHUNK_ROWS
                chunk_tokens = None if tokens is None else tokens[start:end]
                results.extend(self(logits[start:end], rows[start:end], chunk_tokens))
            return results
        params = [row.params for row in rows]
        picked = None if tokens is None else tokens >= 0
        given = [] if picked is None else picked.tolist()
        if not all(
            argmax_only(row.params, len(row.output_token_ids))
            for row, g in zip(rows, given, strict=False)
            if g
        ):
            raise ValueError("tokens: a row that needs its logits was given a token")
        if given and all(given):
            token_ids = tokens
        elif all(is_greedy(p) and not has_penalties(p) for p in params) and not any(
            _processed(row) for row in rows
        ):
            token_ids = greedy_tokens(logits)
        else:
            token_ids = self._sample(logits, rows)
        if picked is not None and token_ids is not tokens:
            token_ids = torch.where(picked, tokens, token_ids)
        return _build_results(logits, token_ids, params)

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        params = [row.params for row in rows]
        penalised = [i for i, p in enumerate(params) if has_penalties(p)]
        processed = [i for i, row in enumerate(rows) if _processed(row)]
        if penalised or processed:
            # A contiguous copy: the raw logits stay intact for the logprobs.
            logits = logits.clone(memory_format=torch.contiguous_format)
        if processed:
            apply_logits_processors(logits, rows, processed, self.eos_token_ids)
        if penalised:
            apply_penalties(logits, rows, penalised)
        random_rows = [i for i, p in enumerate(params) if not is_greedy(p)]
        if len(random_rows) == len(rows):
            probs = processed_probs(logits, params)
            return _draw(probs, [row.generator for row in rows])

        token_ids = greedy_tokens(logits)
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            probs = processed_probs(logits[index], [params[i] for i in random_rows])
            token_ids[index] = _draw(probs, [rows[i].generator for i in random_rows])
        return token_ids


def apply_logits_processors(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    processed: Sequence[int],
    eos_token_ids: Sequence[int],
) -> None:
    """Adds each row's logit_bias and, while a row has fewer than min_tokens outputs,
    sets the logits of its stop tokens (EOS unless ignored, and stop_token_ids) to -inf.
    In place, on the rows `processed` of `logits`; ids beyond the vocabulary are skipped."""
    vocab = logits.shape[1]
    rows_at: list[int] = []
    tokens: list[int] = []
    biases: list[float] = []
    masked: list[int] = []
    for i in processed:
        row, params = rows[i], rows[i].params
        for token, bias in params.logit_bias.items():
            if token < vocab:
                rows_at.append(i)
                tokens.append(token)
                biases.append(bias)
        if len(row.output_token_ids) < params.min_tokens:
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops.update(eos_token_ids)
            masked.extend(i * vocab + t for t in sorted(stops) if t < vocab)
    flat = logits.view(-1)
    if tokens:
        positions = torch.tensor(rows_at, dtype=torch.int64) * vocab + torch.tensor(tokens)
        flat.index_add_(
            0,
            positions.to(logits.device),
            torch.tensor(biases, dtype=logits.dtype, device=logits.device),
        )
    if masked:
        flat.index_fill_(0, torch.tensor(masked, device=logits.device), float("-inf"))


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[SamplingRow], penalised: Sequence[int]
) -> None:
    """Applies the three penalties, in place, to the rows `penalised` of `logits`.

    repetition (HF/CTRL): over prompt and output tokens, divide a positive logit by r
    and multiply a negative one by r. frequency and presence (OpenAI): over output
    tokens, subtract frequency * count + presence * (count > 0). Only the logits of
    tokens that occurred are touched, so the cost follows the token counts, not the
    vocabulary.
    """
    device, (num_rows, vocab) = logits.device, logits.shape
    flat = logits.view(-1)  # logits is a fresh contiguous tensor, owned by the caller
    params = [rows[i].params for i in penalised]
    outputs = _flat_positions([rows[i].output_token_ids for i in penalised], penalised, vocab)

    def per_position(values: list[float], positions: torch.Tensor) -> torch.Tensor:
        by_row = torch.zeros(num_rows)
        by_row[penalised] = torch.tensor(values)
        return by_row.index_select(0, positions // vocab).to(device)

    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        # Rows whose penalty is 1 are left unchanged by the formula: skip their prompts.
        prompts = [
            rows[i].prompt_token_ids if r != 1.0 else ()
            for i, r in zip(penalised, repetition, strict=True)
        ]
        seen = torch.cat([_flat_positions(prompts, penalised, vocab), outputs]).unique()
        r = per_position(repetition, seen)
        seen = seen.to(device)
        values = flat.index_select(0, seen)
        flat.index_copy_(0, seen, torch.where(values > 0, values / r, values * r))
    if outputs.numel() == 0:
        return
    frequency = [p.frequency_penalty for p in params]
    if any(f != 0.0 for f in frequency):
        flat.index_add_(0, outputs.to(device), -per_position(frequency, outputs))
    presence = [p.presence_penalty for p in params]
    if any(p != 0.0 for p in presence):
        once = outputs.unique()
        flat.index_add_(0, once.to(device), -per_position(presence, once))


def _flat_positions(
    token_lists: Sequence[Sequence[int]], row_ids: Sequence[int], vocab: int
) -> torch.Tensor:
    """CPU int64 positions row * vocab + token of every token of every list."""
    parts = [
        torch.tensor(tokens, dtype=torch.int64) + row * vocab
        for row, tokens in zip(row_ids, token_lists, strict=True)
        if len(tokens)
    ]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution random rows draw from: temperature, then top-k, top-p and
    min-p, as unnormalised probabilities (filtered tokens are 0).

    Each filter keeps the tokens whose probability reaches a per-row threshold (ties
    at the threshold stay, as in vLLM), so the three combine into one threshold and
    one pass over the vocabulary.
    """
    device = logits.device
    temperature = _column([p.temperature for p in params], device)
    scaled = logits / temperature
    # An extreme penalty or temperature (say repetition_penalty 1e-38) overflows a logit
    # to inf, and a softmax over several infs is NaN: keep every logit finite so the
    # distribution stays defined (the largest logits stay the likeliest).
    finfo = torch.finfo(scaled.dtype)
    probs = scaled.clamp_(finfo.min, finfo.max).softmax(dim=-1)
    threshold = _top_k_top_p_threshold(probs, params)
    if any(p.min_p > 0.0 for p in params):
        # Relative to the most likely token, so renormalising after top-k/top-p is moot.
        min_p = probs.amax(dim=-1, keepdim=True) * _column([p.min_p for p in params], device)
        threshold = min_p if threshold is None else torch.maximum(threshold, min_p)
    if threshold is not None:
        probs.masked_fill_(probs < threshold, 0.0)
    return probs


def _top_k_top_p_threshold(
    probs: torch.Tensor, params: list[SamplingParams]
) -> torch.Tensor | None:
    """[rows, 1] the smallest probability that top-k and top-p keep; None if neither is on.

    Sorting the whole vocabulary is slow on CPU, so the cut is looked for among the
    most likely CANDIDATES tokens first; rows whose cut lies beyond them (a flat
    distribution with a large top_p) look again among 16 times more, up to all.
    """
    vocab = probs.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return None
    k_tensor = torch.tensor(top_k, device=probs.device).unsqueeze(1)
    p_tensor = _column(top_p, probs.device)
    width = min(vocab, max([CANDIDATES, *(k for k in top_k if k < vocab)]))
    threshold, covered = _cut(probs, k_tensor, p_tensor, width)
    while not bool(covered.all()):
        width = min(vocab, width * 16)
        rest = (~covered).nonzero().squeeze(1)
        threshold[rest], covered[rest] = _cut(probs[rest], k_tensor[rest], p_tensor[rest], width)
    return threshold


def _cut(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Threshold among the `width` most likely tokens, and whether that was enough."""
    ordered = probs.topk(width, dim=-1, sorted=True).values
    rank = torch.arange(width, device=probs.device)
    inside = top_k <= width  # [rows, 1]: top-k cuts among the candidates
    ordered = ordered.masked_fill(rank >= top_k, 0.0)  # top-k first
    mass = ordered.cumsum(dim=-1)
    # top-p applies to what top-k keeps: all of it lies among the candidates when
    # top-k cuts there; otherwise it is the whole (softmax-normalised) distribution.
    total = torch.where(inside, mass[:, -1:], torch.ones_like(top_p))
    # Keep tokens while the mass before them is below top_p; the first always stays.
    kept = ((mass - ordered) < top_p * total) & (ordered > 0)
    last = (kept.sum(dim=-1, keepdim=True) - 1).clamp_min_(0)
    threshold = ordered.gather(1, last)
    covered = (inside | (mass[:, -1:] >= top_p * total)).squeeze(1)
    return threshold, covered


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row, token i with probability probs[i] / sum(probs) (inverse CDF).

    One uniform number per row: a seeded row takes it from its own generator, and as
    the cumulative sum of a row depends only on that row, its token does not depend
    on the rest of the batch.
    """
    rows = probs.shape[0]
    uniform = torch.rand(rows, 1, device=probs.device) if None in generators else None
    if uniform is None:
        uniform = torch.empty(rows, 1, device=probs.device)
    for i, generator in enumerate(generators):
        if generator is not None:
            uniform[i] = torch.rand(1, generator=generator, device=generator.device)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the first cdf entry above it always exists, and its
    # token has a probability above zero.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _build_results(
    logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> list[SampleResult]:
    tokens = token_ids.tolist()
    logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    chosen: dict[int, float] = {}
    top: dict[int, list[tuple[int, float]]] = {}
    if logprob_rows:
        index = torch.tensor(logprob_rows, device=logits.device)
        raw = torch.log_softmax(
            logits if len(logprob_rows) == len(params) else logits[index], dim=-1
        )
        picked = raw.gather(1, token_ids[index].unsqueeze(1)).squeeze(1)
        chosen = dict(zip(logprob_rows, picked.tolist(), strict=True))
        k_max = max(params[i].logprobs or 0 for i in logprob_rows)
        if k_max > 0:
            values, ids = raw.topk(k_max, dim=-1)
            values, ids = values.tolist(), ids.tolist()
            for j, i in enumerate(logprob_rows):
                k = params[i].logprobs or 0
                top[i] = list(zip(ids[j][:k], values[j][:k], strict=True))
    results = []
    for i, token in enumerate(tokens):
        if i in chosen:
            results.append(SampleResult(token, chosen[i], top.get(i, [])))
        else:
            results.append(SampleResult(token, None, None))
    return results


def prompt_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list[dict[str, Any]]:
    """The logprob entries of prompt tokens: row i of logits [len(token_ids), vocab] is
    what the model predicted for token_ids[i]. As for sampled tokens, the raw
    log_softmax, with the token's rank (1 = the likeliest) and the k most likely tokens
    (`{"token_id", "logprob", "rank", "top"}`)."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=raw.device)
    picked = raw.gather(1, ids.unsqueeze(1))
    ranks = ((raw > picked).sum(dim=-1) + 1).tolist()
    chosen = picked.squeeze(1).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if k > 0:
        values, indices = raw.topk(k, dim=-1)
        pairs = zip(indices.tolist(), values.tolist(), strict=True)
        top = [list(zip(i, v, strict=True)) for i, v in pairs]
    return [
        {"token_id": t, "logprob": lp, "rank": rank, "top": entries}
        for t, lp, rank, entries in zip(token_ids, chosen, ranks, top, strict=True)
    ]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
