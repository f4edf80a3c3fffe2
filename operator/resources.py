"""The Deployment and the Service of an InferenceService, built as plain manifests.

Pure functions of the CR's body: no API calls. Both children carry an owner reference
to the CR (so deleting the CR deletes them), the standard `app.kubernetes.io` labels,
and a selector label naming their InferenceService.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from pagedinfer.operator.spec import DEFAULT_REPLICAS, GROUP, InferenceServiceSpec, parse_spec

GRPC_PORT = 50051
METRICS_PORT = 9464
SERVER_CONTAINER = "server"
MODEL_VOLUME = "model"
MODEL_MOUNT = "/models"
MANAGED_BY = "pagedinfer-operator"
INSTANCE_LABEL = f"{GROUP}/inferenceservice"
MODEL_ANNOTATION = f"{GROUP}/model"

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
    args = ["serve", "--port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT)]
    model = spec.model
    if model.image_path:
        args += ["--model", model.image_path]
    elif model.pvc_claim:
        args += ["--model", f"{MODEL_MOUNT}/{model.pvc_path}".rstrip("/")]
    for key, flag in ENGINE_FLAGS.items():
        if key in spec.engine:
            args += [flag, str(spec.engine[key])]
    if spec.engine.get("enablePrefixCaching") is False:
        args.append("--no-prefix-caching")
    return args + list(spec.engine.get("extraArgs", []))


def container_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    resources = {k: dict(v) for k, v in spec.resources.items() if v}
    if spec.accelerator_count:
        # Extended resources must be equal in requests and limits.
        for kind in ("requests", "limits"):
            resources.setdefault(kind, {})[spec.accelerator_resource] = spec.accelerator_count
    return resources


def _grpc_probe(period: int, failures: int) -> dict[str, Any]:
    return {
        "grpc": {"port": GRPC_PORT},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


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
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        # Loading (and on first start converting) the model takes a while: the startup
        # probe allows 10 minutes before liveness takes over.
        "startupProbe": _grpc_probe(period=10, failures=60),
        "readinessProbe": _grpc_probe(period=5, failures=2),
        "livenessProbe": _grpc_probe(period=10, failures=3),
        "resources": container_resources(spec),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if template.get("env"):
        container["env"] = [dict(e) for e in template["env"]]

    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": POD_SECURITY,
        # The server never talks to the API server.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # The server drains in-flight calls for 25 s after SIGTERM.
        "terminationGracePeriodSeconds": 30,
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
                    "labels": {**(overrides.get("labels") or {}), **labels},
                    "annotations": annotations,
                },
                "spec": pod_spec,
            },
        },
    }
    kopf.adopt(deployment, owner=dict(body), nested=["spec.template"])
    return deployment


def build_service(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Service in front of the InferenceService's pods: gRPC, and metrics."""
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
    """The in-cluster gRPC address clients use."""
    meta = body["metadata"]
    port = parse_spec(body.get("spec") or {}).service.port
    return f"grpc://{meta['name']}.{meta['namespace']}.svc:{port}"
