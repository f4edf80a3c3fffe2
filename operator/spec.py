"""The InferenceService API: its names, and its spec as typed records.

The CRD (charts/pagedinfer/crds/inferenceservices.yaml) is the source of truth; the
defaults here repeat the CRD's so that the operator behaves the same when an object
reaches it undefaulted, and a test keeps the two equal. `validation_errors` repeats the CRD's
CEL rules for API servers that do not enforce them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GROUP = "serving.pagedinfer.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"

DEFAULT_REPLICAS = 1  # neither replicas nor autoscaling set
# `pagedinfer serve`'s own defaults, which the CRD's rule on spec.engine assumes for an
# unset bound; a test keeps them equal to the server's.
SERVER_PROMPT_LOOKUP_MIN = 1
SERVER_PROMPT_LOOKUP_MAX = 3
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# The server's port for Prometheus scrapes, on the pods and the Service; not configurable,
# so that every pod of every InferenceService is scraped the same way.
METRICS_PORT = 9464
# vLLM's default port for KV-cache events, which llm-d's router connects to on each pod.
KV_EVENTS_PORT = 5557
# The server's own container ports, which the KV event ports must not take.
SERVER_PORTS = (8000, 50051, METRICS_PORT)
# Flags of `pagedinfer serve` that the operator sets itself, because the probes, the
# Service and the termination grace period depend on them (the CRD refuses them in
# spec.engine.extraArgs, in the same words).
OPERATOR_FLAGS = re.compile(r"^--(host|port|http-port|metrics-port|grace-period)(=|$)")


@dataclass(frozen=True)
class ScalingRules:
    """How fast one direction may move (HPA's `behavior.scaleUp` / `scaleDown`)."""

    stabilization_window_s: float
    pods: int  # pods that may change per period...
    percent: int  # ...or this percent of the replicas at the period's start, whichever is more
    period_s: float


@dataclass(frozen=True)
class AutoscalingSpec:
    min_replicas: int = 1
    max_replicas: int = 1
    target_free_ratio: float = 0.3
    tolerance: float = 0.1
    sync_period_s: float = 15.0
    scrape_timeout_s: float = 2.0
    metric_staleness_s: float = 60.0
    pod_warmup_s: float = 30.0
    scale_up: ScalingRules = ScalingRules(0, 2, 100, 60)
    scale_down: ScalingRules = ScalingRules(300, 1, 10, 60)

    @property
    def target_utilization(self) -> float:
        return 1.0 - self.target_free_ratio


@dataclass(frozen=True)
class ModelSpec:
    name: str | None = None
    image_path: str | None = None  # a path inside the server image
    pvc_claim: str | None = None  # or a PersistentVolumeClaim...
    pvc_path: str = ""  # ...and the model's path inside it


@dataclass(frozen=True)
class ServiceSpec:
    type: str = "ClusterIP"
    port: int = 50051  # gRPC
    http_port: int = 8000  # the OpenAI-compatible HTTP API
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LifecycleSpec:
    """How long a pod may take to start, and how it stops without cutting streams."""

    startup_timeout_s: int = 600  # the model loads (and on a first start converts)
    drain_s: int = 30  # in-flight requests' time after SIGTERM: `serve --grace-period`
    pre_stop_sleep_s: int = 5  # serving on while endpoints drop the terminating pod


@dataclass(frozen=True)
class KVEventsSpec:
    """KV-cache events for prefix-aware routers (`pagedinfer serve --kv-events-config`)."""

    enabled: bool = True
    port: int = KV_EVENTS_PORT  # the pods' PUB socket, bound on every interface
    replay_port: int | None = None  # the pods' ROUTER socket for replays
    topic: str | None = None  # None: kv@$(POD_IP)@<model name>, the form llm-d parses


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec = ModelSpec()
    image: str | None = None
    image_pull_policy: str | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    accelerator_resource: str = "nvidia.com/gpu"
    accelerator_count: int = 0
    engine: Mapping[str, Any] = field(default_factory=dict)  # camelCase, as in the CRD
    replicas: int | None = None
    autoscaling: AutoscalingSpec | None = None
    service: ServiceSpec = ServiceSpec()
    lifecycle: LifecycleSpec = LifecycleSpec()
    template: Mapping[str, Any] = field(default_factory=dict)
    kv_events: KVEventsSpec | None = None


def _rules(raw: Mapping[str, Any], default: ScalingRules) -> ScalingRules:
    return ScalingRules(
        stabilization_window_s=float(
            raw.get("stabilizationWindowSeconds", default.stabilization_window_s)
        ),
        pods=int(raw.get("pods", default.pods)),
        percent=int(raw.get("percent", default.percent)),
        period_s=float(raw.get("periodSeconds", default.period_s)),
    )


def parse_autoscaling(raw: Mapping[str, Any]) -> AutoscalingSpec:
    d = AutoscalingSpec()
    min_replicas = int(raw.get("minReplicas", d.min_replicas))
    return AutoscalingSpec(
        min_replicas=min_replicas,
        max_replicas=int(raw.get("maxReplicas", min_replicas)),
        target_free_ratio=float(raw.get("targetFreeBlockRatio", d.target_free_ratio)),
        tolerance=float(raw.get("tolerance", d.tolerance)),
        sync_period_s=float(raw.get("syncPeriodSeconds", d.sync_period_s)),
        scrape_timeout_s=float(raw.get("scrapeTimeoutSeconds", d.scrape_timeout_s)),
        metric_staleness_s=float(raw.get("metricStalenessSeconds", d.metric_staleness_s)),
        pod_warmup_s=float(raw.get("podWarmupSeconds", d.pod_warmup_s)),
        scale_up=_rules(raw.get("scaleUp") or {}, d.scale_up),
        scale_down=_rules(raw.get("scaleDown") or {}, d.scale_down),
    )


def parse_spec(raw: Mapping[str, Any]) -> InferenceServiceSpec:
    """The CR's `.spec` as a typed record; absent fields take the CRD's defaults."""
    model = raw.get("model") or {}
    source = model.get("source") or {}
    pvc = source.get("pvc") or {}
    accelerator = raw.get("accelerator") or {}
    service = raw.get("service") or {}
    lifecycle = raw.get("lifecycle") or {}
    autoscaling = raw.get("autoscaling")
    replicas = raw.get("replicas")
    kv_events = raw.get("kvEvents")
    return InferenceServiceSpec(
        model=ModelSpec(
            name=model.get("name"),
            image_path=(source.get("image") or {}).get("path"),
            pvc_claim=pvc.get("claimName"),
            pvc_path=pvc.get("path", ""),
        ),
        image=raw.get("image"),
        image_pull_policy=raw.get("imagePullPolicy"),
        resources=dict(raw.get("resources") or {}),
        accelerator_resource=accelerator.get("resourceName", "nvidia.com/gpu"),
        accelerator_count=int(accelerator.get("count", 0)),
        engine=dict(raw.get("engine") or {}),
        replicas=None if replicas is None else int(replicas),
        autoscaling=None if autoscaling is None else parse_autoscaling(autoscaling),
        service=ServiceSpec(
            type=service.get("type", "ClusterIP"),
            port=int(service.get("port", ServiceSpec.port)),
            http_port=int(service.get("httpPort", ServiceSpec.http_port)),
            annotations=dict(service.get("annotations") or {}),
        ),
        lifecycle=LifecycleSpec(
            startup_timeout_s=int(
                lifecycle.get("startupTimeoutSeconds", LifecycleSpec.startup_timeout_s)
            ),
            drain_s=int(lifecycle.get("drainSeconds", LifecycleSpec.drain_s)),
            pre_stop_sleep_s=int(
                lifecycle.get("preStopSleepSeconds", LifecycleSpec.pre_stop_sleep_s)
            ),
        ),
        template=dict(raw.get("template") or {}),
        kv_events=None if kv_events is None else parse_kv_events(kv_events),
    )


def parse_kv_events(raw: Mapping[str, Any]) -> KVEventsSpec:
    replay = raw.get("replayPort")
    return KVEventsSpec(
        enabled=bool(raw.get("enabled", True)),
        port=int(raw.get("port", KV_EVENTS_PORT)),
        replay_port=None if replay is None else int(replay),
        topic=raw.get("topic"),
    )


def validation_errors(body: Mapping[str, Any]) -> list[str]:
    """The CRD's CEL rules, in Python: each broken rule as 'field: message'.

    A 1.29+ API server refuses such objects already; this guards against servers that
    skip CEL validation, so that the operator refuses rather than guesses.
    """
    errors = []
    name = (body.get("metadata") or {}).get("name", "")
    if len(name) > 63 or not DNS_LABEL.fullmatch(name):
        errors.append("metadata.name: must be a DNS-1035 label of at most 63 characters")
    raw = body.get("spec") or {}
    if "replicas" in raw and "autoscaling" in raw:
        errors.append("spec.replicas: replicas and autoscaling are mutually exclusive")
    autoscaling = raw.get("autoscaling")
    if autoscaling is not None:
        if "maxReplicas" not in autoscaling:
            errors.append("spec.autoscaling.maxReplicas: required")
        elif autoscaling.get("minReplicas", 1) > autoscaling["maxReplicas"]:
            errors.append("spec.autoscaling.minReplicas: must not exceed maxReplicas")
    source = (raw.get("model") or {}).get("source")
    if source is not None and ("image" in source) == ("pvc" in source):
        errors.append("spec.model.source: set exactly one of source.image and source.pvc")
    path = ((source or {}).get("pvc") or {}).get("path", "")
    if path.startswith("/") or ".." in path:
        errors.append("spec.model.source.pvc.path: must be relative and must not contain '..'")
    service = parse_spec(raw).service
    if service.http_port == service.port:
        errors.append("spec.service.httpPort: must differ from the gRPC port")
    if METRICS_PORT in (service.port, service.http_port):
        errors.append(f"spec.service: port and httpPort must not be {METRICS_PORT} (metrics)")
    kv_events = raw.get("kvEvents")
    if kv_events is not None:
        events = parse_kv_events(kv_events)
        if events.enabled and not (raw.get("model") or {}).get("name"):
            errors.append(
                "spec.kvEvents: kvEvents needs model.name, the model name routers key the events by"
            )
        if events.replay_port is not None and events.replay_port == events.port:
            errors.append("spec.kvEvents.replayPort: must differ from port")
        if {events.port, events.replay_port} & set(SERVER_PORTS):
            errors.append(
                "spec.kvEvents.port: port and replayPort must not be 8000, 50051 or 9464 "
                "(the server's own ports)"
            )
    engine = raw.get("engine") or {}
    owned = [a for a in engine.get("extraArgs", []) if OPERATOR_FLAGS.match(a)]
    if owned:
        errors.append(
            "spec.engine.extraArgs: must not set --host, --port, --http-port, --metrics-port "
            f"or --grace-period, which the operator sets (got {', '.join(owned)})"
        )
    if engine.get("maxModelLen", 1 << 30) < engine.get("blockSize", 0):
        errors.append("spec.engine.maxModelLen: must be at least blockSize")
    lookup_min = engine.get("promptLookupMin", SERVER_PROMPT_LOOKUP_MIN)
    lookup_max = engine.get("promptLookupMax", SERVER_PROMPT_LOOKUP_MAX)
    if lookup_min > lookup_max:
        errors.append(
            f"spec.engine.promptLookupMin: must not exceed promptLookupMax "
            f"({lookup_min} > {lookup_max})"
        )
    return errors
