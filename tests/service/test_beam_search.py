"""Beam search (`use_beam_search`) over copy-on-write forks: the same hypotheses as
transformers' `generate(num_beams=...)` in fp32, beams that share their prefix blocks and
free a pruned beam's blocks at once, nothing left behind after the request or an abort,
and the HTTP and gRPC fields with their bad input."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch

from pagedinfer.service import LLM, SamplingParams
from pagedinfer.service.beam_search import BeamSearch
from pagedinfer.service.request import RequestStatus

PROMPTS = [
    [1, 504, 3458, 282, 4649, 314],
    [1, 1530, 21872, 13821, 28, 6154, 45, 2030, 278, 253, 1837, 2545, 2203, 28, 665],
    [7, 99, 1000, 2000, 3000],
]
# A prompt of several full blocks (16 tokens each) for the block counts.
LONG_PROMPT = [(37 * i + 11) % 40000 + 100 for i in range(45)]


@pytest.fixture(scope="module")
def tiny(make_tiny_model):
    env = pytest.MonkeyPatch()
    env.setenv("PAGEDINFER_CPU_KERNELS", "torch")  # the model's own forward: nothing compiles
    yield str(make_tiny_model("llama"))
    env.undo()


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(tiny, dtype="float32", max_model_len=256, num_gpu_blocks=128)


@pytest.fixture(scope="module")
def hf(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()

    def generate(prompt: list[int], params: SamplingParams, stops: list[int]) -> dict:
        """transformers' beam search with the same settings: its n best token lists
        (each up to and including its stop token) and their scores."""
        kwargs: dict[str, Any] = {}
        if params.logit_bias:
            kwargs["sequence_bias"] = {(t,): b for t, b in params.logit_bias.items()}
        if params.min_tokens:
            kwargs["min_new_tokens"] = params.min_tokens
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=params.max_tokens,
                do_sample=False,
                num_beams=params.beam_width,
                num_return_sequences=params.n,
                length_penalty=params.length_penalty,
                early_stopping=params.early_stopping,
                eos_token_id=stops or None,
                pad_token_id=stops[0] if stops else 0,
                output_scores=True,
                return_dict_in_generate=True,
                **kwargs,
            )
        outputs = []
        for row in out.sequences[:, len(prompt) :].tolist():
            ends = [i for i, t in enumerate(row) if t in stops]
            outputs.append(row[: ends[0] + 1] if ends else row)
        # One beam is plain greedy decoding there, which reports no sequence scores.
        scores = getattr(out, "sequences_scores", None)
        return {"tokens": outputs, "scores": None if scores is None else scores.tolist()}

    return generate


def frequent_token(llm: LLM, prompt: list[int]) -> int:
    """A token the tiny model likes after this prompt: as a stop token, beams end early."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    return Counter(tokens).most_common(1)[0][0]


CASES = {
    "width 4, n 4, to max_tokens": dict(n=4, max_tokens=12),
    "width 3 returns 2": dict(n=2, best_of=3, max_tokens=10),
    "width 1 is greedy": dict(n=1, max_tokens=8),
    # A bias towards the stop token makes hypotheses end early, where the rules differ.
    "stop token, early_stopping False": dict(n=3, best_of=4, max_tokens=16, stop=True, bias=2.5),
    "stop token, early_stopping True": dict(
        n=2, best_of=4, max_tokens=16, stop=True, early_stopping=True, bias=2.5
    ),
    "stop token, 'never', length_penalty 2": dict(
        n=4, max_tokens=14, stop=True, early_stopping="never", length_penalty=2.0, bias=2.5
    ),
    "stop token, length_penalty -1": dict(
        n=2, best_of=3, max_tokens=14, stop=True, length_penalty=-1.0, bias=1.5
    ),
    "stop token, no bias": dict(n=3, best_of=4, max_tokens=16, stop=True),
    "min_tokens": dict(n=3, max_tokens=16, stop=True, min_tokens=4, bias=3.0),
}


def case_params(llm: LLM, prompt: list[int], case: dict) -> tuple[SamplingParams, list[int]]:
    case = dict(case)
    stops = [frequent_token(llm, prompt)] if case.pop("stop", False) else []
    bias = case.pop("bias", None)
    params = SamplingParams(
        temperature=0.0,
        use_beam_search=True,
        ignore_eos=True,  # the tiny model's own EOS: only the chosen stop token ends beams
        stop_token_ids=stops,
        logit_bias={stops[0]: bias} if bias else {},
        logprobs=0,
        **case,
    )
    return params, stops


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_beams_equal_transformers_beam_search(llm, hf, case):
    for prompt in PROMPTS:
        params, stops = case_params(llm, prompt, case)
        want = hf(prompt, params, stops)
        got = llm.generate([prompt], params)[0]
        assert [o.token_ids for o in got.outputs] == want["tokens"], prompt
        scores = want["scores"] or [None] * params.n
        for output, score in zip(got.outputs, scores, strict=True):
            ended = output.token_ids[-1] in stops
            assert output.finish_reason == ("stop" if ended else "length")
            # The logprobs are the model's: without a bias they add up to the score.
            assert [e["token_id"] for e in output.logprobs] == output.token_ids
            if score is not None and not params.logit_bias and not params.min_tokens:
                total = sum(e["logprob"] for e in output.logprobs)
                length = len(output.token_ids) ** params.length_penalty
                assert total / length == pytest.approx(score, rel=1e-4, abs=1e-4)
            assert output.text == llm.tokenizer.decode(
                [t for t in output.token_ids if t not in stops], skip_special_tokens=True
            )


def test_beams_run_batched_with_other_requests_and_under_preemption(tiny, llm, hf):
    """Beams of several requests beside sampled ones, in a cache so small that beams are
    preempted and wait for each other: the same hypotheses as alone."""
    small = LLM(
        tiny, dtype="float32", max_model_len=128, num_gpu_blocks=14, max_num_batched_tokens=24
    )
    params = [case_params(llm, p, CASES["stop token, early_stopping False"]) for p in PROMPTS]
    sampled = SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    outs = small.generate([*PROMPTS, LONG_PROMPT], [p for p, _ in params] + [sampled])
    assert small.engine.scheduler.num_preemptions > 0
    for prompt, (p, stops), out in zip(PROMPTS, params, outs, strict=False):
        assert [o.token_ids for o in out.outputs] == hf(prompt, p, stops)["tokens"]
    assert len(outs[-1].outputs[0].token_ids) == 20
    assert small.engine.stats().kv.used == 0


def test_beams_share_prefix_blocks_and_free_pruned_ones_at_once(llm, monkeypatch):
    engine = llm.engine
    width = 4
    copies: list[tuple[int, int]] = []
    execute = engine.runner.execute

    def recording(out):
        copies.extend(out.copy_blocks)
        return execute(out)

    monkeypatch.setattr(engine.runner, "execute", recording)
    params = SamplingParams(
        max_tokens=24, temperature=0.0, use_beam_search=True, n=width, ignore_eos=True
    )
    request_id = engine.add_request(LONG_PROMPT, params)
    group = engine._groups[request_id]
    seen: set[int] = set()  # ids of every beam request the search ran
    separate = 0  # the most blocks `width` unshared copies of the beams would hold
    while engine.has_unfinished():
        engine.step()
        if request_id not in engine._groups:
            break
        tables = [r.block_table for r in group.beam_requests.values()]
        seen.update(id(r) for r in group.beam_requests.values())
        held = {b for table in tables for b in table}
        # Every block in use belongs to a live beam: pruned beams gave theirs back.
        assert engine.stats().kv.used == len(held)
        if len(tables) == width:
            # The prompt's full blocks are one set of blocks, whichever beam reads them.
            full = len(LONG_PROMPT) // 16
            assert all(t[:full] == tables[0][:full] for t in tables)
            separate = max(separate, sum(len(t) for t in tables))
            assert len(held) <= separate - (width - 1) * full
    assert separate > 0
    assert len(seen) > width  # beams were pruned and others forked in their slots
    assert copies  # a shared last block was copied before a beam wrote into it
    assert engine.stats().kv.used == 0
    assert not engine._groups and not engine._owner


def test_an_aborted_beam_search_frees_every_block(llm):
    engine = llm.engine
    params = SamplingParams(
        max_tokens=30, temperature=0.0, use_beam_search=True, n=2, best_of=5, ignore_eos=True
    )
    request_id = engine.add_request(LONG_PROMPT, params)
    for _ in range(4):
        engine.step()
    assert engine.stats().kv.used > 0
    deltas = engine.abort(request_id)
    assert [(d.index, d.finish_reason) for d in deltas] == [(0, "abort"), (1, "abort")]
    assert engine.stats().kv.used == 0
    assert not engine.has_unfinished()
    assert engine.abort(request_id) == []
    while engine.has_unfinished():
        engine.step()
    # The slot ids are free again: the same request id runs anew.
    again = llm.generate([LONG_PROMPT[:8]], dataclasses.replace(params, max_tokens=3))
    assert len(again[0].outputs) == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(temperature=0.7), "temperature"),
        (dict(temperature=0.0, top_p=0.5), "top_p"),
        (dict(temperature=0.0, top_k=5), "top_k"),
        (dict(temperature=0.0, min_p=0.1), "min_p"),
        (dict(temperature=0.0, repetition_penalty=1.2), "repetition_penalty"),
        (dict(temperature=0.0, presence_penalty=0.5), "presence_penalty"),
        (dict(temperature=0.0, stop=["x"]), "stop"),
        (dict(temperature=0.0, n=3, best_of=2), "best_of"),
        (dict(temperature=0.0, early_stopping="sometimes"), "early_stopping"),
        (dict(temperature=0.0, length_penalty=float("nan")), "length_penalty"),
    ],
)
def test_bad_beam_search_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(use_beam_search=True, **kwargs)


def test_best_of_without_beam_search_is_refused():
    with pytest.raises(ValueError, match=r"^best_of .*use_beam_search"):
        SamplingParams(n=2, best_of=4)
    assert SamplingParams(n=2, best_of=2).beam_width == 2


def test_a_beam_width_above_max_num_seqs_is_refused(tiny):
    narrow = LLM(tiny, dtype="float32", max_model_len=64, num_gpu_blocks=16, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, use_beam_search=True, n=3)
    with pytest.raises(ValueError, match="max_num_seqs"):
        narrow.generate([[1, 2, 3]], params)
    assert not narrow.engine.has_unfinished()


def test_the_search_waits_for_every_live_beam_before_advancing():
    params = SamplingParams(temperature=0.0, use_beam_search=True, n=2, max_tokens=4)
    search = BeamSearch(params, [1, 2], eos_token_ids=[0])
    logits = torch.zeros(10)
    logits[5], logits[6], logits[7] = 3.0, 2.0, 1.0
    search.propose(0, logits)
    step = search.advance()
    assert step.continued == {0: 5} and step.forks == [(0, 1, 6)] and not step.done
    search.propose(1, logits)
    assert not search.ready()
    with pytest.raises(ValueError, match="proposed"):
        search.advance()
    search.propose(0, logits)
    assert search.ready()


# -- the APIs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    """`pagedinfer serve` of the tiny model: gRPC and the HTTP API in one process."""
    from test_server import start_server, stop_server

    server = start_server(tmp_path_factory.mktemp("serve-beams"), "--model", tiny,
                          "--max-model-len", "256")  # fmt: skip
    yield server
    stop_server(server)


def post(server, path: str, body: dict) -> tuple[int, dict]:
    import http.client
    import json

    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


BEAMS = dict(max_tokens=10, n=2, best_of=3, ignore_eos=True, length_penalty=0.5)


def offline(llm: LLM, prompt: list[int]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, use_beam_search=True, **BEAMS)
    return [o.token_ids for o in llm.generate([prompt], params)[0].outputs]


@pytest.mark.slow
def test_http_completions_and_chat_take_vllms_beam_fields(served, llm):
    prompt = PROMPTS[1]
    status, body = post(served, "/v1/completions",
                        {"prompt": prompt, "use_beam_search": True, **BEAMS})  # fmt: skip
    assert status == 200, body
    want = [llm.tokenizer.decode(t, skip_special_tokens=True) for t in offline(llm, prompt)]
    assert [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])] == want
    assert body["usage"]["completion_tokens"] == 2 * BEAMS["max_tokens"]
    messages = [{"role": "user", "content": "Name three colours."}]
    status, body = post(served, "/v1/chat/completions",
                        {"messages": messages, "use_beam_search": True, "n": 2, "best_of": 4,
                         "max_tokens": 6, "early_stopping": "never"})  # fmt: skip
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["finish_reason"] in ("stop", "length") for c in body["choices"])
    served.wait_all_blocks_free()


BAD_HTTP = [
    ("stream", {"stream": True}, "stream"),
    ("sampling temperature", {"temperature": 0.8}, "temperature"),
    ("top_p", {"top_p": 0.9}, "top_p"),
    ("stop strings", {"stop": ["."]}, "stop"),
    ("best_of below n", {"n": 3, "best_of": 2}, "best_of"),
    ("early_stopping", {"early_stopping": "sometimes"}, "early_stopping"),
    ("length_penalty", {"length_penalty": "long"}, "length_penalty"),
    ("structured output", {"response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("fields", "param"), [b[1:] for b in BAD_HTTP],
                         ids=[b[0] for b in BAD_HTTP])  # fmt: skip
def test_bad_http_beam_search_requests_are_400_naming_the_field(served, fields, param):
    for path, base in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        status, body = post(served, path, {**base, "use_beam_search": True, "max_tokens": 4,
                                           **fields})  # fmt: skip
        assert status == 400, (path, body)
        assert param in (body["error"]["param"] or ""), (path, body)
    status, body = post(served, "/v1/completions", {"prompt": "Hi", "best_of": 3})
    assert status == 400 and body["error"]["param"] == "best_of", body


@pytest.mark.slow
def test_grpc_beam_search_field(served, llm):
    import grpc

    from pagedinfer.service.proto import inference_pb2 as pb

    prompt = PROMPTS[2]
    sampling = pb.SamplingParams(
        max_tokens=BEAMS["max_tokens"], n=2, ignore_eos=True,
        beam_search=pb.BeamSearch(best_of=3, length_penalty=BEAMS["length_penalty"]),
    )  # fmt: skip
    responses = list(served.generate(prompt_token_ids=prompt, sampling=sampling))
    tokens = {r.index: list(r.token_ids) for r in responses}
    assert [tokens[0], tokens[1]] == offline(llm, prompt)
    assert {r.finish_reason for r in responses} == {pb.LENGTH}
    stopping = pb.BeamSearch(early_stopping=pb.EARLY_STOPPING_FIRST)
    done = list(served.generate(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        max_tokens=4, beam_search=stopping)))  # fmt: skip
    assert len(done) == 1 and done[0].finish_reason in (pb.STOP, pb.LENGTH)
    for sampling, field in (
        (pb.SamplingParams(temperature=0.5, beam_search=pb.BeamSearch()), "sampling.temperature"),
        (pb.SamplingParams(n=3, beam_search=pb.BeamSearch(best_of=2)),
         "sampling.beam_search.best_of"),
        (pb.SamplingParams(beam_search=pb.BeamSearch(early_stopping=9)),
         "sampling.beam_search.early_stopping"),
        (pb.SamplingParams(stop=["x"], beam_search=pb.BeamSearch()), "sampling.stop"),
    ):  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            list(served.generate(prompt_token_ids=prompt, sampling=sampling))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field), err.value.details()
    served.wait_all_blocks_free()


def test_beam_params_round_trip_through_the_proto():
    from pagedinfer.service.client import sampling_params_to_proto
    from pagedinfer.service.proto import inference_pb2 as pb
    from pagedinfer.service.server import sampling_params_from_proto

    for stopping in (False, True, "never"):
        params = SamplingParams(
            temperature=0.0,
            use_beam_search=True,
            n=2,
            best_of=5,
            length_penalty=0.6,
            early_stopping=stopping,
            max_tokens=9,
        )
        wire = pb.SamplingParams.FromString(sampling_params_to_proto(params).SerializeToString())
        assert sampling_params_from_proto(wire) == params
    assert not sampling_params_from_proto(pb.SamplingParams()).use_beam_search


def test_a_beam_preempted_after_it_proposed_still_gives_the_same_hypotheses(tiny, llm, monkeypatch):
    """One beam is preempted after it proposed, while a sibling still recomputes its
    prompt in chunks: the search advances without it (it keeps its token, or its fork
    recomputes from scratch) and the hypotheses are those of an undisturbed run."""
    params = SamplingParams(max_tokens=12, temperature=0.0, use_beam_search=True, n=3,
                            ignore_eos=True)  # fmt: skip
    want = [o.token_ids for o in llm.generate([LONG_PROMPT], params)[0].outputs]
    chunked = LLM(tiny, dtype="float32", max_model_len=128, num_gpu_blocks=64,
                  max_num_batched_tokens=16)  # fmt: skip
    engine, scheduler = chunked.engine, chunked.engine.scheduler
    request_id = engine.add_request(LONG_PROMPT, params)
    group = engine._groups[request_id]
    while len(group.beam_requests) < 3 or group.beams.num_generated < 3:
        engine.step()
    # Send the last beam back to the queue: it recomputes its whole sequence in chunks.
    lagging = scheduler.running[-1]
    scheduler._preempt_last()
    engine.step()  # the others propose and wait; the lagging beam starts over
    proposed = [r for r in group.beam_requests.values() if r.index in group.beams.proposals]
    assert lagging.index not in group.beams.proposals and proposed
    # Preempt a beam that proposed: the search must advance without computing it again.
    waiting = proposed[0]
    scheduler.running.remove(waiting)
    scheduler.running.append(waiting)
    scheduler._preempt_last()
    # Admit nobody until the search advanced: it advances past a beam in the queue.
    generated = group.beams.num_generated
    monkeypatch.setattr(scheduler.config, "max_num_seqs", len(scheduler.running))
    while group.beams.num_generated == generated:
        engine.step()
    assert waiting.is_finished or waiting.status is RequestStatus.WAITING
    monkeypatch.undo()
    outputs = {}
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.index] = outputs.get(delta.index, []) + delta.token_ids
    assert [outputs[i] for i in range(3)] == want
    assert engine.stats().kv.used == 0


@pytest.fixture(scope="module")
def embedded(tiny):  # `tiny` keeps the torch kernels on: nothing compiles
    from transformers import AutoModelForCausalLM

    from pagedinfer.service.loader import ensure_default_model

    llm = LLM(max_model_len=256, num_gpu_blocks=64, dtype="float32", gguf_activations="fp32")
    hf = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32)
    return llm, hf.eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("early_stopping", "length_penalty"), [(False, 1.0), (True, 1.0), ("never", 0.5)]
)
def test_the_embedded_models_beams_end_at_eos_as_transformers_beams_do(
    embedded, early_stopping, length_penalty
):
    """A real model ends its hypotheses with EOS, so the end-of-search rules decide."""
    llm, hf = embedded
    question = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    prompt = llm.tokenizer.encode(question)
    params = SamplingParams(temperature=0.0, use_beam_search=True, n=3, best_of=4, max_tokens=24,
                            early_stopping=early_stopping, length_penalty=length_penalty)  # fmt: skip
    outputs = llm.generate([prompt], params)[0].outputs
    eos = sorted(llm.engine.eos_token_ids)
    with torch.inference_mode():
        reference = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=24, do_sample=False, num_beams=4, num_return_sequences=3,
            early_stopping=early_stopping, length_penalty=length_penalty,
            eos_token_id=eos, pad_token_id=eos[0],
        )  # fmt: skip
    for output, row in zip(outputs, reference[:, len(prompt) :].tolist(), strict=True):
        ends = [i for i, t in enumerate(row) if t in eos]
        assert output.token_ids == (row[: ends[0] + 1] if ends else row)
        assert output.finish_reason == ("stop" if ends else "length")
    assert any(o.finish_reason == "stop" for o in outputs)
    assert "Paris" in outputs[0].text
