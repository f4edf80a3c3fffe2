"""`helm test` check of a pagedinfer release, run inside the cluster by the test hook pod.

It passes when the operator's Deployment is available and the InferenceService API is
served, and, when the chart's example InferenceService is on, when that service reports
a ready replica, its HTTP endpoint (status.url) answers /health with 200 and lists the
model on /v1/models, and its gRPC endpoint (status.grpcUrl) answers the standard health
check with SERVING. Only the standard library talks to the API server and the HTTP
endpoint; grpc comes with the image.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
API_SERVER = "https://kubernetes.default.svc"
GROUP_VERSION = "serving.pagedinfer.dev/v1alpha1"


def api_get(path: str) -> dict:
    with open(f"{SERVICE_ACCOUNT}/token") as f:
        token = f.read().strip()
    context = ssl.create_default_context(cafile=f"{SERVICE_ACCOUNT}/ca.crt")
    request = urllib.request.Request(
        API_SERVER + path, headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        return json.load(response)


def wait_for(what: str, check: Callable[[], bool], deadline: float) -> None:
    last_error = "not yet"
    while time.monotonic() < deadline:
        try:
            if check():
                print(f"ok: {what}", flush=True)
                return
        except Exception as exc:  # the API or the service is not there yet: retry
            last_error = f"{type(exc).__name__}: {exc}"
        time.sleep(3)
    sys.exit(f"FAILED: {what} ({last_error})")


def http_url(isvc: dict) -> str:
    """The service's OpenAI-compatible HTTP endpoint, status.url, without a final /."""
    return (isvc.get("status", {}).get("url") or "").rstrip("/")


def grpc_target(isvc: dict) -> str:
    """host:port of the service's gRPC endpoint: status.grpcUrl without its scheme."""
    url = isvc.get("status", {}).get("grpcUrl") or ""
    return url.split("://", 1)[-1].rstrip("/")


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:  # 503 while loading or draining
        return exc.code, exc.read()


def http_healthy(base: str) -> bool:
    return http_get(f"{base}/health")[0] == 200


def serves_model(base: str, model: str) -> bool:
    """/v1/models lists `model` (any model when the spec names none)."""
    status, body = http_get(f"{base}/v1/models")
    ids = [m.get("id") for m in json.loads(body).get("data", [])] if status == 200 else []
    return bool(ids) and (not model or model in ids)


def grpc_serving(target: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main() -> None:
    namespace = os.environ["RELEASE_NAMESPACE"]
    operator = os.environ["OPERATOR_DEPLOYMENT"]
    example = os.environ.get("EXAMPLE_NAME", "")
    deadline = time.monotonic() + float(os.environ.get("TIMEOUT_SECONDS", "300"))

    wait_for(
        f"operator Deployment {operator} available",
        lambda: (
            api_get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{operator}")
            .get("status", {})
            .get("availableReplicas", 0)
            >= 1
        ),
        deadline,
    )
    isvcs = f"/apis/{GROUP_VERSION}/namespaces/{namespace}/inferenceservices"
    wait_for("InferenceService API served", lambda: "items" in api_get(isvcs), deadline)
    if not example:
        return
    wait_for(
        f"InferenceService {example} has a ready replica",
        lambda: api_get(f"{isvcs}/{example}").get("status", {}).get("readyReplicas", 0) >= 1,
        deadline,
    )
    isvc = api_get(f"{isvcs}/{example}")
    base, model = http_url(isvc), isvc.get("spec", {}).get("model", {}).get("name", "")
    wait_for(f"GET {base}/health is 200", lambda: http_healthy(base), deadline)
    wait_for(
        f"GET {base}/v1/models lists {model or 'a model'}",
        lambda: serves_model(base, model),
        deadline,
    )
    target = grpc_target(isvc)
    wait_for(f"gRPC health of {target} is SERVING", lambda: grpc_serving(target), deadline)


if __name__ == "__main__":
    main()
