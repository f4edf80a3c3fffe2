"""The model runner's step inputs: a SchedulerOutput as the flat tensors the model takes."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.service.model_runner import ModelRunner
from pagedinfer.service.request import Request
from pagedinfer.service.sampling_params import SamplingParams
from pagedinfer.service.scheduler import ScheduledRequest, SchedulerOutput

BLOCK = 4


def runner() -> ModelRunner:
    """A runner with no model: `_prepare` reads only the block size and the device."""
    runner = object.__new__(ModelRunner)
    runner.block_size, runner.device = BLOCK, torch.device("cpu")
    return runner


def request(
    tokens: list[int],
    computed: int,
    blocks: list[int],
    params: SamplingParams | None = None,
    output: int = 0,
) -> Request:
    """A request with `tokens` as prompt (the last `output` of them sampled) and blocks."""
    req = Request(f"r{tokens[0]}", tokens[: len(tokens) - output], params or SamplingParams())
    for token in tokens[len(tokens) - output :]:
        req.append_output_token(token)
    req.num_computed_tokens, req.block_table = computed, blocks
    return req


def test_a_mixed_step_gives_each_token_its_position_slot_and_sequence() -> None:
    """A prompt chunk that does not reach its end, a decode, and a decode with a 2-token
    draft: token ids, positions, slots (block_table[p // B] * B + p % B), the sequences'
    lengths and starts, and one logits row per sampled position."""
    chunk = request(list(range(100, 110)), 3, [7, 2, 9])  # computes 3..8 of 10 tokens
    decode = request([200, 201, 202, 203, 204], 4, [5, 1], output=1)
    drafted = request([300, 301, 302], 2, [4, 6], SamplingParams(temperature=0.0), output=1)
    out = SchedulerOutput(
        scheduled=[
            ScheduledRequest(chunk, 6),
            ScheduledRequest(decode, 1),
            ScheduledRequest(drafted, 3, [303, 304]),
        ]
    )
    inputs = runner()._prepare(out)
    assert inputs.input_ids.tolist() == [103, 104, 105, 106, 107, 108, 204, 302, 303, 304]
    assert inputs.positions.tolist() == [3, 4, 5, 6, 7, 8, 4, 2, 3, 4]
    tables = [[7, 2, 9], [5, 1], [4, 6]]
    seqs = [0] * 6 + [1] + [2] * 3
    expected = [
        tables[s][p // BLOCK] * BLOCK + p % BLOCK
        for s, p in zip(seqs, inputs.positions.tolist(), strict=True)
    ]
    assert inputs.attn.slot_mapping.tolist() == expected
    assert inputs.attn.slot_mapping.dtype == torch.int64
    assert inputs.attn.block_tables.tolist() == [[7, 2, 9], [5, 1, 0], [4, 6, 0]]
    assert inputs.attn.seq_lens.tolist() == [9, 5, 5]
    assert inputs.attn.query_start_loc.tolist() == [0, 6, 7, 10]
    assert inputs.logits_indices.tolist() == [6, 7, 8, 9]
    assert inputs.sample_requests == [decode, drafted]
    assert inputs.num_rows == [1, 3]
    assert inputs.greedy.tolist() == [False, True, True, True]


def test_a_step_past_a_requests_blocks_is_refused() -> None:
    short = request([1, 2, 3, 4, 5], 4, [3], output=1)  # position 4 needs a second block
    with pytest.raises(ValueError, match="5 tokens need more than its 1 KV blocks"):
        runner()._prepare(SchedulerOutput(scheduled=[ScheduledRequest(short, 1)]))
