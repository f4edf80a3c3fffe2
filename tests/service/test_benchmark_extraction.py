"""The extraction workload: real requests whose answers repeat their passage, enough of
them, varied, and each within the benchmark's max_model_len under the chat template."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmarks import their siblings as scripts do

from workloads.chat import load_chat_prompts  # noqa: E402
from workloads.extraction import EXTRACTION_PROMPTS, extraction_workload  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def test_at_least_30_distinct_prompts_each_with_a_passage_to_work_from():
    prompts = load_chat_prompts(EXTRACTION_PROMPTS)
    assert len(prompts) >= 30
    texts = [p["messages"][-1]["content"] for p in prompts]
    assert len(set(texts)) == len(texts), "a prompt is repeated"
    assert all(len(text) >= 300 for text in texts), "a prompt without a real passage"
    kinds = {p["task"].split("-")[0] for p in prompts}
    assert {"extract", "fix", "code"} <= kinds and len(kinds) >= 8


def test_prompts_render_to_a_few_hundred_tokens_within_max_model_len(tokenizer):
    ids, lens = extraction_workload(tokenizer, max_len=512)
    assert len(ids) == len(lens) == len(load_chat_prompts(EXTRACTION_PROMPTS))
    assert sum(map(len, ids)) / len(ids) >= 150
    reply = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert all(prompt[-len(reply) :] == reply for prompt in ids)
    assert extraction_workload(tokenizer, n=3)[1] == lens[:3]
