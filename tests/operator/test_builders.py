"""The Deployment and Service builders: valid Kubernetes objects that run `pagedinfer serve`."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml
from crd_tools import EXAMPLES, apply_defaults, openapi_schema

from pagedinfer.operator.resources import (
    build_deployment,
    build_service,
    grpc_url,
    selector_labels,
    selector_string,
    server_args,
    service_url,
)
from pagedinfer.operator.spec import parse_spec

K8S_VERSIONS = ["1.29", kubernetes_validate.utils.latest_version()]
IMAGE = "pagedinfer:0.1.0"


def cr(spec: dict, name: str = "llm") -> dict:
    body = {
        "apiVersion": "serving.pagedinfer.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "ns", "uid": "uid-1", "labels": {"team": "a"}},
        "spec": spec,
    }
    return apply_defaults(openapi_schema(), body)


def examples() -> list[dict]:
    out = []
    for path in EXAMPLES:
        body = yaml.safe_load(path.read_text())
        body["metadata"].update(namespace="ns", uid="uid-1")
        out.append(apply_defaults(openapi_schema(), body))
    return out


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
@pytest.mark.parametrize("body", examples(), ids=[p.name for p in EXAMPLES])
def test_children_of_every_example_are_valid_objects(body: dict, k8s: str) -> None:
    kubernetes_validate.validate(build_deployment(body, 3, IMAGE), k8s, strict=True)
    kubernetes_validate.validate(build_service(body), k8s, strict=True)


def test_the_deployment_runs_the_server() -> None:
    deployment = build_deployment(cr({"replicas": 2}), 2, IMAGE)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 2
    assert container["image"] == IMAGE
    assert container["command"] == ["pagedinfer"]
    assert container["args"] == [
        "serve",
        "--port",
        "50051",
        "--http-port",
        "8000",
        "--metrics-port",
        "9464",
        "--grace-period",
        "30",
    ]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "http": 8000,
        "grpc": 50051,
        "metrics": 9464,
    }
    assert pod["automountServiceAccountToken"] is False


def test_every_probe_asks_the_http_health_endpoint() -> None:
    container = build_deployment(cr({}), 1, IMAGE)["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
    # Loading the model may take the default 10 minutes before liveness takes over...
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 600
    # ...while a server that stops answering leaves the endpoints within seconds.
    ready = container["readinessProbe"]
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 10
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 30


def test_the_startup_timeout_sets_the_startup_probe() -> None:
    body = cr({"lifecycle": {"startupTimeoutSeconds": 1805}})
    startup = build_deployment(body, 1, IMAGE)["spec"]["template"]["spec"]["containers"][0][
        "startupProbe"
    ]
    # Rounded up: never less time than asked for.
    assert (startup["periodSeconds"], startup["failureThreshold"]) == (10, 181)


@pytest.mark.parametrize(
    ("lifecycle", "drain", "sleep", "grace"),
    [({}, "30", "5", 45), ({"drainSeconds": 120, "preStopSleepSeconds": 15}, "120", "15", 145)],
)
def test_a_deleted_pod_finishes_its_streams_before_it_is_killed(
    lifecycle: dict, drain: str, sleep: str, grace: int
) -> None:
    """preStop sleep (the pod leaves the endpoints while it still serves), then SIGTERM
    and the server's drain (--grace-period), then its exit: all before SIGKILL."""
    pod = build_deployment(cr({"lifecycle": lifecycle}), 1, IMAGE)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[args.index("--grace-period") + 1] == drain
    assert container["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", sleep]}}}
    assert pod["terminationGracePeriodSeconds"] == grace
    assert grace > int(drain) + int(sleep)


def test_the_model_name_is_the_served_model_name() -> None:
    args = server_args(parse_spec({"model": {"name": "llama-3.2-1b"}}))
    assert args[args.index("--served-model-name") + 1] == "llama-3.2-1b"
    assert "--served-model-name" not in server_args(parse_spec({}))


def test_tls_flags_switch_the_probes_and_the_url_to_https() -> None:
    extra = ["--tls-cert=/tls/tls.crt", "--tls-key", "/tls/tls.key"]
    body = cr({"engine": {"extraArgs": extra}})
    container = build_deployment(body, 1, IMAGE)["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
    (http,) = [p for p in build_service(body)["spec"]["ports"] if p["name"] == "http"]
    assert http["appProtocol"] == "https"
    assert service_url(body) == "https://llm.ns.svc:8000"


def test_pods_name_their_engine_for_the_endpoint_picker() -> None:
    labels = build_deployment(cr({}), 1, IMAGE)["spec"]["template"]["metadata"]["labels"]
    assert labels["llm-d.ai/engine-type"] == "pagedinfer"
    # An explicit template label wins; the selector label never moves.
    template = {"metadata": {"labels": {"llm-d.ai/engine-type": "custom"}}}
    labels = build_deployment(cr({"template": template}), 1, IMAGE)["spec"]["template"]["metadata"][
        "labels"
    ]
    assert labels["llm-d.ai/engine-type"] == "custom"


def test_children_are_owned_by_the_inferenceservice() -> None:
    body = cr({})
    for child in (build_deployment(body, 1, IMAGE), build_service(body)):
        assert child["metadata"]["namespace"] == "ns"
        assert child["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "serving.pagedinfer.dev/v1alpha1",
                "kind": "InferenceService",
                "name": "llm",
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


def test_labels_select_exactly_this_services_pods() -> None:
    deployment = build_deployment(cr({}), 1, IMAGE)
    service = build_service(cr({}))
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == selector_labels("llm")
    assert service["spec"]["selector"] == selector_labels("llm")
    assert selector_labels("llm").items() <= template_labels.items()
    assert selector_string("llm") == "serving.pagedinfer.dev/inferenceservice=llm"
    for labels in (
        deployment["metadata"]["labels"],
        template_labels,
        service["metadata"]["labels"],
    ):
        assert labels["app.kubernetes.io/name"] == "pagedinfer"
        assert labels["app.kubernetes.io/instance"] == "llm"
        assert labels["app.kubernetes.io/managed-by"] == "pagedinfer-operator"
        assert labels["team"] == "a"  # the CR's own labels are passed on


def test_the_pod_meets_the_restricted_pod_security_standard() -> None:
    pod = build_deployment(cr({}), 1, IMAGE)["spec"]["template"]["spec"]
    context = pod["containers"][0]["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    # the read-only root still gets a scratch /tmp (Triton and HF caches)
    assert {"name": "tmp", "mountPath": "/tmp"} in pod["containers"][0]["volumeMounts"]


def test_engine_settings_become_server_flags() -> None:
    spec = {
        "engine": {
            "blockSize": 32,
            "kvCacheMemory": "4Gi",
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 1024,
            "maxModelLen": 4096,
            "gpuMemoryUtilization": 0.9,
            "dtype": "bfloat16",
            "enablePrefixCaching": False,
            "extraArgs": ["--seed", "7"],
        }
    }
    args = server_args(parse_spec(spec))
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert flags["--block-size"] == "32"
    assert flags["--kv-cache-memory"] == "4Gi"
    assert flags["--max-num-seqs"] == "64"
    assert flags["--max-num-batched-tokens"] == "1024"
    assert flags["--max-model-len"] == "4096"
    assert flags["--gpu-memory-utilization"] == "0.9"
    assert flags["--dtype"] == "bfloat16"
    assert "--no-prefix-caching" in args
    assert args[-2:] == ["--seed", "7"]


def test_speculative_decoding_settings_become_server_flags() -> None:
    engine = {
        "numSpeculativeTokens": 4,
        "promptLookupMin": 2,
        "promptLookupMax": 5,
        "speculativeMaxRunning": 8,
    }
    args = server_args(parse_spec({"engine": engine}))
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert flags["--num-speculative-tokens"] == "4"
    assert flags["--prompt-lookup-min"] == "2"
    assert flags["--prompt-lookup-max"] == "5"
    assert flags["--speculative-max-running"] == "8"


def test_speculative_decoding_off_is_passed_on_and_unset_is_left_to_the_server() -> None:
    off = server_args(parse_spec({"engine": {"numSpeculativeTokens": 0}}))
    assert off[off.index("--num-speculative-tokens") + 1] == "0"
    unset = server_args(parse_spec({"engine": {"maxNumSeqs": 8}}))
    for flag in (
        "--num-speculative-tokens",
        "--prompt-lookup-min",
        "--prompt-lookup-max",
        "--speculative-max-running",
    ):
        assert flag not in unset


def test_a_pvc_model_is_mounted_read_only() -> None:
    body = cr({"model": {"source": {"pvc": {"claimName": "models", "path": "llama"}}}})
    pod = build_deployment(body, 1, IMAGE)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["args"][-2:] == ["--model", "/models/llama"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in pod["volumes"]


def test_an_image_model_is_passed_by_path() -> None:
    body = cr({"image": "mine:1", "model": {"source": {"image": {"path": "/opt/m"}}}})
    container = build_deployment(body, 1, IMAGE)["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "mine:1"
    assert container["args"][-2:] == ["--model", "/opt/m"]


def test_accelerators_are_requested_and_limited() -> None:
    body = cr(
        {
            "accelerator": {"count": 2},
            "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "8Gi"}},
        }
    )
    resources = build_deployment(body, 1, IMAGE)["spec"]["template"]["spec"]["containers"][0][
        "resources"
    ]
    assert resources == {
        "requests": {"cpu": "2", "nvidia.com/gpu": 2},
        "limits": {"memory": "8Gi", "nvidia.com/gpu": 2},
    }


def test_pod_template_overrides_are_applied() -> None:
    template = {
        "metadata": {"labels": {"tier": "gold"}, "annotations": {"note": "x"}},
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "gpu", "operator": "Exists"}],
        "priorityClassName": "high",
        "serviceAccountName": "llm",
        "imagePullSecrets": [{"name": "regcred"}],
    }
    body = cr({"template": template, "model": {"name": "m1"}})
    deployment = build_deployment(body, 1, IMAGE)
    meta = deployment["spec"]["template"]["metadata"]
    pod = deployment["spec"]["template"]["spec"]
    assert meta["labels"]["tier"] == "gold"
    assert meta["annotations"] == {"note": "x", "serving.pagedinfer.dev/model": "m1"}
    assert pod["containers"][0]["env"] == template["env"]
    for key in ("nodeSelector", "tolerations", "priorityClassName", "imagePullSecrets"):
        assert pod[key] == template[key]
    assert pod["serviceAccountName"] == "llm"
    for k8s in K8S_VERSIONS:
        kubernetes_validate.validate(deployment, k8s, strict=True)


def test_overrides_cannot_break_the_selector() -> None:
    template = {"metadata": {"labels": {"serving.pagedinfer.dev/inferenceservice": "other"}}}
    deployment = build_deployment(cr({"template": template}), 1, IMAGE)
    assert deployment["spec"]["template"]["metadata"]["labels"][
        "serving.pagedinfer.dev/inferenceservice"
    ] == ("llm")


def test_the_service_exposes_http_grpc_and_metrics() -> None:
    service = build_service(cr({}))
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {"http": (8000, "http"), "grpc": (50051, "grpc"), "metrics": (9464, "metrics")}
    appprotocols = {p["name"]: p.get("appProtocol") for p in service["spec"]["ports"]}
    assert appprotocols == {"http": "http", "grpc": "kubernetes.io/h2c", "metrics": None}
    assert service_url(cr({})) == "http://llm.ns.svc:8000"
    assert grpc_url(cr({})) == "grpc://llm.ns.svc:50051"


def test_the_service_ports_and_type_are_configurable() -> None:
    service_spec = {"type": "LoadBalancer", "port": 8001, "httpPort": 80, "annotations": {"a": "b"}}
    body = cr({"service": service_spec})
    service = build_service(body)
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["metadata"]["annotations"] == {"a": "b"}
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {"http": (80, "http"), "grpc": (8001, "grpc"), "metrics": (9464, "metrics")}
    assert service_url(body) == "http://llm.ns.svc:80"
    assert grpc_url(body) == "grpc://llm.ns.svc:8001"
