"""Batched sampling: one row of logits per sequence in, one token per sequence out.

Per row, in this order (vLLM's): repetition, frequency and presence penalties on the
logits; temperature; top-k; top-p; min-p; then one draw. Greedy rows (temperature 0)
take the argmax of the penalised logits and ignore the rest.

Logprobs follow vLLM's convention: they are those of the raw model distribution, the
log_softmax of the logits as they came in, before penalties and temperature. They say
what the model predicted, not what the sampling parameters made of it.

Draws use the exponential race: argmax(p / E) with E ~ Exp(1) per token picks token i
with probability p_i. A seeded row draws its E from its own generator, exactly one
vocabulary-sized draw per sampled token, so its tokens do not depend on what else is
in the batch; unseeded rows share one batched draw from the global RNG.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedinfer.service.sampling_params import SamplingParams

# Below this temperature a row is greedy: dividing by it would only overflow (vLLM's choice).
GREEDY_TEMPERATURE = 1e-5


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


class Sampler:
    """Picks the next token of every row of a logits batch, each with its own parameters."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampleResult]:
        """logits: [len(rows), vocab] float32. Returns one result per row, in order."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}"
            )
        params = [row.params for row in rows]
        if all(is_greedy(p) and not has_penalties(p) for p in params):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample(logits, rows)
        return _build_results(logits, token_ids, params)

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        params = [row.params for row in rows]
        logits = logits.clone()  # the raw logits stay intact for the logprobs
        penalised = [i for i, p in enumerate(params) if has_penalties(p)]
        if penalised:
            apply_penalties(logits, rows, penalised)
        token_ids = logits.argmax(dim=-1)

        random_rows = [i for i, p in enumerate(params) if not is_greedy(p)]
        if not random_rows:
            return token_ids
        if len(random_rows) == len(rows):
            subset = logits
        else:
            index = torch.tensor(random_rows, device=logits.device)
            subset = logits.index_select(0, index)
        chosen = [params[i] for i in random_rows]
        probs = _processed_probs(subset, chosen)
        noise = _exponential_noise(probs, [rows[i].generator for i in random_rows])
        sampled = probs.div_(noise).argmax(dim=-1)
        if len(random_rows) == len(rows):
            return sampled
        token_ids[index] = sampled
        return token_ids


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[SamplingRow], penalised: list[int]
) -> None:
    """Applies the three penalties, in place, to the rows `penalised` of `logits`.

    repetition (HF/CTRL): over prompt and output tokens, divide a positive logit by r
    and multiply a negative one by r. frequency and presence (OpenAI): over output
    tokens, subtract frequency * count + presence * (count > 0).
    """
    device, vocab = logits.device, logits.shape[1]
    params = [rows[i].params for i in penalised]
    outputs = [rows[i].output_token_ids for i in penalised]
    counts = _token_counts(outputs, vocab, device)

    index = torch.tensor(penalised, device=device)
    x = logits.index_select(0, index)
    if any(p.repetition_penalty != 1.0 for p in params):
        # Rows whose penalty is 1 are left unchanged by the formula: skip their prompts.
        prompts = [
            rows[i].prompt_token_ids if p.repetition_penalty != 1.0 else ()
            for i, p in zip(penalised, params, strict=True)
        ]
        seen = (_token_counts(prompts, vocab, device) > 0) | (counts > 0)
        r = _column(torch.tensor([p.repetition_penalty for p in params]), device)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    frequency = _column(torch.tensor([p.frequency_penalty for p in params]), device)
    presence = _column(torch.tensor([p.presence_penalty for p in params]), device)
    x = x - frequency * counts - presence * (counts > 0).float()
    logits[index] = x


def _token_counts(
    token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token occurs in each list."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    lengths = torch.tensor([len(t) for t in token_lists])
    if int(lengths.sum()) == 0:
        return counts
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), device=device)
    row_of = torch.repeat_interleave(torch.arange(len(token_lists)), lengths).to(device)
    counts.index_put_(
        (row_of, tokens), torch.ones_like(tokens, dtype=counts.dtype), accumulate=True
    )
    return counts


def _processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p; returns (unnormalised) probabilities."""
    device, vocab = logits.device, logits.shape[1]
    temperature = _column(torch.tensor([p.temperature for p in params]), device)
    logits = logits / temperature

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, torch.tensor(top_k, device=device), top_p)

    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = _column(torch.tensor([p.min_p for p in params]), device)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p
        probs.masked_fill_(probs < threshold, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Masks to -inf what top-k and then top-p remove; both work in one sorted order."""
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    ordered.masked_fill_(rank >= top_k.unsqueeze(1), float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = ordered.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the most likely tokens until their mass reaches top_p (always the first).
        drop = mass_before >= _column(torch.tensor(top_p), logits.device)
        drop[:, 0] = False
        ordered.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def _exponential_noise(
    probs: torch.Tensor, generators: list[torch.Generator | None]
) -> torch.Tensor:
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()
    vocab = probs.shape[1]
    for i, generator in enumerate(generators):
        if generator is not None:
            # Drawn on the generator's device (a CPU generator may serve a CUDA batch).
            row = torch.empty(vocab, device=generator.device).exponential_(generator=generator)
            noise[i] = row
    # Exp(1) can return exactly 0; p / 0 would win whatever p is, even a filtered token.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _build_results(
    logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> list[SampleResult]:
    tokens = token_ids.tolist()
    logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    chosen: dict[int, float] = {}
    top: dict[int, list[tuple[int, float]]] = {}
    if logprob_rows:
        index = torch.tensor(logprob_rows, device=logits.device)
        raw = torch.log_softmax(logits.index_select(0, index), dim=-1)
        picked = raw.gather(1, token_ids.index_select(0, index).unsqueeze(1)).squeeze(1)
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


def _column(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    return values.to(device=device, dtype=torch.float32).unsqueeze(1)
