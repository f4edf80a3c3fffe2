"""The HTTP API fuzzed from its own `/openapi.json` with schemathesis: bodies that follow
the document and bodies that break it, for every route. Asserted for each: no 5xx; every
refusal is OpenAI's error body, as the document says; a body the document calls invalid
is refused (4xx), so the document is as strict as the server; and the server is alive
and leak-free afterwards. Bounded by a fixed number of derandomised examples per route
and a small context, so that each generation costs at most a few dozen tokens."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode, checks
from test_server import Server, start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLES_PER_ROUTE = 25
STATUSES: Counter[tuple[str, int]] = Counter()


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("fuzz"), "--max-model-len", "48",
                          "--max-num-seqs", "8")  # fmt: skip
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def api_schema(fuzzed_server: Server) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"http://127.0.0.1:{fuzzed_server.http_port}/openapi.json")


CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_api_answers_every_generated_request_without_a_server_error(
    api_schema: schemathesis.BaseSchema, mode: GenerationMode
) -> None:
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and not operation.get_request_payload_content_types():
            continue  # a route without input has no invalid request to send
        fuzz(operation, mode, api_schema.get_base_url())


def fuzz(operation: schemathesis.APIOperation, mode: GenerationMode, base_url: str) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True,
              database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def answered(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, timeout=120)
        STATUSES[(operation.label, response.status_code)] += 1
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"], response.text

    answered()


def test_after_the_fuzz_the_server_is_alive_and_holds_no_blocks(fuzzed_server: Server) -> None:
    for (route, status), count in sorted(STATUSES.items()):
        print(f"HTTP fuzz: {route} -> {status}: {count}")
    assert sum(STATUSES.values()) > 0, "the fuzz ran no request"
    assert fuzzed_server.process.poll() is None
    fuzzed_server.wait_all_blocks_free(timeout=60)
    deadline = time.monotonic() + 30
    while fuzzed_server.metrics()["pagedinfer_requests_running"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
