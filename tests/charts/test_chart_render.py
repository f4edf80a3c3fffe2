"""The Helm chart, checked with the real helm binary and the real Kubernetes schemas.

Every values file in charts/pagedinfer/ci is linted and rendered; every rendered object
must pass kubernetes-validate --strict (unknown fields refused) for the oldest and the
newest Kubernetes the chart supports, and InferenceServices must pass the CRD's schema.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import threading
from collections import Counter
from pathlib import Path

import kubernetes_validate
import pytest
from chart_tools import (
    CHART_DIR,
    CI_VALUES,
    GROUP,
    KIND,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    VERSION,
    CustomResources,
    crd_tools,
    helm,
    load_all,
    render,
    schema_errors,
    template_args,
    vendored_crd,
)

from pagedinfer.operator.spec import validation_errors

VALUES_IDS = [p.stem for p in CI_VALUES]
VENDORED_CRDS = ("inference.networking.k8s.io_inferencepools", "keda.sh_scaledobjects")
KOPF_PEERING_API = "kopf.dev/v1"
OPERATOR = f"{RELEASE}-pagedinfer-operator"


def ci_values(name: str) -> Path:
    return CHART_DIR / "ci" / f"{name}.yaml"


def by_kind(objects: tuple[dict, ...], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def pod_specs(objects: tuple[dict, ...]) -> list[tuple[str, dict]]:
    """(name, pod spec) of every pod the objects would run."""
    specs = []
    for obj in objects:
        if obj["kind"] == "Pod":
            specs.append((obj["metadata"]["name"], obj["spec"]))
        elif obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            specs.append((obj["metadata"]["name"], obj["spec"]["template"]["spec"]))
    return specs


def test_there_are_values_files_for_each_case():
    cases = {"default-values", "autoscaling-off-values", "custom-values", "ecosystem-values"}
    assert cases <= set(VALUES_IDS)


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=["no-values", *VALUES_IDS])
def test_helm_lint_strict_passes(values):
    args = ["lint", "--strict", str(CHART_DIR), "--namespace", NAMESPACE]
    args += ["--kube-version", KUBE_VERSIONS[-1]]
    if values is not None:
        args += ["--values", str(values)]
    result = helm(*args)
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("values", CI_VALUES, ids=VALUES_IDS)
def test_every_rendered_object_passes_kubernetes_validate_strict(values, isvc_validator):
    # The optional InferencePool and ScaledObject, against their projects' CRDs.
    others = CustomResources([vendored_crd(name) for name in VENDORED_CRDS])
    problems = []
    for obj in render(values):
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["apiVersion"] == f"{GROUP}/{VERSION}":
            problems += [f"{where}: {e}" for e in schema_errors(isvc_validator, obj)]
            continue
        if others.knows(obj):
            problems += [f"{where}: {e}" for e in others.errors(obj)]
            continue
        if obj["apiVersion"] == KOPF_PEERING_API:  # kopf's CRD, not ours: no schema here
            assert obj["kind"] in ("ClusterKopfPeering", "KopfPeering") and "spec" not in obj
            continue
        for kube_version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, kube_version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{where} (Kubernetes {kube_version}): {exc.message}")
    assert not problems, "\n".join(problems)


def test_the_crd_passes_kubernetes_validate_strict():
    crds = [
        o
        for o in load_all(helm(*template_args(ci_values("default-values"), crds=True)).stdout)
        if o["kind"] == "CustomResourceDefinition"
    ]
    assert [c["spec"]["group"] for c in crds] == [GROUP]
    for kube_version in KUBE_VERSIONS:
        kubernetes_validate.validate(crds[0], kube_version, strict=True)


def test_default_values_render_the_operator_its_rbac_and_the_test_hook():
    kinds = Counter(o["kind"] for o in render(ci_values("default-values")))
    assert kinds == {
        "Deployment": 1,
        "ServiceAccount": 2,  # the operator's and the read-only one of the test pod
        "ClusterRole": 2,
        "ClusterRoleBinding": 2,
        "Role": 1,
        "RoleBinding": 1,
        "ConfigMap": 1,
        "Pod": 1,
    }
    assert not by_kind(render(ci_values("default-values")), KIND)


def test_only_the_test_pod_is_a_helm_hook():
    objects = render(ci_values("default-values"))
    hooks = [o for o in objects if "helm.sh/hook" in o["metadata"].get("annotations", {})]
    assert [(o["kind"], o["metadata"]["annotations"]["helm.sh/hook"]) for o in hooks] == [
        ("Pod", "test")
    ]


def test_every_object_carries_the_standard_labels():
    for values in CI_VALUES:
        for obj in render(values):
            labels = obj["metadata"].get("labels", {})
            assert labels.get("app.kubernetes.io/name") == "pagedinfer", obj["metadata"]["name"]
            assert labels.get("app.kubernetes.io/instance") == RELEASE
            assert labels.get("app.kubernetes.io/managed-by") == "Helm"


def test_operator_deployment_selects_its_own_pods_only():
    (deployment,) = by_kind(render(ci_values("default-values")), "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert selector["app.kubernetes.io/component"] == "operator"


@pytest.mark.parametrize("values", CI_VALUES, ids=VALUES_IDS)
def test_every_pod_runs_with_restricted_security(values):
    for name, spec in pod_specs(render(values)):
        pod_ctx = spec.get("securityContext", {})
        assert pod_ctx.get("runAsNonRoot") is True, name
        assert pod_ctx.get("runAsUser", 0) != 0, name
        assert pod_ctx.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
        for container in spec["containers"] + spec.get("initContainers", []):
            ctx = container.get("securityContext", {})
            where = f"{name}/{container['name']}"
            assert ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True, where
            assert ctx.get("readOnlyRootFilesystem") is True, where
            assert ctx.get("allowPrivilegeEscalation") is False, where
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not ctx.get("capabilities", {}).get("add"), where
            assert not ctx.get("privileged"), where
            seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile", {}))
            assert seccomp.get("type") == "RuntimeDefault", where
            # A read-only root needs somewhere to write: /tmp is an emptyDir.
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            assert "/tmp" in mounts, where
            assert container.get("resources", {}).get("limits", {}).get("memory"), where


def test_the_image_follows_the_values():
    (deployment,) = by_kind(render(ci_values("custom-values")), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/ml/pagedinfer:0.1.0-cuda"
    assert container["imagePullPolicy"] == "Always"
    assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}

    (default,) = by_kind(render(ci_values("default-values")), "Deployment")
    chart_version = load_all((CHART_DIR / "Chart.yaml").read_text())[0]["appVersion"]
    assert default["spec"]["template"]["spec"]["containers"][0]["image"] == (
        f"pagedinfer:{chart_version}"
    )


# -- RBAC ---------------------------------------------------------------------------

# What the operator does with each resource. Deletion is the garbage collector's job
# (owner references), so the operator never needs the delete verb.
# (operator/kube.py: get, create, server-side apply = patch, merge patch, list pods;
# handlers.py: kopf watches InferenceServices, and Deployments and Services by label.)
OPERATOR_RULES = {
    ("serving.pagedinfer.dev", "inferenceservices"): {"get", "list", "watch", "patch"},
    ("serving.pagedinfer.dev", "inferenceservices/status"): {"patch"},
    # blockOwnerDeletion in the children's owner references (kopf.adopt).
    ("serving.pagedinfer.dev", "inferenceservices/finalizers"): {"update"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch"},
    ("", "services"): {"get", "list", "watch", "create", "patch"},
    ("", "pods"): {"list"},
    ("", "events"): {"create"},
}
KOPF_CLUSTER_RULES = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
}
PEERING_VERBS = {"get", "list", "watch", "patch"}


def rules_of(role: dict) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert not rule.get("nonResourceURLs"), role["metadata"]["name"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def roles(objects: tuple[dict, ...]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("ClusterRole", "Role")}


def test_operator_rbac_grants_exactly_what_the_operator_uses():
    objects = render(ci_values("default-values"))
    granted = roles(objects)
    assert rules_of(granted[OPERATOR]) == OPERATOR_RULES
    assert rules_of(granted[f"{OPERATOR}-cluster"]) == KOPF_CLUSTER_RULES


@pytest.mark.parametrize("values", CI_VALUES, ids=VALUES_IDS)
def test_no_role_uses_wildcards_or_touches_secrets(values):
    for name, role in roles(render(values)).items():
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], f"{name}: wildcard in {field}"
            assert "secrets" not in rule["resources"], name
            assert not {"escalate", "bind", "impersonate", "delete"} & set(rule["verbs"]), name


def bindings(objects: tuple[dict, ...]) -> list[tuple[str, str | None, str]]:
    """(binding kind, namespace, role name) of every binding of the operator's account."""
    found = []
    for obj in objects:
        if obj["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        subjects = {(s["kind"], s["name"]) for s in obj["subjects"]}
        if any(name.endswith("operator") for _, name in subjects):
            found.append((obj["kind"], obj["metadata"].get("namespace"), obj["roleRef"]["name"]))
    return sorted(found, key=str)


def test_cluster_wide_operator_is_bound_cluster_wide():
    assert bindings(render(ci_values("default-values"))) == sorted(
        [
            ("ClusterRoleBinding", None, OPERATOR),
            ("ClusterRoleBinding", None, f"{OPERATOR}-cluster"),
        ],
        key=str,
    )


def test_namespaced_operator_is_bound_only_in_its_namespaces():
    objects = render(ci_values("namespaced-values"))
    assert bindings(objects) == sorted(
        [
            ("ClusterRoleBinding", None, f"{OPERATOR}-cluster"),
            ("RoleBinding", "pagedinfer", OPERATOR),
            ("RoleBinding", "team-a", OPERATOR),
        ],
        key=str,
    )
    granted = roles(objects)
    # Namespaced peering: KopfPeering objects in the watched namespaces, none cluster-wide.
    assert rules_of(granted[OPERATOR])[("kopf.dev", "kopfpeerings")] == PEERING_VERBS
    assert ("kopf.dev", "clusterkopfpeerings") not in rules_of(granted[f"{OPERATOR}-cluster"])
    (sa,) = [o for o in by_kind(objects, "ServiceAccount")]
    assert sa["metadata"]["name"] == "pagedinfer-operator"


def test_cluster_wide_peering_uses_cluster_kopf_peerings():
    objects = render(ci_values("default-values"), "operator.peering.enabled=true")
    granted = roles(objects)
    cluster_rules = rules_of(granted[f"{OPERATOR}-cluster"])
    assert cluster_rules[("kopf.dev", "clusterkopfpeerings")] == PEERING_VERBS


def test_test_pod_account_may_only_read():
    objects = render(ci_values("default-values"))
    test_role = roles(objects)[f"{RELEASE}-pagedinfer-test"]
    assert test_role["kind"] == "Role"
    for rule in test_role["rules"]:
        assert set(rule["verbs"]) <= {"get", "list"}


# -- operator arguments -------------------------------------------------------------


def operator_deployment(objects: tuple[dict, ...]) -> dict:
    (deployment,) = [
        o
        for o in by_kind(objects, "Deployment")
        if o["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"
    ]
    return deployment


def operator_args(objects: tuple[dict, ...]) -> list[str]:
    deployment = operator_deployment(objects)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "command" not in container, "the image's ENTRYPOINT (pagedinfer) starts it"
    return container["args"]


def test_operator_args_follow_scope_and_peering():
    default = operator_args(render(ci_values("default-values")))
    assert default[0] == "operator"
    assert "--all-namespaces" in default and "--standalone" in default
    namespaced = operator_args(render(ci_values("namespaced-values")))
    assert "--namespace=pagedinfer" in namespaced and "--namespace=team-a" in namespaced
    assert "--peering=pagedinfer-dev" in namespaced and "--priority=10" in namespaced
    assert "--all-namespaces" not in namespaced and "--standalone" not in namespaced


@pytest.mark.parametrize("values", CI_VALUES, ids=VALUES_IDS)
def test_operator_args_are_accepted_by_the_pagedinfer_operator_command(values):
    """The chart and `pagedinfer operator` agree on the command line."""
    from pagedinfer.service.cli import build_parser

    args = operator_args(render(values))
    parsed = build_parser("operator").parse_args(args)  # exits (fails) on an unknown flag
    assert parsed.command == "operator"


@pytest.mark.parametrize("values", CI_VALUES, ids=VALUES_IDS)
def test_never_two_operators_at_once(values):
    """kopf has no leader election: one replica, and the old pod stops before the new one."""
    deployment = operator_deployment(render(values))
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_peering_objects_follow_the_operator_scope():
    namespaced = by_kind(render(ci_values("namespaced-values")), "KopfPeering")
    assert sorted(o["metadata"]["namespace"] for o in namespaced) == ["pagedinfer", "team-a"]
    cluster = render(ci_values("default-values"), "operator.peering.enabled=true")
    (peering,) = by_kind(cluster, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "pagedinfer"
    assert not by_kind(render(ci_values("default-values")), "ClusterKopfPeering")


# -- example InferenceService -------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "name"),
    [("autoscaling-off-values", "smollm2-static"), ("custom-values", "smollm2-gpu")],
)
def test_example_inferenceservice_is_valid_against_the_crd(values, name, isvc_validator):
    (isvc,) = by_kind(render(ci_values(values)), KIND)
    assert isvc["apiVersion"] == f"{GROUP}/{VERSION}"
    assert isvc["metadata"]["name"] == name
    assert isvc["metadata"]["namespace"] == NAMESPACE
    assert schema_errors(isvc_validator, isvc) == []
    # The CEL rules, which only an API server enforces: as the operator repeats them, and
    # as written in the CRD, evaluated by cel-python through the operator suite's helper.
    assert validation_errors(isvc) == []
    pytest.importorskip("celpy")
    assert crd_tools().admission_errors(isvc) == []


def test_autoscaling_off_example_has_static_replicas():
    (isvc,) = by_kind(render(ci_values("autoscaling-off-values")), KIND)
    assert "autoscaling" not in isvc["spec"]
    assert isvc["spec"]["replicas"] == 2


def test_inferenceservices_without_an_image_run_the_chart_image():
    objects = render(ci_values("autoscaling-off-values"))
    (isvc,) = by_kind(objects, KIND)
    (deployment,) = by_kind(objects, "Deployment")
    chart_image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert "image" not in isvc["spec"]
    assert f"--default-image={chart_image}" in operator_args(objects)
    (custom,) = by_kind(render(ci_values("custom-values")), KIND)
    assert custom["spec"]["image"] == "registry.example.com/ml/pagedinfer:0.1.0-cuda"


def test_helm_test_pod_waits_for_the_example_when_it_is_on():
    def env(values: str) -> dict[str, str]:
        (pod,) = by_kind(render(ci_values(values)), "Pod")
        return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}

    assert env("default-values")["EXAMPLE_NAME"] == ""
    assert env("autoscaling-off-values")["EXAMPLE_NAME"] == "smollm2-static"
    assert env("default-values")["OPERATOR_DEPLOYMENT"] == OPERATOR


# -- refused values -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["operator.replicaCont=2"], "replicaCont"),  # a typo: values.schema.json
        (["image.pullPolicy=Sometimes"], "pullPolicy"),
        (["operator.watchNamespaces={Team_A}"], "watchNamespaces"),
        (["operator.replicaCount=2"], "replicaCount"),  # two operators would both act
        (
            ["example.enabled=true", "operator.watchNamespaces={other}"],
            "watchNamespaces leaves out",
        ),
    ],
)
def test_bad_values_are_refused_with_the_key_named(sets, message):
    args = template_args(ci_values("default-values"), *sets)
    result = helm(*args, check=False)
    assert result.returncode != 0
    assert message in result.stderr


def helm_test_module():
    path = CHART_DIR / "files" / "helm_test.py"
    spec = importlib.util.spec_from_file_location("pagedinfer_helm_test", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_helm_test_script_reads_both_endpoints_from_the_status():
    module = helm_test_module()
    status = {"url": "http://a.b.svc:8000/", "grpcUrl": "grpc://a.b.svc:50051"}
    assert module.http_url({"status": status}) == "http://a.b.svc:8000"
    assert module.grpc_target({"status": status}) == "a.b.svc:50051"
    assert module.grpc_target({"status": {"grpcUrl": "a.b.svc:50051"}}) == "a.b.svc:50051"


class _FakeServer(http.server.BaseHTTPRequestHandler):
    """/health answers with the class's status; /v1/models lists its models."""

    health = 200
    models: tuple[str, ...] = ()

    def do_GET(self) -> None:
        if self.path == "/health":
            status, body = self.health, b""
        elif self.path == "/v1/models":
            status = 200
            body = json.dumps({"object": "list", "data": [{"id": m} for m in self.models]})
            body = body.encode()
        else:
            status, body = 404, b""
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_server():
    handler = type("Handler", (_FakeServer,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_helm_test_script_waits_for_health_and_the_model(fake_server):
    module = helm_test_module()
    handler, base = fake_server
    handler.health = 503  # loading
    assert module.http_healthy(base) is False
    handler.health = 200
    assert module.http_healthy(base) is True
    assert module.serves_model(base, "") is False  # no model listed yet
    handler.models = ("smollm2-135m-instruct",)
    assert module.serves_model(base, "smollm2-135m-instruct") is True
    assert module.serves_model(base, "") is True
    assert module.serves_model(base, "other") is False


def test_helm_test_script_in_the_configmap_is_the_file_in_the_chart():
    (config_map,) = by_kind(render(ci_values("default-values")), "ConfigMap")
    script = (CHART_DIR / "files" / "helm_test.py").read_text()
    assert config_map["data"]["helm_test.py"].strip() == script.strip()


def test_notes_tell_how_to_watch_the_inferenceservices(tmp_path):
    """NOTES.txt, rendered by a client-side dry-run install (no cluster contacted)."""
    base = ["install", RELEASE, str(CHART_DIR), "--namespace", NAMESPACE, "--dry-run=client"]
    env_free = ["--kubeconfig", str(tmp_path / "none")]
    notes = helm(*base, *env_free).stdout.split("NOTES:", 1)[1]
    assert f"deployment/{OPERATOR}" in notes
    assert "all namespaces" in notes
    assert "kubectl get pisvc -w" in notes
    example = helm(*base, *env_free, "--values", str(ci_values("custom-values"))).stdout
    assert f"kubectl -n {NAMESPACE} get pisvc smollm2-gpu -w" in example.split("NOTES:", 1)[1]
