"""The server's telemetry: gauges read the engine's stats, request histograms and spans
follow the stream of deltas, and the Prometheus names are the documented ones."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry, generate_latest

from pagedinfer.service.metrics import Telemetry, create_telemetry, otlp_enabled

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def engine_stats(**overrides):
    kv = SimpleNamespace(total=100, free=40, used=60, cached=5, free_ratio=0.4, demand=130)
    stats = SimpleNamespace(
        kv=kv,
        running=3,
        waiting=2,
        num_preemptions=7,
        prefix_cache_queries=320,
        prefix_cache_hits=64,
        draft_tokens=90,
        accepted_draft_tokens=55,
    )
    for key, value in overrides.items():
        setattr(stats, key, value)
    return stats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def points(reader: InMemoryMetricReader) -> dict[str, list]:
    """Metric name -> its data points, from one collection."""
    data = reader.get_metrics_data()
    out: dict[str, list] = {}
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out[metric.name] = list(metric.data.data_points)
    return out


@pytest.fixture
def harness():
    reader = InMemoryMetricReader()
    spans = InMemorySpanExporter()
    clock = Clock()
    holder = SimpleNamespace(stats=engine_stats())
    telemetry = Telemetry(
        lambda: holder.stats,
        metric_readers=[reader],
        span_processors=[SimpleSpanProcessor(spans)],
        clock=clock,
    )
    yield SimpleNamespace(
        telemetry=telemetry, reader=reader, spans=spans, clock=clock, holder=holder
    )
    telemetry.shutdown()


def test_gauges_and_counters_read_the_engine_stats(harness):
    got = {name: pts[0].value for name, pts in points(harness.reader).items()}
    assert got == {
        "pagedinfer.kv_cache.blocks.total": 100,
        "pagedinfer.kv_cache.blocks.free": 40,
        "pagedinfer.kv_cache.free_ratio": 0.4,
        "pagedinfer.kv_cache.blocks.demand": 130,
        "pagedinfer.requests.running": 3,
        "pagedinfer.requests.waiting": 2,
        "pagedinfer.preemptions": 7,
        "pagedinfer.prefix_cache.queries": 320,
        "pagedinfer.prefix_cache.hits": 64,
        "pagedinfer.spec_decode.draft_tokens": 90,
        "pagedinfer.spec_decode.accepted_tokens": 55,
    }


def test_gauges_follow_the_latest_snapshot(harness):
    points(harness.reader)
    harness.holder.stats = engine_stats(kv=SimpleNamespace(total=100, free=100, free_ratio=1.0,
                                                          demand=0))  # fmt: skip
    got = points(harness.reader)
    assert got["pagedinfer.kv_cache.blocks.free"][0].value == 100
    assert got["pagedinfer.kv_cache.free_ratio"][0].value == 1.0


def test_nothing_is_reported_while_the_model_loads(harness):
    harness.holder.stats = None
    assert points(harness.reader) == {}


def test_a_streamed_request_records_latency_usage_and_a_span(harness):
    clock = harness.clock
    trace = harness.telemetry.start_request(request_id="r1", operation="chat", model="tiny")
    trace.queued(prompt_tokens=12)
    clock.now += 0.5  # queue + prefill
    trace.on_delta(0, 1, completion_tokens=1, cached_tokens=4, finish_reason=None)
    for completion_tokens in (2, 3, 4):
        clock.now += 0.1
        trace.on_delta(0, 1, completion_tokens, 4, None)
    clock.now += 0.1
    trace.on_delta(0, 1, 5, 4, "stop")
    trace.end()

    got = points(harness.reader)
    (ttft,) = got["gen_ai.server.time_to_first_token"]
    assert ttft.count == 1 and ttft.sum == pytest.approx(0.5)
    assert ttft.attributes["gen_ai.operation.name"] == "chat"
    assert ttft.attributes["gen_ai.request.model"] == "tiny"
    (tpot,) = got["gen_ai.server.time_per_output_token"]
    assert tpot.sum == pytest.approx(0.1)
    (duration,) = got["gen_ai.server.request.duration"]
    assert duration.sum == pytest.approx(0.9)
    assert "error.type" not in duration.attributes
    usage = {p.attributes["gen_ai.token.type"]: p.sum for p in got["gen_ai.client.token.usage"]}
    assert usage == {"input": 12, "output": 5}

    (span,) = harness.spans.get_finished_spans()
    assert span.name == "chat tiny"
    assert [e.name for e in span.events] == ["queued", "prefill", "decode"]
    assert span.events[1].attributes["cached_tokens"] == 4
    assert span.attributes["gen_ai.response.id"] == "r1"
    assert span.attributes["gen_ai.usage.output_tokens"] == 5
    assert span.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert span.status.status_code == StatusCode.UNSET


def test_parallel_samples_count_output_tokens_of_all_samples(harness):
    clock = harness.clock
    trace = harness.telemetry.start_request(
        request_id="r2", operation="text_completion", model="tiny"
    )
    trace.queued(prompt_tokens=3)
    for step in (1, 2):
        clock.now += 0.2
        for index in (0, 1):
            trace.on_delta(index, 1, step, 0, "length" if step == 2 else None)
    trace.end()
    got = points(harness.reader)
    assert got["gen_ai.server.time_to_first_token"][0].count == 1
    assert got["gen_ai.server.time_per_output_token"][0].count == 2
    usage = {p.attributes["gen_ai.token.type"]: p.sum for p in got["gen_ai.client.token.usage"]}
    assert usage == {"input": 3, "output": 4}


def test_a_cancelled_request_is_an_error_and_ends_once(harness):
    trace = harness.telemetry.start_request(request_id="r3", operation="chat", model="tiny")
    trace.queued(prompt_tokens=5)
    harness.clock.now += 1.0
    trace.end("cancelled")
    trace.end("cancelled")
    got = points(harness.reader)
    (duration,) = got["gen_ai.server.request.duration"]
    assert duration.count == 1
    assert duration.attributes["error.type"] == "cancelled"
    assert "gen_ai.server.time_to_first_token" not in got
    (span,) = harness.spans.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert [e.name for e in span.events] == ["queued"]


def exported_prometheus_names(text: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE)) - {"target_info"}


def documented_prometheus_names() -> set[str]:
    rows = re.findall(r"^\| `[^`]+` \| `([^`]+)` \|", DOC.read_text(), flags=re.MULTILINE)
    return set(rows)


def test_docs_list_exactly_the_prometheus_names_the_exporter_produces():
    registry = CollectorRegistry()
    telemetry = Telemetry(
        lambda: engine_stats(), metric_readers=[PrometheusMetricReader(registry=registry)]
    )
    trace = telemetry.start_request(request_id="r", operation="chat", model="tiny")
    trace.queued(4)
    trace.on_delta(0, 1, 1, 0, None)
    trace.on_delta(0, 1, 2, 0, "stop")
    trace.end()
    text = generate_latest(registry).decode()
    telemetry.shutdown()
    assert exported_prometheus_names(text) == documented_prometheus_names()
    # The autoscaler's signal, exactly as the operator scrapes it.
    assert re.search(r"^pagedinfer_kv_cache_free_ratio\{[^}]*\} 0\.4$", text, re.MULTILINE)
    assert re.search(r"^pagedinfer_preemptions_total\{[^}]*\} 7\.0$", text, re.MULTILINE)


def test_scrape_endpoint_serves_metrics_over_http():
    telemetry = create_telemetry(engine_stats, host="127.0.0.1", metrics_port=0, environ={})
    try:
        url = f"http://127.0.0.1:{telemetry.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        assert "pagedinfer_kv_cache_blocks_total{" in text
    finally:
        telemetry.shutdown()


def test_otlp_push_is_enabled_by_the_standard_variables():
    assert otlp_enabled({}) == (False, False)
    assert otlp_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}) == (True, True)
    assert otlp_enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}) == (False, True)


def test_otlp_exporters_are_attached_when_an_endpoint_is_set(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    telemetry = create_telemetry(engine_stats, host="127.0.0.1", metrics_port=None, environ=environ)
    try:
        assert [type(r).__name__ for r in telemetry.metric_readers] == [
            "PeriodicExportingMetricReader"
        ]
        assert [type(p).__name__ for p in telemetry.span_processors] == ["BatchSpanProcessor"]
    finally:
        telemetry.shutdown()
