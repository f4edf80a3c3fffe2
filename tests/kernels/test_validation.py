"""Bad input raises ValueError naming the argument, before any kernel runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedinfer.kernels import paged_attention, write_kv


def good_attention_args() -> dict[str, Any]:
    cache = torch.zeros(4, 16, 2, 64)
    return {
        "query": torch.zeros(5, 6, 64),
        "k_cache": cache,
        "v_cache": cache.clone(),
        "block_tables": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        "seq_lens": torch.tensor([20, 4], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 1, 5], dtype=torch.int32),
        "scale": 0.125,
    }


def good_write_args() -> dict[str, Any]:
    cache = torch.zeros(4, 16, 2, 64)
    return {
        "key": torch.zeros(3, 2, 64),
        "value": torch.zeros(3, 2, 64),
        "k_cache": cache,
        "v_cache": cache.clone(),
        "slot_mapping": torch.tensor([0, -1, 63]),
    }


ATTENTION_CASES: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("query", lambda a: a.update(query=torch.zeros(5, 6))),
    ("query", lambda a: a.update(query=torch.zeros(5, 5, 64))),  # 5 heads over 2 KV heads
    ("query", lambda a: a.update(query=torch.zeros(5, 6, 32))),
    ("query", lambda a: a.update(query=torch.zeros(5, 6, 64, dtype=torch.float16))),
    ("query", lambda a: a.update(query=torch.zeros(5, 6, 64, dtype=torch.int32))),
    ("k_cache", lambda a: a.update(k_cache=torch.zeros(4, 16, 2))),
    ("v_cache", lambda a: a.update(v_cache=torch.zeros(4, 16, 2, 32))),
    ("v_cache", lambda a: a.update(v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float16))),
    ("block_tables", lambda a: a.update(block_tables=torch.zeros(3, 2, dtype=torch.int32))),
    ("block_tables", lambda a: a.update(block_tables=torch.zeros(2, 2))),
    ("block_tables", lambda a: a.update(block_tables=torch.tensor([[0], [2]], dtype=torch.int32))),
    (
        "block_tables",
        lambda a: a.update(block_tables=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32)),
    ),
    (
        "block_tables",
        lambda a: a.update(block_tables=torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)),
    ),
    ("seq_lens", lambda a: a.update(seq_lens=torch.tensor([20, 3], dtype=torch.int32))),
    ("seq_lens", lambda a: a.update(seq_lens=torch.tensor([20, -1], dtype=torch.int32))),
    ("seq_lens", lambda a: a.update(seq_lens=torch.tensor([[20, 4]], dtype=torch.int32))),
    (
        "query_start_loc",
        lambda a: a.update(query_start_loc=torch.tensor([0, 5], dtype=torch.int32)),
    ),
    (
        "query_start_loc",
        lambda a: a.update(query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32)),
    ),
    (
        "query_start_loc",
        lambda a: a.update(query_start_loc=torch.tensor([1, 1, 5], dtype=torch.int32)),
    ),
    (
        "query_start_loc",
        lambda a: a.update(query_start_loc=torch.tensor([0, 6, 5], dtype=torch.int32)),
    ),
    ("scale", lambda a: a.update(scale=torch.tensor(0.125))),
    ("out", lambda a: a.update(out=torch.zeros(5, 6, 32))),
    ("out", lambda a: a.update(out=torch.zeros(5, 6, 64, dtype=torch.float64))),
    ("out", lambda a: a.update(out="buffer")),
]


@pytest.mark.parametrize(("name", "break_it"), ATTENTION_CASES)
def test_paged_attention_names_the_bad_argument(name: str, break_it: Callable) -> None:
    args = good_attention_args()
    break_it(args)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        paged_attention(**args)


def test_good_attention_arguments_pass() -> None:
    out = paged_attention(**good_attention_args())
    assert out.shape == (5, 6, 64) and not out.isnan().any()


WRITE_CASES: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("key", lambda a: a.update(key=torch.zeros(3, 3, 64))),
    ("key", lambda a: a.update(key=torch.zeros(3, 2, 64, dtype=torch.float16))),
    ("value", lambda a: a.update(value=torch.zeros(2, 2, 64))),
    ("slot_mapping", lambda a: a.update(slot_mapping=torch.tensor([0, 1]))),
    ("slot_mapping", lambda a: a.update(slot_mapping=torch.tensor([0.0, 1.0, 2.0]))),
    ("slot_mapping", lambda a: a.update(slot_mapping=torch.tensor([0, 1, 64]))),
    ("slot_mapping", lambda a: a.update(slot_mapping=torch.tensor([0, -2, 5]))),
    ("k_cache", lambda a: a.update(k_cache=torch.zeros(4, 16, 128))),
    ("v_cache", lambda a: a.update(v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float16))),
]


@pytest.mark.parametrize(("name", "break_it"), WRITE_CASES)
def test_write_kv_names_the_bad_argument(name: str, break_it: Callable) -> None:
    args = good_write_args()
    break_it(args)
    with pytest.raises(ValueError, match=rf"^{name}:"):
        write_kv(**args)
    if name != "k_cache" and name != "v_cache":
        assert not args["k_cache"].any(), "nothing may be written before the checks pass"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_device_mismatch_names_the_argument() -> None:
    args = good_attention_args()
    args["query"] = args["query"].cuda()
    with pytest.raises(ValueError, match=r"^query:"):
        paged_attention(**args)
