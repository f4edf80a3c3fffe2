"""spec.kvEvents: the pods publish KV-cache events that the server accepts, on the ports
the spec names, with a topic naming the pod and the model as llm-d's router reads it."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
from crd_tools import admission_errors, apply_defaults, openapi_schema

from pagedinfer.operator.resources import build_deployment
from pagedinfer.service.config import EngineConfig
from pagedinfer.service.kv_events import KVEventsConfig


def cr(spec: dict) -> dict:
    body = {
        "apiVersion": "serving.pagedinfer.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm", "namespace": "ns", "uid": "uid-1"},
        "spec": spec,
    }
    return apply_defaults(openapi_schema(), body)


def server(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def kv_events_flag(container: dict) -> str | None:
    args = container["args"]
    return args[args.index("--kv-events-config") + 1] if "--kv-events-config" in args else None


def test_kv_events_publish_on_the_pod_port_with_a_topic_naming_pod_and_model():
    body = cr({"model": {"name": "smollm2"}, "kvEvents": {"replayPort": 5558}})
    assert admission_errors(body) == []
    deployment = build_deployment(body, 2, "img")
    kubernetes_validate.validate(
        deployment, kubernetes_validate.utils.latest_version(), strict=True
    )
    container = server(deployment)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["kv-events"], ports["kv-replay"]) == (5557, 5558)
    # POD_IP comes first, so that the kubelet expands $(POD_IP) in the arguments.
    assert container["env"][0] == {
        "name": "POD_IP",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    }
    flag = kv_events_flag(container)
    expanded = flag.replace("$(POD_IP)", "10.1.2.3")
    config = EngineConfig(kv_events_config=expanded).kv_events_config  # the server's parser
    assert config == KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5558",
        topic="kv@10.1.2.3@smollm2",
    )


def test_template_env_follows_pod_ip_and_a_custom_topic_is_kept():
    spec = {
        "model": {"name": "m"},
        "kvEvents": {"port": 6000, "topic": "kv@$(POD_IP)@tenant-m"},
        "template": {"env": [{"name": "HF_HOME", "value": "/tmp"}]},
    }
    container = server(build_deployment(cr(spec), 1, "img"))
    assert [e["name"] for e in container["env"]] == ["POD_IP", "HF_HOME"]
    config = json.loads(kv_events_flag(container))
    assert (config["endpoint"], config["topic"]) == ("tcp://*:6000", "kv@$(POD_IP)@tenant-m")
    assert "replay_endpoint" not in config


@pytest.mark.parametrize("spec", [{}, {"model": {"name": "m"}, "kvEvents": {"enabled": False}}])
def test_without_kv_events_nothing_is_published(spec):
    container = server(build_deployment(cr(spec), 1, "img"))
    assert kv_events_flag(container) is None
    assert "env" not in container
    assert {p["name"] for p in container["ports"]} == {"http", "grpc", "metrics"}
