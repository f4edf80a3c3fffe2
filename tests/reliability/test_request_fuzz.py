"""Fuzzing GenerateRequest: whatever a client puts in its fields, the server answers OK
or INVALID_ARGUMENT, never INTERNAL or UNKNOWN, and keeps serving.

Every field is drawn from its whole wire range (int32 and int64 extremes, NaN and
infinite floats, empty and non-ASCII strings), with the boundaries of the valid ranges
over-represented. Valid requests stay cheap: max_tokens is at most 4 and n at most 3.
A request that is accepted must run to a normal end (STOP or LENGTH) for every sample:
an ABORT nobody asked for means the engine gave up on it.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import Server, collect, greedy

from pagedinfer.service.proto import inference_pb2 as pb

pytestmark = pytest.mark.slow

VOCAB = 49152  # the embedded model's
MAX_TOKENS = 4
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOAT32 = st.floats(width=32)  # NaN, infinities and subnormals included
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # protobuf needs UTF-8


def around(*points: float) -> st.SearchStrategy:
    """The points themselves and their float32 neighbours."""
    return st.sampled_from([*points, *(p * f for p in points for f in (0.999999, 1.000001) if p)])


def unit_float(low: float, high: float, **kwargs) -> st.SearchStrategy:
    return st.floats(low, high, width=32, **kwargs)


# Per field: values the server must accept (including valid extremes, where numerical
# trouble hides: a tiny repetition penalty, an infinite temperature) ...
VALID = {
    "max_tokens": st.integers(1, MAX_TOKENS),
    "temperature": st.just(0.0) | unit_float(0.0, 2.0) | around(1e-5, 1e30, math.inf),
    "top_p": unit_float(0.0, 1.0, exclude_min=True) | around(1e-38),
    "top_k": st.integers(-1, VOCAB + 100),
    "min_p": unit_float(0.0, 1.0),
    "repetition_penalty": unit_float(0.125, 2.0) | around(1e-38, 1e30, math.inf),
    "presence_penalty": unit_float(-2.0, 2.0),
    "frequency_penalty": unit_float(-2.0, 2.0),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.lists(TEXT.filter(bool), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 2**31 - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 3),
    "logprobs": st.integers(0, 20),
}
# ... and anything the wire can carry (expensive valid values left out: a valid request
# generates at most MAX_TOKENS tokens per sample).
WILD = {
    "max_tokens": st.sampled_from([0, -1, 256, 257, 2**31 - 1, -(2**31)]),
    "temperature": FLOAT32,
    "top_p": FLOAT32,
    "top_k": INT32,
    "min_p": FLOAT32,
    "repetition_penalty": FLOAT32,
    "presence_penalty": FLOAT32,
    "frequency_penalty": FLOAT32,
    "seed": INT64,
    "stop": st.lists(TEXT, max_size=3),
    "stop_token_ids": st.lists(INT32, max_size=3),
    "ignore_eos": st.booleans(),
    "n": st.sampled_from([0, -1, 65, 2**31 - 1]),
    "logprobs": st.sampled_from([-1, 21, 2**31 - 1]),
}
VALID_INPUTS = {
    "prompt": TEXT.filter(bool),
    "prompt_token_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=100),
    "messages": st.lists(
        st.builds(
            pb.ChatMessage, role=st.sampled_from(["system", "user", "assistant"]), content=TEXT
        ),
        min_size=1,
        max_size=3,
    ),
}
WILD_INPUTS = {
    "prompt": TEXT,
    "prompt_token_ids": st.lists(INT32 | st.sampled_from([-1, VOCAB]), max_size=300),
    "messages": st.lists(
        st.builds(pb.ChatMessage, role=TEXT | st.sampled_from(["tool", "wizard"]), content=TEXT),
        max_size=3,
    ),
}


@st.composite
def requests(draw: st.DrawFn) -> dict:
    """A valid request, one with a few wild fields, or one that is wild throughout."""
    kind = draw(st.sampled_from(["valid", "valid", "a few wild fields", "wild"]))
    wild_fields = set()
    if kind == "wild":
        wild_fields = set(WILD) | set(WILD_INPUTS)
    elif kind == "a few wild fields":
        wild_fields = set(
            draw(st.lists(st.sampled_from([*WILD, *WILD_INPUTS]), min_size=1, max_size=3))
        )
    sampling = {}
    # max_tokens is always set: its default (16) would make valid requests slow.
    fields = draw(st.sets(st.sampled_from(list(VALID)))) | {"max_tokens"}
    for field in fields | (wild_fields & set(WILD)):
        sampling[field] = draw((WILD if field in wild_fields else VALID)[field])
    request: dict = {"sampling": pb.SamplingParams(**sampling)}
    inputs = {draw(st.sampled_from(list(VALID_INPUTS)))}
    inputs |= wild_fields & set(WILD_INPUTS)  # a wild input may come on top of another
    for field in inputs:
        request[field] = draw((WILD_INPUTS if field in wild_fields else VALID_INPUTS)[field])
    for field in ("request_id", "cache_salt"):
        if draw(st.booleans()):
            request[field] = draw(TEXT)
    return request


outcomes: Counter[str] = Counter()


def check_one(server: Server, request: dict) -> None:
    try:
        responses = collect(server.generate(timeout=120, **request))
    except grpc.RpcError as exc:
        outcomes[exc.code().name] += 1
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
        assert exc.details(), "the error says what is wrong"
        return
    outcomes["OK"] += 1
    n = request["sampling"].n if request["sampling"].HasField("n") else 1
    finished = {r.index: r for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED}
    assert sorted(finished) == list(range(n)), "every sample ends exactly once"
    for last in finished.values():
        assert last.finish_reason in (pb.STOP, pb.LENGTH), last
        assert last.usage.completion_tokens <= MAX_TOKENS


@pytest.mark.timeout(900)
@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,  # the same 200 requests on every run: CI stays reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=requests())
def test_any_generate_request_is_ok_or_invalid_argument(roomy_server: Server, request) -> None:
    check_one(roomy_server, request)


@pytest.mark.timeout(120)
def test_a_tiny_repetition_penalty_is_served_and_harms_no_other_request(
    roomy_server: Server,
) -> None:
    """Found by the fuzz above. repetition_penalty=1e-38 passes validation (> 0), but
    dividing a positive logit by it overflowed to inf; the softmax of several infs was
    NaN, the draw then returned token id 49152 (one past the vocabulary) to the client,
    and the next step's embedding lookup failed, upon which the engine aborted every
    request in flight, not only the offending one."""
    server = roomy_server
    bystander = server.generate(prompt="Count: one, two,", sampling=greedy(8, ignore_eos=True))
    next(bystander)  # running
    odd = collect(server.generate(
        prompt="0", sampling=pb.SamplingParams(max_tokens=3, temperature=1.0,
                                               repetition_penalty=1e-38, ignore_eos=True)))  # fmt: skip
    rest = collect(bystander)
    assert rest[-1].finish_reason == pb.LENGTH, "a bystander was aborted"
    tokens = [t for r in odd for t in r.token_ids]
    assert all(0 <= t < VOCAB for t in tokens), tokens
    assert odd[-1].finish_reason == pb.LENGTH, odd[-1]
    server.wait_all_blocks_free()


def test_the_server_is_alive_and_clean_after_the_fuzz(roomy_server: Server) -> None:
    print("\nfuzz outcomes:", json.dumps(dict(outcomes)))
    assert roomy_server.process.poll() is None
    health = health_pb2_grpc.HealthStub(roomy_server.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    responses = collect(roomy_server.generate(prompt="Still there?", sampling=greedy(2)))
    assert responses[-1].finish_reason in (pb.STOP, pb.LENGTH)
    roomy_server.wait_all_blocks_free()
