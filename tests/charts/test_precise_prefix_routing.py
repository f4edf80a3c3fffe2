"""Precise prefix-cache routing with llm-d's endpoint picker on pagedinfer's KV-cache
events: examples/inferencepool-precise-prefix.yaml (and the chart's InferencePool with
inferencePool.precisePrefixCache.enabled), checked offline.

Every object passes its schema (kubernetes-validate for built-in kinds, the vendored
InferencePool CRD, our own CRD). The picker's configuration is checked against
llm-d-router v0.10.0's Go types (vendor_llmd/, versions in its README), read here from
the structs' `json` tags and decoded as the picker decodes plugin parameters: strictly,
an unknown field refused. Then what no schema sees: the picker subscribes to the port
the pods publish on, its topic filter takes their topic, and it asks the pods' own
Service for token ids.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from chart_tools import (
    CHART_DIR,
    EXAMPLES_DIR,
    KUBE_VERSIONS,
    load_all,
    load_crd,
    render,
    vendored_crd,
)
from chart_tools import CustomResources as _CustomResources

from pagedinfer.operator import resources
from pagedinfer.operator.spec import KIND

VENDOR = Path(__file__).parent / "vendor_llmd"
EXAMPLE = EXAMPLES_DIR / "inferencepool-precise-prefix.yaml"
BUILT_IN = {"v1", "apps/v1", "rbac.authorization.k8s.io/v1"}
# Each plugin type the configuration uses whose parameters have a vendored Go type:
# (the file declaring the type name, the Go struct of its parameters).
PARAMETER_TYPES = {
    "precise-prefix-cache-producer": ("preciseprefixcache_producer.go", "PluginConfig"),
    "prefix-cache-scorer": ("prefix_scorer_plugin.go", "Config"),
    "token-producer": ("tokenizer.go", "tokenizerPluginConfig"),
}

pytest.importorskip("celpy", reason="cel-python evaluates the CRDs' CEL rules")


# -- Go struct types, from the vendored sources ------------------------------------------

GoTypes = dict[str, dict[str, dict[str, str]]]  # package -> struct -> json name -> Go type
STRUCT = re.compile(r"^type (\w+) struct \{\n(.*?)^\}", re.MULTILINE | re.DOTALL)
FIELD = re.compile(r'^\s*(?:(\w+)\s+)?([\w.*\[\]]+)\s+`json:"([^"]*)"', re.MULTILINE)


def go_types() -> GoTypes:
    types: GoTypes = {}
    for path in VENDOR.glob("*.go"):
        text = path.read_text()
        package = re.search(r"^package (\w+)", text, re.MULTILINE).group(1)
        for name, body in STRUCT.findall(text):
            fields = types.setdefault(package, {}).setdefault(name, {})
            for field_name, go_type, tag in FIELD.findall(body):
                json_name = tag.split(",")[0]
                if ",inline" in tag and go_type == "metav1.TypeMeta":
                    fields.update(apiVersion="string", kind="string")
                elif json_name != "-":
                    fields[json_name or field_name] = go_type
    return types


def go_errors(types: GoTypes, package: str, go_type: str, value: Any, path: str) -> list[str]:
    """What a strict decoding of `value` into `go_type` refuses, each naming its path."""
    go_type = go_type.lstrip("*")
    if go_type.startswith("[]"):
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        return [e for i, v in enumerate(value) for e in go_errors(types, package, go_type[2:], v, f"{path}[{i}]")]  # fmt: skip
    scalars = {
        "string": str,
        "bool": bool,
        "int": int,
        "int32": int,
        "int64": int,
        "float64": (int, float),
    }
    if go_type in scalars:
        ok = isinstance(value, scalars[go_type]) and not (
            go_type != "bool" and isinstance(value, bool)
        )
        return [] if ok else [f"{path}: expected {go_type}, got {value!r}"]
    if go_type in ("json.RawMessage", "metav1.Duration"):
        return []
    if "." in go_type:
        package, go_type = go_type.split(".", 1)
    fields = types.get(package, {}).get(go_type)
    assert fields is not None, f"{path}: no vendored Go type {package}.{go_type}"
    if not isinstance(value, dict):
        return [f"{path}: expected an object ({go_type})"]
    errors = []
    for key, item in value.items():
        if key not in fields:
            errors.append(f'{path}: json: unknown field "{key}"')
        else:
            errors += go_errors(types, package, fields[key], item, f"{path}.{key}")
    return errors


def config_errors(config: dict) -> list[str]:
    """The picker's errors for its whole configuration file."""
    types = go_types()
    errors = go_errors(types, "v1alpha1", "EndpointPickerConfig", config, "config")
    for i, plugin in enumerate(config.get("plugins", [])):
        if plugin["type"] in PARAMETER_TYPES and "parameters" in plugin:
            file, struct = PARAMETER_TYPES[plugin["type"]]
            package = re.search(r"^package (\w+)", (VENDOR / file).read_text(), re.M).group(1)
            errors += go_errors(types, package, struct, plugin["parameters"], f"plugins[{i}]")
    return errors


# -- the objects -------------------------------------------------------------------------


def picker_config(objects) -> dict:
    (config_map,) = [
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-epp")
    ]
    return yaml.safe_load(config_map["data"]["config.yaml"])


def plugin(config: dict, plugin_type: str) -> dict:
    (found,) = [p for p in config["plugins"] if p["type"] == plugin_type]
    return found.get("parameters", {})


def chart_objects() -> tuple[dict, ...]:
    """The chart's example InferenceService, pool and picker with precise routing on."""
    parts = {"example", "inference-pool", "endpoint-picker"}
    return tuple(
        o
        for o in render(CHART_DIR / "ci" / "precise-prefix-values.yaml")
        if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") in parts
    )


SOURCES = {"example": lambda: tuple(load_all(EXAMPLE.read_text())), "chart": chart_objects}


@pytest.fixture(params=list(SOURCES), scope="module")
def objects(request) -> tuple[dict, ...]:
    return SOURCES[request.param]()


def test_the_vendored_types_are_the_readme_versions_and_declare_the_plugin_types():
    readme = (VENDOR / "README.md").read_text()
    assert "llm-d/llm-d-router **v0.10.0**" in readme
    for plugin_type, (file, struct) in PARAMETER_TYPES.items():
        text = (VENDOR / file).read_text()
        assert f'"{plugin_type}"' in text, f"{file} does not register {plugin_type}"
        assert f"type {struct} struct" in text
    image_tag = re.search(r"llm-d-router-endpoint-picker:(v[\d.]+)", EXAMPLE.read_text())
    assert image_tag and image_tag.group(1) == "v0.10.0"


def test_the_type_check_refuses_what_the_picker_would():
    """The check can fail: a misspelt field, a wrong type, an unknown nested field."""
    config = picker_config(load_all(EXAMPLE.read_text()))
    assert config_errors(config) == []
    broken = json.loads(json.dumps(config))
    producer = next(p for p in broken["plugins"] if p["type"] == "precise-prefix-cache-producer")
    producer["parameters"]["kvEventsConfig"]["topicFiltre"] = "kv@"
    producer["parameters"]["kvEventsConfig"]["podDiscoveryConfig"]["socketPort"] = "5557"
    producer["parameters"]["tokenProcessorConfig"]["blockSize"] = True
    broken["schedulingProfile"] = []
    assert sorted(config_errors(broken)) == sorted(
        [
            'config: json: unknown field "schedulingProfile"',
            f'plugins[{broken["plugins"].index(producer)}].kvEventsConfig: json: unknown field "topicFiltre"',
            f"plugins[{broken['plugins'].index(producer)}].kvEventsConfig.podDiscoveryConfig.socketPort: expected int, got '5557'",
            f"plugins[{broken['plugins'].index(producer)}].tokenProcessorConfig.blockSize: expected int, got True",
        ]
    )  # fmt: skip


def test_every_object_passes_its_schema(objects):
    custom = _CustomResources(
        [vendored_crd("inference.networking.k8s.io_inferencepools"), load_crd()]
    )
    for obj in objects:
        if obj["apiVersion"] in BUILT_IN:
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
        else:
            assert custom.knows(obj), obj["kind"]
            assert custom.errors(obj) == [], obj["kind"]
    assert config_errors(picker_config(objects)) == []


def isvc(objects) -> dict:
    (found,) = [o for o in objects if o["kind"] == KIND]
    return {**found, "metadata": {**found["metadata"], "namespace": "ns", "uid": "u"}}


def test_the_picker_subscribes_where_the_pods_publish(objects):
    config = picker_config(objects)
    body = isvc(objects)
    pod = resources.build_deployment(body, 1, "img")["spec"]["template"]
    (server,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    events = json.loads(server["args"][server["args"].index("--kv-events-config") + 1])
    producer = plugin(config, "precise-prefix-cache-producer")
    kv_config = producer["kvEventsConfig"]
    # The picker dials tcp://<pod IP>:<socketPort> for every pod of the pool.
    assert kv_config["discoverPods"] is True
    assert kv_config["podDiscoveryConfig"]["socketPort"] == ports["kv-events"]
    assert events["endpoint"] == f"tcp://*:{ports['kv-events']}"
    # It keeps the messages whose topic starts with its filter: kv@<pod IP>@<model>.
    topic = events["topic"].replace("$(POD_IP)", "10.0.0.7")
    assert topic.startswith(kv_config["topicFilter"])
    assert topic.split("@") == ["kv", "10.0.0.7", body["spec"]["model"]["name"]]
    # The pool's pods are the InferenceService's, on their HTTP port.
    (pool,) = [o for o in objects if o["kind"] == "InferencePool"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # The producer is fed the pool's endpoints as they come and go, and the scorer
    # reads the producer's matches.
    sources = {s["pluginRef"]: s for s in config["dataLayer"]["sources"]}
    extractors = [e["pluginRef"] for e in sources["endpoint-notification-source"]["extractors"]]
    assert extractors == ["precise-prefix-cache-producer"]
    scorer = plugin(config, "prefix-cache-scorer")
    assert scorer["prefixMatchInfoProducerName"] == "precise-prefix-cache-producer"
    weights = {
        p["pluginRef"]: p.get("weight") for prof in config["schedulingProfiles"] for p in prof["plugins"]
    }  # fmt: skip
    assert weights["prefix-cache-scorer"] > 0


def test_the_picker_renders_prompts_with_the_pods_tokenizer(objects):
    """Its token-producer asks the InferenceService's Service for token ids (pagedinfer
    serves vLLM's render endpoints), naming the model the pods serve."""
    config = picker_config(objects)
    body = isvc(objects)
    tokens = plugin(config, "token-producer")
    service = resources.build_service(body)
    http_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
    assert tokens["vllm"]["url"] == f"http://{service['metadata']['name']}:{http_port}"
    assert tokens["modelName"] == body["spec"]["model"]["name"]


def test_the_chart_and_the_example_configure_the_picker_alike():
    assert picker_config(chart_objects()) == picker_config(load_all(EXAMPLE.read_text()))
