"""The Deployment and the Service of an InferenceService, built as plain manifests.

Pure functions of the CR's body: no API calls. Both children carry an owner reference
to the CR (so deleting the CR deletes them), the standard `app.kubernetes.io` labels,
and a selector label naming their InferenceService.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import kopf

from pagedinfer.operator.spec import (
    DEFAULT_REPLICAS,
    GROUP,
    METRICS_PORT,
    InferenceServiceSpec,
    KVEventsSpec,
    parse_spec,
)

# The container's ports; the Service maps its own (spec.service) onto them by name.
HTTP_PORT = 8000
GRPC_PORT = 50051
HEALTH_PATH = "/health"
SERVER_CONTAINER = "server"
MODEL_VOLUME = "model"
MODEL_MOUNT = "/models"
MANAGED_BY = "pagedinfer-operator"
INSTANCE_LABEL = f"{GROUP}/inferenceservice"
MODEL_ANNOTATION = f"{GROUP}/model"
# The endpoint picker of the Gateway API Inference Extension reads this pod label to pick
# the metric names it scrapes (see examples/inferencepool.yaml); an engine it does not
# know falls back to its default one, vLLM's names, which pagedinfer exports too.
ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
ENGINE_TYPE = "pagedinfer"
STARTUP_PROBE_PERIOD_S = 10
# After drainSeconds the server cancels what is left and exits; this is its time to do so
# before the kubelet's SIGKILL.
EXIT_MARGIN_S = 10

# The restricted Pod Security Standard; the image runs as uid 10001.
POD_SECURITY = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}

# `pagedinfer serve` flag of each spec.engine field.
ENGINE_FLAGS = {
    "blockSize": "--block-size",
    "kvCacheMemory": "--kv-cache-memory",
    "numGpuBlocks": "--num-gpu-blocks",
    "gpuMemoryUtilization": "--gpu-memory-utilization",
    "maxNumSeqs": "--max-num-seqs",
    "maxNumBatchedTokens": "--max-num-batched-tokens",
    "maxModelLen": "--max-model-len",
    "dtype": "--dtype",
    "numSpeculativeTokens": "--num-speculative-tokens",
    "promptLookupMin": "--prompt-lookup-min",
    "promptLookupMax": "--prompt-lookup-max",
    "speculativeMaxRunning": "--speculative-max-running",
}


def selector_labels(name: str) -> dict[str, str]:
    """The labels that pick one InferenceService's pods."""
    return {INSTANCE_LABEL: name}


def standard_labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pagedinfer",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "server",
        "app.kubernetes.io/part-of": "pagedinfer",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(name),
    }


def selector_string(name: str) -> str:
    """The pod selector as `kubectl get -l` and the scale subresource write it."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def deployment_replicas(spec: InferenceServiceSpec, current: int | None) -> int:
    """The replicas to write into the Deployment on reconciliation. With autoscaling the
    autoscaler owns the count: keep the current one, only brought within [min, max]."""
    if spec.autoscaling is None:
        return DEFAULT_REPLICAS if spec.replicas is None else spec.replicas
    policy = spec.autoscaling
    start = policy.min_replicas if current is None else current
    return min(max(start, policy.min_replicas), policy.max_replicas)


def server_args(spec: InferenceServiceSpec) -> list[str]:
    args = [
        "serve",
        "--port",
        str(GRPC_PORT),
        "--http-port",
        str(HTTP_PORT),
        "--metrics-port",
        str(METRICS_PORT),
        "--grace-period",
        str(spec.lifecycle.drain_s),
    ]
    model = spec.model
    if model.name:
        # The name clients put in `model`, and the `model_name` label of the vllm:* series.
        args += ["--served-model-name", model.name]
    if model.image_path:
        args += ["--model", model.image_path]
    elif model.pvc_claim:
        args += ["--model", f"{MODEL_MOUNT}/{model.pvc_path}".rstrip("/")]
    for key, flag in ENGINE_FLAGS.items():
        if key in spec.engine:
            args += [flag, str(spec.engine[key])]
    if spec.engine.get("enablePrefixCaching") is False:
        args.append("--no-prefix-caching")
    events = kv_events(spec)
    if events is not None:
        args += ["--kv-events-config", kv_events_config(events, spec.model.name or "")]
    return args + list(spec.engine.get("extraArgs", []))


def kv_events(spec: InferenceServiceSpec) -> KVEventsSpec | None:
    """The KV event settings when events are on, else None."""
    events = spec.kv_events
    return events if events is not None and events.enabled else None


def kv_events_config(events: KVEventsSpec, model_name: str) -> str:
    """`--kv-events-config` JSON: a PUB socket bound on every interface, so that the
    router connects to each pod, and a topic naming the pod and the model, as llm-d's
    router reads it (the kubelet expands $(POD_IP) from the container's env)."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events.port}",
        "topic": events.topic or f"kv@$(POD_IP)@{model_name}",
    }
    if events.replay_port is not None:
        config["replay_endpoint"] = f"tcp://*:{events.replay_port}"
    return json.dumps(config, separators=(",", ":"))


def container_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    resources = {k: dict(v) for k, v in spec.resources.items() if v}
    if spec.accelerator_count:
        # Extended resources must be equal in requests and limits.
        for kind in ("requests", "limits"):
            resources.setdefault(kind, {})[spec.accelerator_resource] = spec.accelerator_count
    return resources


def uses_tls(spec: InferenceServiceSpec) -> bool:
    """Whether the server's extra flags turn TLS on (its HTTP port then speaks HTTPS)."""
    return any(
        a == "--tls-cert" or a.startswith("--tls-cert=") for a in spec.engine.get("extraArgs", [])
    )


def _health_probe(spec: InferenceServiceSpec, period: int, failures: int) -> dict[str, Any]:
    """GET /health on the HTTP port: 200 while serving, 503 while loading or draining."""
    scheme = "HTTPS" if uses_tls(spec) else "HTTP"
    return {
        "httpGet": {"path": HEALTH_PATH, "port": "http", "scheme": scheme},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def termination_grace_period(spec: InferenceServiceSpec) -> int:
    """Seconds between the pod's deletion and SIGKILL: the preStop sleep, the server's
    drain of in-flight requests after SIGTERM, and its exit."""
    return spec.lifecycle.pre_stop_sleep_s + spec.lifecycle.drain_s + EXIT_MARGIN_S


def build_deployment(body: Mapping[str, Any], replicas: int, default_image: str) -> dict[str, Any]:
    """The server Deployment of the InferenceService `body`, with `replicas` pods."""
    name = body["metadata"]["name"]
    spec = parse_spec(body.get("spec") or {})
    template = spec.template
    overrides = template.get("metadata") or {}
    annotations = dict(overrides.get("annotations") or {})
    if spec.model.name:
        annotations[MODEL_ANNOTATION] = spec.model.name

    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    if spec.model.pvc_claim:
        volumes.append(
            {
                "name": MODEL_VOLUME,
                "persistentVolumeClaim": {"claimName": spec.model.pvc_claim, "readOnly": True},
            }
        )
        mounts.append({"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True})

    container: dict[str, Any] = {
        "name": SERVER_CONTAINER,
        "image": spec.image or default_image,
        "command": ["pagedinfer"],
        "args": server_args(spec),
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        # /health answers 503 until the model is loaded: the startup probe waits for it
        # up to spec.lifecycle.startupTimeoutSeconds before liveness takes over. The
        # kubelet stops liveness and startup probes once the pod is being deleted, so a
        # draining server's 503 only takes it out of the endpoints.
        "startupProbe": _health_probe(
            spec,
            period=STARTUP_PROBE_PERIOD_S,
            failures=math.ceil(spec.lifecycle.startup_timeout_s / STARTUP_PROBE_PERIOD_S),
        ),
        "readinessProbe": _health_probe(spec, period=5, failures=2),
        "livenessProbe": _health_probe(spec, period=10, failures=3),
        # Endpoints, gateways and endpoint pickers learn of a deletion a few seconds late:
        # keep serving meanwhile, so that no new request lands on a server that has
        # stopped admitting. SIGTERM follows, and the server drains (--grace-period).
        "lifecycle": {
            "preStop": {"exec": {"command": ["sleep", str(spec.lifecycle.pre_stop_sleep_s)]}}
        },
        "resources": container_resources(spec),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    env = [dict(e) for e in template.get("env") or []]
    events = kv_events(spec)
    if events is not None:
        # Defined first: $(POD_IP) in the args and in later variables expands from it.
        env.insert(0, {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        container["ports"].append(
            {"name": "kv-events", "containerPort": events.port, "protocol": "TCP"}
        )
        if events.replay_port is not None:
            container["ports"].append(
                {"name": "kv-replay", "containerPort": events.replay_port, "protocol": "TCP"}
            )
    if env:
        container["env"] = env

    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": POD_SECURITY,
        # The server never talks to the API server.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_period(spec),
    }
    for key in (
        "nodeSelector",
        "tolerations",
        "affinity",
        "priorityClassName",
        "runtimeClassName",
        "serviceAccountName",
        "imagePullSecrets",
    ):
        if template.get(key):
            pod_spec[key] = template[key]

    labels = standard_labels(name)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "template": {
                "metadata": {
                    "labels": {
                        ENGINE_TYPE_LABEL: ENGINE_TYPE,
                        **(overrides.get("labels") or {}),
                        **labels,
                    },
                    "annotations": annotations,
                },
                "spec": pod_spec,
            },
        },
    }
    kopf.adopt(deployment, owner=dict(body), nested=["spec.template"])
    return deployment


def build_service(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Service in front of the InferenceService's pods: HTTP, gRPC, and metrics."""
    name = body["metadata"]["name"]
    spec = parse_spec(body.get("spec") or {})
    annotations = dict(spec.service.annotations)
    if spec.model.name:
        annotations[MODEL_ANNOTATION] = spec.model.name
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": standard_labels(name), "annotations": annotations},
        "spec": {
            "type": spec.service.type,
            "selector": selector_labels(name),
            "ports": [
                {
                    "name": "http",
                    "port": spec.service.http_port,
                    "targetPort": "http",
                    "protocol": "TCP",
                    "appProtocol": "https" if uses_tls(spec) else "http",
                },
                {
                    "name": "grpc",
                    "port": spec.service.port,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",
                },
                {
                    "name": "metrics",
                    "port": METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }
    kopf.adopt(service, owner=dict(body))
    return service


def service_url(body: Mapping[str, Any]) -> str:
    """The in-cluster address of the OpenAI-compatible HTTP API."""
    meta = body["metadata"]
    spec = parse_spec(body.get("spec") or {})
    scheme = "https" if uses_tls(spec) else "http"
    return f"{scheme}://{meta['name']}.{meta['namespace']}.svc:{spec.service.http_port}"


def grpc_url(body: Mapping[str, Any]) -> str:
    """The in-cluster address of the gRPC API."""
    meta = body["metadata"]
    port = parse_spec(body.get("spec") or {}).service.port
    return f"grpc://{meta['name']}.{meta['namespace']}.svc:{port}"
