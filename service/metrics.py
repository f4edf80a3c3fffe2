"""OpenTelemetry metrics and traces of the inference server.

The engine has no telemetry dependency: the KV-cache and scheduler gauges read the
engine's latest stats snapshot when a reader collects, and the per-request latency
histograms and spans are fed by the server from each request's stream of deltas
(`RequestTelemetry`). Names are the contract of docs/architecture.md section 9; docs/metrics.md
lists the Prometheus names the exporter makes of them.

Exports: Prometheus text on `metrics_port` at /metrics (the operator's autoscaling
signal), and OTLP push of metrics and spans when OTEL_EXPORTER_OTLP_ENDPOINT (or the
per-signal variants) is set.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, Status, StatusCode

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from pagedinfer.service.vllm_metrics import VllmMetrics

SCOPE = "pagedinfer.service"

# Bucket boundaries recommended by the GenAI semantic conventions.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)  # fmt: skip
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                 16777216, 67108864)  # fmt: skip


class KVStats(Protocol):
    total: int
    free: int
    free_ratio: float
    demand: int


class EngineStats(Protocol):
    """What the gauges read; the engine's stats snapshot provides it."""

    kv: KVStats
    running: int
    waiting: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    draft_tokens: int
    accepted_draft_tokens: int


StatsSource = Callable[[], EngineStats | None]


class ServerMetrics:
    """The instruments of docs/architecture.md section 9 on one meter provider.

    `stats` returns the engine's latest snapshot, or None while the model is loading
    (the gauges then report nothing rather than a misleading zero).
    """

    def __init__(self, meter_provider: MeterProvider, stats: StatsSource):
        self._stats = stats
        meter = meter_provider.get_meter(SCOPE)

        def gauge(name: str, unit: str, description: str, read: Callable[[Any], float]):
            meter.create_observable_gauge(
                name, [self._observe(read)], unit=unit, description=description
            )

        def counter(name: str, unit: str, description: str, read: Callable[[Any], float]):
            meter.create_observable_counter(
                name, [self._observe(read)], unit=unit, description=description
            )

        gauge("pagedinfer.kv_cache.blocks.total", "{block}",
              "KV-cache blocks in the pool.", lambda s: s.kv.total)  # fmt: skip
        gauge("pagedinfer.kv_cache.blocks.free", "{block}",
              "KV-cache blocks free, including evictable prefix-cache blocks.",
              lambda s: s.kv.free)  # fmt: skip
        gauge("pagedinfer.kv_cache.free_ratio", "1",
              "Free KV-cache blocks over total blocks: the autoscaling signal.",
              lambda s: s.kv.free_ratio)  # fmt: skip
        gauge("pagedinfer.kv_cache.blocks.demand", "{block}",
              "Blocks in use plus blocks the waiting queue needs for its prompts.",
              lambda s: s.kv.demand)  # fmt: skip
        gauge("pagedinfer.requests.running", "{request}",
              "Requests scheduled on the engine.", lambda s: s.running)  # fmt: skip
        gauge("pagedinfer.requests.waiting", "{request}",
              "Requests waiting for admission (including preempted ones).",
              lambda s: s.waiting)  # fmt: skip
        counter("pagedinfer.preemptions", "{preemption}",
                "Running requests preempted to free KV-cache blocks.",
                lambda s: s.num_preemptions)  # fmt: skip
        counter("pagedinfer.prefix_cache.queries", "{token}",
                "Prompt tokens looked up in the prefix cache.",
                lambda s: s.prefix_cache_queries)  # fmt: skip
        counter("pagedinfer.prefix_cache.hits", "{token}",
                "Prompt tokens served from the prefix cache.",
                lambda s: s.prefix_cache_hits)  # fmt: skip
        counter("pagedinfer.spec_decode.draft_tokens", "{token}",
                "Draft tokens verified by speculative decoding.",
                lambda s: s.draft_tokens)  # fmt: skip
        counter("pagedinfer.spec_decode.accepted_tokens", "{token}",
                "Draft tokens kept: each saved a forward pass of its sequence.",
                lambda s: s.accepted_draft_tokens)  # fmt: skip

        self.time_to_first_token = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time from receiving a request to its first output token.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self.time_per_output_token = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token after the first, per sample.",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )
        self.request_duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Time from receiving a request to its last output token.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Input and output tokens per request.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )

    def _observe(
        self, read: Callable[[Any], float]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(_options: CallbackOptions) -> Iterable[Observation]:
            stats = self._stats()
            return [] if stats is None else [Observation(read(stats))]

        return callback


@dataclass
class _Sample:
    first_token_at: float | None = None
    last_token_at: float | None = None
    completion_tokens: int = 0


@dataclass
class RequestTelemetry:
    """Latency, token usage and the span of one request, fed from its deltas.

    Span events: `queued` (admitted to the engine's queue), `prefill` (the prompt is
    computed: the first token arrived), `decode` (the last sample finished).
    """

    metrics: ServerMetrics
    span: Span
    attributes: dict[str, str]
    clock: Callable[[], float] = time.monotonic
    started_at: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    samples: dict[int, _Sample] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    vllm: VllmMetrics | None = None  # the vLLM-named series, fed alongside
    num_samples: int = 1  # the request's n: each sample ends with a reason, abort at worst
    _queue_recorded: bool = False
    _ended: bool = False

    def queued(self, prompt_tokens: int, num_samples: int = 1) -> None:
        self.prompt_tokens = prompt_tokens
        self.num_samples = num_samples
        self.span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        self.span.add_event("queued", {"prompt_tokens": prompt_tokens})

    def on_delta(
        self,
        index: int,
        num_new_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        finish_reason: str | None,
        queue_time: float | None = None,
    ) -> None:
        """queue_time: seconds the request waited before it was first scheduled, once
        known (recorded once)."""
        now = self.clock()
        sample = self.samples.setdefault(index, _Sample())
        if queue_time is not None and not self._queue_recorded:
            self._queue_recorded = True
            if self.vllm is not None:
                self.vllm.queued(queue_time)
        if num_new_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
                self.cached_tokens = cached_tokens
                ttft = now - self.started_at
                self.metrics.time_to_first_token.record(ttft, self.attributes)
                if self.vllm is not None:
                    self.vllm.first_token(ttft)
                self.span.add_event(
                    "prefill", {"cached_tokens": cached_tokens, "time_to_first_token_s": ttft}
                )
            if sample.first_token_at is None:
                sample.first_token_at = now
            elif self.vllm is not None:
                assert sample.last_token_at is not None
                self.vllm.new_tokens(now - sample.last_token_at, num_new_tokens)
            sample.last_token_at = now
        sample.completion_tokens = completion_tokens
        if finish_reason is not None:
            self.finish_reasons[index] = finish_reason
            if self.vllm is not None:
                self.vllm.sample_finished(finish_reason)
            if sample.completion_tokens > 1 and finish_reason != "abort":
                assert sample.first_token_at is not None and sample.last_token_at is not None
                tpot = (sample.last_token_at - sample.first_token_at) / (
                    sample.completion_tokens - 1
                )
                self.metrics.time_per_output_token.record(tpot, self.attributes)

    def end(self, error_type: str | None = None, message: str = "") -> None:
        """Records duration and usage and ends the span; idempotent."""
        if self._ended:
            return
        self._ended = True
        now = self.clock()
        attributes = dict(self.attributes)
        if error_type is not None:
            attributes["error.type"] = error_type
        self.metrics.request_duration.record(now - self.started_at, attributes)
        output_tokens = sum(s.completion_tokens for s in self.samples.values())
        # A sample that ends without a reason was cut: the client went away, its deadline
        # passed, the server shut down or failed; vLLM counts those as aborts.
        for index in range(self.num_samples):
            if index not in self.finish_reasons:
                self.finish_reasons[index] = "abort"
                if self.vllm is not None:
                    self.vllm.sample_finished("abort")
        if self.vllm is not None:
            longest = max((s.completion_tokens for s in self.samples.values()), default=0)
            self.vllm.request_finished(
                now - self.started_at,
                self.prompt_tokens,
                output_tokens,
                n=max(len(self.samples), 1),
                max_sample_tokens=longest,
            )
        if self.prompt_tokens:
            self.metrics.token_usage.record(
                self.prompt_tokens, {**self.attributes, "gen_ai.token.type": "input"}
            )
            self.metrics.token_usage.record(
                output_tokens, {**self.attributes, "gen_ai.token.type": "output"}
            )
        reasons = [self.finish_reasons[i] for i in sorted(self.finish_reasons)]
        self.span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        self.span.set_attribute("pagedinfer.cached_tokens", self.cached_tokens)
        if reasons:
            self.span.set_attribute("gen_ai.response.finish_reasons", reasons)
        if self.first_token_at is not None:
            self.span.add_event("decode", {"output_tokens": output_tokens})
        if error_type is not None:
            self.span.set_attribute("error.type", error_type)
            self.span.set_status(Status(StatusCode.ERROR, message or error_type))
        self.span.end()


class Telemetry:
    """The meter and tracer providers of one server, with their exporters.

    Nothing here is global: the providers are passed around explicitly, and the
    Prometheus reader uses its own registry, so two servers (or tests) in one process
    do not share state.
    """

    def __init__(
        self,
        stats: StatsSource,
        *,
        metric_readers: Sequence[MetricReader] = (),
        span_processors: Sequence[SpanProcessor] = (),
        resource: Resource | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        resource = resource or Resource.create({"service.name": "pagedinfer"})
        self.metric_readers = list(metric_readers)
        self.span_processors = list(span_processors)
        self.meter_provider = MeterProvider(metric_readers=self.metric_readers, resource=resource)
        self.tracer_provider = TracerProvider(resource=resource)
        for processor in self.span_processors:
            self.tracer_provider.add_span_processor(processor)
        self.tracer = self.tracer_provider.get_tracer(SCOPE)
        self.metrics = ServerMetrics(self.meter_provider, stats)
        self.clock = clock
        self.metrics_port: int | None = None  # the bound scrape port, once serving
        self.registry: CollectorRegistry | None = None  # what /metrics pages show
        self.vllm: VllmMetrics | None = None
        self._http_server: Any = None
        self._http_thread: threading.Thread | None = None

    def start_request(self, *, request_id: str, operation: str, model: str) -> RequestTelemetry:
        """Starts the span and the clock of one request.

        `operation` is the GenAI operation name: "chat" or "text_completion".
        """
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "pagedinfer",
            "gen_ai.request.model": model,
            "gen_ai.response.model": model,
        }
        span = self.tracer.start_span(
            f"{operation} {model}",
            attributes={**attributes, "gen_ai.response.id": request_id},
        )
        return RequestTelemetry(
            metrics=self.metrics,
            span=span,
            attributes=attributes,
            clock=self.clock,
            started_at=self.clock(),
            vllm=self.vllm,
        )

    def serve_prometheus(self, registry: Any, host: str, port: int) -> int:
        """Serves `registry` at http://host:port/metrics; returns the bound port."""
        from prometheus_client import start_http_server

        self._http_server, self._http_thread = start_http_server(port, addr=host, registry=registry)
        self.metrics_port = self._http_server.server_address[1]
        return self.metrics_port

    def shutdown(self) -> None:
        """Flushes pending exports and stops the scrape endpoint."""
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def otlp_enabled(environ: dict[str, str] | None = None) -> tuple[bool, bool]:
    """Whether the standard OTEL_EXPORTER_OTLP_* variables ask for metrics and traces."""
    env = os.environ if environ is None else environ
    base = bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    metrics = base or bool(env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"))
    traces = base or bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    return metrics, traces


def create_telemetry(
    stats: StatsSource,
    *,
    host: str,
    metrics_port: int | None,
    environ: dict[str, str] | None = None,
    prometheus: bool = False,
) -> Telemetry:
    """The server's telemetry: Prometheus on `metrics_port` (None: off), OTLP when set.

    The Prometheus registry (`telemetry.registry`, with the vLLM-named series beside
    ours) exists when `metrics_port` is given or `prometheus` asks for it (the HTTP
    API serves it too). The OTLP exporters read their endpoint, headers, TLS and
    timeout settings from the standard OTEL_EXPORTER_OTLP_* variables themselves.
    """
    from prometheus_client import CollectorRegistry

    from pagedinfer.service.vllm_metrics import VllmMetrics

    readers: list[MetricReader] = []
    processors: list[SpanProcessor] = []
    registry = None
    if metrics_port is not None or prometheus:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        registry = CollectorRegistry()
        readers.append(PrometheusMetricReader(registry=registry))
    push_metrics, push_traces = otlp_enabled(environ)
    if push_metrics:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if push_traces:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        processors.append(BatchSpanProcessor(OTLPSpanExporter()))
    telemetry = Telemetry(stats, metric_readers=readers, span_processors=processors)
    if registry is not None:
        telemetry.registry = registry
        telemetry.vllm = VllmMetrics(registry, stats)
    if metrics_port is not None:
        telemetry.serve_prometheus(registry, host, metrics_port)
    return telemetry
