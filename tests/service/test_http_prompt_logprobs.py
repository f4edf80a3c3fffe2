"""The engine side of the HTTP API's `echo` with logprobs: `SamplingParams.prompt_logprobs`
scores every prompt token after the first with what the model predicted there, through
chunked prefill, past the prefix cache, and the same after a preemption."""

from __future__ import annotations

import pytest

from pagedinfer.service import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable "
    "type changed how books were made, how ideas travelled and who could read them. "
)


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """A prompt's token ids and transformers' log_softmax of its logits."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    ids = tokenizer.encode(TEXT * 3, add_special_tokens=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32
    )
    with torch.inference_mode():
        logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return ids, logprobs


def check_against(reference, prompt_logprobs: list[dict], k: int) -> None:
    import torch

    ids, logprobs = reference
    assert [e["token_id"] for e in prompt_logprobs] == ids[1:]
    expected = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor([e["logprob"] for e in prompt_logprobs])
    assert torch.allclose(got, expected, atol=2e-3)
    best = logprobs[:-1].topk(k, dim=-1)
    for entry, values, indices in zip(prompt_logprobs, best.values, best.indices, strict=False):
        top_ids = [t for t, _ in entry["top"]]
        assert len(top_ids) == k
        assert top_ids[0] == indices[0].item()  # the likeliest token, first
        assert entry["top"][0][1] == pytest.approx(values[0].item(), abs=2e-3)


@pytest.mark.timeout(600)
def test_prompt_logprobs_match_transformers_through_chunks_cache_and_preemption(reference):
    ids, _ = reference
    # 32-token steps prefill the prompt in chunks; 20 blocks cannot hold four of these
    # requests at once, so some are preempted and compute their prompts again.
    llm = LLM(
        max_model_len=256, max_num_batched_tokens=32, num_gpu_blocks=20, gguf_activations="fp32"
    )
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=2)
    (alone,) = llm.generate([ids], params)
    check_against(reference, alone.prompt_logprobs, 2)
    (again,) = llm.generate([ids], params)  # its blocks are cached now, but not read
    assert again.cached_tokens == 0
    assert again.prompt_logprobs == alone.prompt_logprobs
    crowd = llm.generate([ids] * 4, params)
    assert llm.engine.stats().num_preemptions > 0
    for out in crowd:
        assert [e["token_id"] for e in out.prompt_logprobs] == ids[1:]
        check_against(reference, out.prompt_logprobs, 2)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    plain = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0))
    assert plain[0].prompt_logprobs is None
