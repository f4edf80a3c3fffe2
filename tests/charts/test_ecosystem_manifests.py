"""The InferencePool and KEDA ScaledObject manifests, checked against their own projects.

examples/inferencepool.yaml and examples/keda-scaledobject.yaml, and the same objects as
the chart renders them (ci/ecosystem-values.yaml): InferencePools and ScaledObjects
against the CRDs their projects release (vendored under vendor_crds/, with the versions
in its README), defaults and CEL rules included; every built-in kind with
kubernetes-validate --strict. Then what no schema can see: that the pool selects the pods
the operator runs and targets their HTTP port, that the endpoint picker reads metric
names pagedinfer exports, and that KEDA drives the InferenceService's scale subresource
with Prometheus queries that select its pods.
"""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml
from chart_tools import (
    CHART_DIR,
    EXAMPLES_DIR,
    KUBE_VERSIONS,
    NAMESPACE,
    VENDOR_CRDS,
    CustomResources,
    helm,
    load_all,
    load_crd,
    render,
    template_args,
    vendored_crd,
)

from pagedinfer.operator import resources
from pagedinfer.operator.spec import API_VERSION, KIND

pytest.importorskip("celpy", reason="cel-python evaluates the CRDs' CEL rules")

POOL_CRD = "inference.networking.k8s.io_inferencepools"
SCALEDOBJECT_CRD = "keda.sh_scaledobjects"
POOL_API, SCALEDOBJECT_API = "inference.networking.k8s.io/v1", "keda.sh/v1alpha1"
# The model-server-protocol series of docs/architecture.md section 9 that the picker reads.
VLLM_SERIES = {
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
}
# Trigger metadata of KEDA v2.20.2's prometheus scaler (pkg/scalers/prometheus_scaler.go,
# its `keda:"name=..."` tags), and the ones it requires.
PROMETHEUS_METADATA = {
    "serverAddress", "query", "queryParameters", "threshold", "activationThreshold",
    "namespace", "customHeaders", "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout",
    "identityOwner",
}  # fmt: skip
PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}
BUILT_IN = {"v1", "apps/v1", "rbac.authorization.k8s.io/v1"}


@pytest.fixture(scope="module")
def custom_resources() -> CustomResources:
    return CustomResources([vendored_crd(POOL_CRD), vendored_crd(SCALEDOBJECT_CRD), load_crd()])


def example_file(name: str) -> list[dict]:
    return load_all((EXAMPLES_DIR / name).read_text())


def example_isvc(name: str) -> dict:
    """The example InferenceService called `name`, in namespace `ns`."""
    for path in sorted(EXAMPLES_DIR.glob("inferenceservice*.yaml")):
        for obj in load_all(path.read_text()):
            if obj.get("kind") == KIND and obj["metadata"]["name"] == name:
                return {**obj, "metadata": {**obj["metadata"], "namespace": "ns", "uid": "u"}}
    raise AssertionError(f"no example InferenceService {name}")


def chart_objects() -> tuple[dict, ...]:
    return render(CHART_DIR / "ci" / "ecosystem-values.yaml")


def chart_isvc(objects: tuple[dict, ...], name: str) -> dict:
    (isvc,) = [o for o in objects if o["kind"] == KIND and o["metadata"]["name"] == name]
    return {**isvc, "metadata": {**isvc["metadata"], "uid": "u"}}


# Each source: its objects, and the InferenceService its pool and ScaledObject refer to.
SOURCES = {
    "examples": lambda: (
        (*example_file("inferencepool.yaml"), *example_file("keda-scaledobject.yaml")),
        example_isvc,
    ),
    "chart": lambda: (chart_objects(), lambda name: chart_isvc(chart_objects(), name)),
}


@pytest.fixture(params=list(SOURCES), scope="module")
def source(request):
    return SOURCES[request.param]()


def one(objects, kind: str, api_version: str | None = None) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and api_version in (None, o["apiVersion"])]
    return found


# -- the vendored CRDs ----------------------------------------------------------------


def test_the_vendored_crds_are_the_releases_the_readme_names():
    readme = (VENDOR_CRDS / "README.md").read_text()
    pool = vendored_crd(POOL_CRD)
    version = pool["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"]
    assert f"gateway-api-inference-extension **{version}**" in readme
    assert (pool["spec"]["group"], pool["spec"]["names"]["kind"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
    )
    assert [v["name"] for v in pool["spec"]["versions"] if v["served"]] == ["v1"]
    scaled = vendored_crd(SCALEDOBJECT_CRD)
    assert re.search(r"kedacore/keda \*\*v2\.\d+\.\d+\*\*", readme)
    assert (scaled["spec"]["group"], scaled["spec"]["names"]["kind"]) == ("keda.sh", "ScaledObject")
    # KEDA's release applies its JSON patch: the HPA windows get their bounds.
    behavior = scaled["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["advanced"]["properties"]["horizontalPodAutoscalerConfig"]["properties"]["behavior"]
    window = behavior["properties"]["scaleDown"]["properties"]["stabilizationWindowSeconds"]
    assert (window["minimum"], window["maximum"]) == (0, 3600)


@pytest.mark.parametrize("name", [POOL_CRD, SCALEDOBJECT_CRD])
def test_the_vendored_crds_are_valid_customresourcedefinitions(name):
    for kube_version in KUBE_VERSIONS:
        kubernetes_validate.validate(vendored_crd(name), kube_version, strict=True)


def test_the_validators_refuse_what_the_api_server_would(custom_resources):
    """The checks below can fail: broken objects, refused for the right field."""
    (pool,) = [o for o in example_file("inferencepool.yaml") if o["apiVersion"] == POOL_API]
    unknown = {**pool, "spec": {**pool["spec"], "targetPort": 8000}}
    assert any("'targetPort' was unexpected" in e for e in custom_resources.errors(unknown))
    twice = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 8000}] * 2}}
    assert custom_resources.errors(twice) == ["spec.targetPorts: port number must be unique"]
    ref = {k: v for k, v in pool["spec"]["endpointPickerRef"].items() if k != "port"}
    no_port = {**pool, "spec": {**pool["spec"], "endpointPickerRef": ref}}
    assert custom_resources.errors(no_port) == [
        "spec.endpointPickerRef: port is required when kind is 'Service' or unspecified"
        " (defaults to 'Service')"
    ]
    (scaled,) = example_file("keda-scaledobject.yaml")
    inverted = {**scaled, "spec": {**scaled["spec"], "minReplicaCount": 5}}
    assert custom_resources.errors(inverted) == [
        "spec: minReplicaCount must be less than or equal to maxReplicaCount"
    ]
    unnamed = {**scaled, "spec": {**scaled["spec"], "scaleTargetRef": {"kind": KIND}}}
    assert any("scaleTargetRef" in e for e in custom_resources.errors(unnamed))


# -- every object passes its schema ------------------------------------------------------


def test_every_object_passes_its_own_schema(source, custom_resources):
    objects, _ = source
    problems = []
    kinds = set()
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        kinds.add(obj["kind"])
        if custom_resources.knows(obj):
            problems += [f"{where}: {e}" for e in custom_resources.errors(obj)]
            continue
        assert obj["apiVersion"] in BUILT_IN, f"{where}: a custom resource without a vendored CRD"
        for kube_version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, kube_version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{where} (Kubernetes {kube_version}): {exc.message}")
    assert not problems, "\n".join(problems)
    assert {"InferencePool", "ScaledObject", "Deployment", "Service", "ConfigMap"} <= kinds


# -- the InferencePool and its endpoint picker --------------------------------------------


def test_the_pool_selects_the_pods_the_operator_runs_on_their_http_port(source):
    objects, isvc_named = source
    pool = one(objects, "InferencePool", POOL_API)
    isvc = isvc_named(pool["metadata"]["name"])
    template = resources.build_deployment(isvc, 1, "pagedinfer:x")["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    http = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert pool["spec"]["targetPorts"] == [{"number": http}]
    assert pool["spec"]["appProtocol"] == "http"
    # The pool's pods are exactly this InferenceService's: the label names it.
    assert pool["spec"]["selector"]["matchLabels"] == resources.selector_labels(
        isvc["metadata"]["name"]
    )


def test_the_pool_points_at_its_endpoint_picker(source):
    objects, _ = source
    pool = one(objects, "InferencePool", POOL_API)
    ref = pool["spec"]["endpointPickerRef"]
    service = next(
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == ref["name"]
    )
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    deployment = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == ref["name"]
    )
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    assert f"--pool-name={pool['metadata']['name']}" in args
    assert "--pool-group=inference.networking.k8s.io" in args
    # The Service's ext-proc port reaches the container's.
    (ext_proc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[ext_proc["targetPort"]] == ref["port"]["number"]
    # It may watch the pool and its pods, and nothing else.
    role = next(o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == ref["name"])
    granted = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"]}  # fmt: skip
    assert granted == {
        ("", "pods"): {"get", "list", "watch"},
        ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch"},
    }


def picker_config(objects) -> dict:
    pool = one(objects, "InferencePool", POOL_API)
    deployment = next(
        o for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == pool["spec"]["endpointPickerRef"]["name"]
    )  # fmt: skip
    spec = deployment["spec"]["template"]["spec"]
    (flag,) = [a for a in spec["containers"][0]["args"] if a.startswith("--config-file=")]
    path = flag.split("=", 1)[1]
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if path.startswith(m["mountPath"])]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    config_map = next(
        o for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"]
    )  # fmt: skip
    return yaml.safe_load(config_map["data"][path.rsplit("/", 1)[1]])


def test_the_picker_reads_the_series_pagedinfer_exports_for_its_pods(source):
    objects, isvc_named = source
    config = picker_config(objects)
    assert config["kind"] == "EndpointPickerConfig"
    assert config["apiVersion"] == "llm-d.ai/v1alpha1"
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    source_params = plugins["metrics-data-source"]["parameters"]
    assert (source_params["scheme"], source_params["path"]) == ("http", "/metrics")
    extractor = plugins["core-metrics-extractor"]["parameters"]
    engines = {e["name"]: e for e in extractor["engineConfigs"]}
    # Pods labelled with the engine type the operator sets get the pagedinfer names; so
    # do unlabelled ones (defaultEngine).
    pool = one(objects, "InferencePool", POOL_API)
    isvc = isvc_named(pool["metadata"]["name"])
    labels = resources.build_deployment(isvc, 1, "x")["spec"]["template"]["metadata"]["labels"]
    engine = engines[labels[resources.ENGINE_TYPE_LABEL]]
    assert extractor["defaultEngine"] == engine["name"]
    assert engine["queuedRequestsSpec"] == "vllm:num_requests_waiting"
    assert engine["runningRequestsSpec"] == "vllm:num_requests_running"
    assert engine["kvUsageSpec"] == "vllm:kv_cache_usage_perc"
    assert engine["cacheInfoSpec"] == "vllm:cache_config_info"
    assert engine["loraSpec"] == "", "no LoRA metric: the picker would log it missing"
    named = {v for k, v in engine.items() if k.endswith("Spec") and v}
    assert named <= VLLM_SERIES
    # Every reference names a declared plugin.
    refs = [s["pluginRef"] for s in config["dataLayer"]["sources"]]
    refs += [x["pluginRef"] for s in config["dataLayer"]["sources"] for x in s["extractors"]]
    refs += [p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]]
    assert set(refs) <= set(plugins)
    scorers = {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= scorers


def test_the_picker_outlives_the_streams_of_the_pods_it_routes_to(source):
    objects, isvc_named = source
    pool = one(objects, "InferencePool", POOL_API)
    isvc = isvc_named(pool["metadata"]["name"])
    pod_grace = resources.build_deployment(isvc, 1, "x")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    picker = next(
        o for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == pool["spec"]["endpointPickerRef"]["name"]
    )  # fmt: skip
    assert picker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= pod_grace


def test_the_chart_and_the_example_configure_the_picker_alike():
    chart = picker_config(chart_objects())
    example = picker_config(example_file("inferencepool.yaml"))
    assert chart == example


# -- the KEDA ScaledObject --------------------------------------------------------------


def test_keda_scales_the_inferenceservice_through_its_scale_subresource(source):
    objects, isvc_named = source
    scaled = one(objects, "ScaledObject", SCALEDOBJECT_API)
    ref = scaled["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == (API_VERSION, KIND)
    (version,) = load_crd()["spec"]["versions"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    # The InferenceService it scales has a replica count to drive, and no autoscaler of
    # its own (the CRD refuses replicas with autoscaling).
    isvc = isvc_named(ref["name"])
    assert "replicas" in isvc["spec"] and not isvc["spec"].get("autoscaling")
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def pod_selector(query: str) -> re.Pattern:
    (pattern,) = re.findall(r'pod=~"([^"]+)"', query)
    return re.compile(pattern)


def test_keda_queries_the_pods_vllm_series(source):
    objects, _ = source
    scaled = one(objects, "ScaledObject", SCALEDOBJECT_API)
    name = scaled["spec"]["scaleTargetRef"]["name"]
    triggers = {t["name"]: t for t in scaled["spec"]["triggers"]}
    for trigger in triggers.values():
        assert trigger["type"] == "prometheus"
        metadata = trigger["metadata"]
        assert PROMETHEUS_REQUIRED <= set(metadata) <= PROMETHEUS_METADATA
        assert float(metadata["threshold"]) > 0
        assert re.fullmatch(r"https?://\S+", metadata["serverAddress"])
        # Prometheus keeps a Deployment's pods as <name>-<replica set hash>-<suffix>.
        pods = pod_selector(metadata["query"])
        assert pods.fullmatch(f"{name}-7d9f8b6c4-x2x7q")
        assert not pods.fullmatch(f"{name}-epp-7d9f8b6c4-x2x7q")  # another Deployment's
        assert not pods.fullmatch(f"other-{name}-7d9f8b6c4-x2x7q")
    waiting, usage = triggers["requests-waiting"], triggers["kv-cache-usage"]
    # Waiting requests add up over the replicas, HPA divides by them; usage is a mean.
    assert waiting["metricType"] == "AverageValue"
    assert waiting["metadata"]["query"].startswith("sum(vllm:num_requests_waiting{")
    assert usage["metricType"] == "Value"
    assert usage["metadata"]["query"].startswith("avg(vllm:kv_cache_usage_perc{")
    assert 0 < float(usage["metadata"]["threshold"]) < 1  # a fraction, like the gauge


def test_the_chart_queries_the_release_namespace():
    scaled = one(chart_objects(), "ScaledObject", SCALEDOBJECT_API)
    for trigger in scaled["spec"]["triggers"]:
        assert f'namespace="{NAMESPACE}"' in trigger["metadata"]["query"]


def test_the_chart_takes_a_series_selector_and_thresholds(tmp_path):
    values = tmp_path / "keda.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                **yaml.safe_load((CHART_DIR / "ci" / "ecosystem-values.yaml").read_text()),
                "keda": {
                    "enabled": True,
                    "waitingRequestsPerReplica": 2.5,
                    "kvCacheUsage": 0.8,
                    "prometheus": {
                        "serverAddress": "http://prometheus:9090",
                        "seriesSelector": 'model_name="smollm2-135m-instruct"',
                    },
                },
            }
        )
    )
    objects = render(values)
    triggers = {t["name"]: t for t in one(objects, "ScaledObject")["spec"]["triggers"]}
    waiting, usage = (
        triggers["requests-waiting"]["metadata"],
        triggers["kv-cache-usage"]["metadata"],
    )
    assert waiting["query"] == 'sum(vllm:num_requests_waiting{model_name="smollm2-135m-instruct"})'
    assert (waiting["threshold"], usage["threshold"]) == ("2.5", "0.8")


# -- chart values ----------------------------------------------------------------------


def test_the_chart_renders_neither_by_default():
    kinds = {o["kind"] for o in render(CHART_DIR / "ci" / "default-values.yaml")}
    assert not {"InferencePool", "ScaledObject"} & kinds


def test_an_addon_may_name_another_inferenceservice():
    objects = render(
        CHART_DIR / "ci" / "default-values.yaml",
        "inferencePool.enabled=true",
        "inferencePool.inferenceService=llama",
    )
    pool = one(objects, "InferencePool")
    assert pool["metadata"]["name"] == "llama"
    assert pool["spec"]["selector"]["matchLabels"] == resources.selector_labels("llama")
    assert pool["spec"]["endpointPickerRef"]["name"] == "llama-epp"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["keda.enabled=true", "example.enabled=true", "keda.prometheus.serverAddress=http://p:9090"],
         "set example.spec.autoscaling to null"),
        (["keda.enabled=true", "keda.inferenceService=llama"], "serverAddress"),
        (["keda.enabled=true", "keda.prometheus.serverAddress=http://p:9090"],
         "keda.enabled needs an InferenceService"),
        (["inferencePool.enabled=true"], "inferencePool.enabled needs an InferenceService"),
        (["keda.enabled=true", "keda.inferenceService=llama", "keda.prometheus.serverAddress=p:9090"],
         "serverAddress"),
        (["keda.enabled=true", "keda.inferenceService=llama", "keda.minReplicas=0",
          "keda.prometheus.serverAddress=http://p:9090"], "minReplicas"),
        (["keda.enabled=true", "keda.inferenceService=llama", "keda.minReplicas=5",
          "keda.maxReplicas=2", "keda.prometheus.serverAddress=http://p:9090"],
         "must not exceed keda.maxReplicas"),
        (["inferencePool.enabled=true", "inferencePool.inferenceService=Llama"], "inferenceService"),
        (["inferencePool.enabled=true", "inferencePool.inferenceService=llama",
          "inferencePool.failureMode=Sometimes"], "failureMode"),
    ],
)  # fmt: skip
def test_values_that_cannot_work_are_refused_naming_the_key(sets, message):
    result = helm(*template_args(CHART_DIR / "ci" / "default-values.yaml", *sets), check=False)
    assert result.returncode != 0
    assert message in result.stderr


def test_notes_tell_how_to_route_to_the_pool_and_watch_keda(tmp_path):
    args = ["install", "demo", str(CHART_DIR), "--namespace", NAMESPACE, "--dry-run=client"]
    args += ["--kubeconfig", str(tmp_path / "none")]
    args += ["--values", str(CHART_DIR / "ci" / "ecosystem-values.yaml")]
    notes = helm(*args).stdout.split("NOTES:", 1)[1]
    assert "kind: InferencePool, name: smollm2}" in notes
    assert f"kubectl -n {NAMESPACE} get scaledobject,hpa" in notes
