#!/usr/bin/env bash
# End-to-end check on a real Kubernetes cluster (kind, or any cluster kubectl points at):
# builds the image, installs the chart, applies the smallest example InferenceService,
# waits until it is Ready, generates text through its Service, drives it into a
# scale-up with a burst of long requests, runs `helm test`, and cleans up.
#
# It runs only when `kubectl cluster-info` reaches a cluster; otherwise it says that it
# skipped and exits 0. CI has no cluster, so CI never runs it.
#
#   kind create cluster && bash scripts/e2e_kind.sh
#
# Environment:
#   E2E_IMAGE      image to build and use (default pagedinfer:e2e; must carry a tag)
#   E2E_NAMESPACE  namespace of the release and the example (default pagedinfer-e2e)
#   E2E_BUILD=0    use an image the cluster can already pull instead of building one
#   E2E_SCALE=0    skip the scale-up step
#   E2E_KEEP=1     leave the release and the example installed afterwards
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v kubectl >/dev/null 2>&1 \
    || ! kubectl cluster-info --request-timeout=10s >/dev/null 2>&1; then
    echo "e2e_kind.sh: skipped: no reachable Kubernetes cluster (kubectl cluster-info failed)"
    exit 0
fi

IMAGE=${E2E_IMAGE:-pagedinfer:e2e}
NAMESPACE=${E2E_NAMESPACE:-pagedinfer-e2e}
RELEASE=pagedinfer
EXAMPLE=examples/inferenceservice.yaml
NAME=smollm2
PYTHON=python3
if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
HELM=${HELM:-$("$PYTHON" scripts/get_helm.py)}
k() { kubectl -n "$NAMESPACE" "$@"; }
step() { printf '\n== %s\n' "$*"; }

cleanup() {
    if [ "${E2E_KEEP:-0}" = 1 ]; then
        echo "E2E_KEEP=1: leaving release $RELEASE in namespace $NAMESPACE"
        return
    fi
    step "cleaning up"
    k delete pod e2e-load --ignore-not-found --wait=false || true
    k delete inferenceservice "$NAME" --ignore-not-found --wait=true --timeout=2m || true
    "$HELM" uninstall "$RELEASE" -n "$NAMESPACE" --wait --timeout 2m || true
    kubectl delete namespace "$NAMESPACE" --ignore-not-found --wait=false || true
}
trap cleanup EXIT

dump() {
    echo "--- diagnostics"
    k get pisvc,deployments,pods,services -o wide || true
    k get events --sort-by=.lastTimestamp | tail -30 || true
    k logs "deployment/$RELEASE-operator" --tail=100 || true
}

# One-shot client pod running the image's `pagedinfer` with the given arguments.
client() {
    local pod=$1
    shift
    k run "$pod" --rm -i --restart=Never --image "$IMAGE" --image-pull-policy=IfNotPresent \
        --quiet -- "$@"
}

if [ "${E2E_BUILD:-1}" != 0 ]; then
    step "building $IMAGE"
    docker build -t "$IMAGE" .
    context=$(kubectl config current-context)
    if [[ $context == kind-* ]]; then
        kind load docker-image "$IMAGE" --name "${context#kind-}"
    fi
fi

step "installing the chart"
"$HELM" upgrade --install "$RELEASE" charts/pagedinfer -n "$NAMESPACE" --create-namespace \
    --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" \
    --set image.pullPolicy=IfNotPresent --wait --timeout 5m || { dump; exit 1; }

step "applying $EXAMPLE"
# It names no image, so it runs the operator's --default-image: the chart's image.
k apply -f "$EXAMPLE"
k wait --for=condition=Ready "pisvc/$NAME" --timeout=10m || { dump; exit 1; }
k get pisvc "$NAME"
url=$(k get pisvc "$NAME" -o jsonpath='{.status.grpcUrl}')
target=${url#grpc://}
echo "gRPC endpoint: $target"

step "generating through the Service"
client e2e-client generate --server "$target" --max-tokens 16 "What is the capital of France?" \
    || { dump; exit 1; }

if [ "${E2E_SCALE:-1}" != 0 ]; then
    step "scale-up: autoscaling on a small KV cache, then a burst of long requests"
    # A merge patch with null removes spec.replicas (exclusive with autoscaling).
    k patch pisvc "$NAME" --type merge -p '{"spec": {"replicas": null,
        "engine": {"numGpuBlocks": 64, "maxNumSeqs": 16},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "targetFreeBlockRatio": 0.5,
                        "syncPeriodSeconds": 5, "podWarmupSeconds": 0}}}'
    k rollout status "deployment/$NAME" --timeout=10m
    k wait --for=condition=Ready "pisvc/$NAME" --timeout=10m || { dump; exit 1; }
    # 8 samples x 400 tokens need about 200 blocks of 16 tokens: three times the pool.
    k run e2e-load --restart=Never --image "$IMAGE" --image-pull-policy=IfNotPresent -- \
        generate --server "$target" -n 8 --max-tokens 400 --ignore-eos --temperature 0.8 \
        "Tell me a long story about a lighthouse keeper."
    k wait --for=jsonpath='{.status.desiredReplicas}'=2 "pisvc/$NAME" --timeout=5m \
        || { dump; exit 1; }
    k get pisvc "$NAME"
    k get pisvc "$NAME" -o jsonpath='{.status.autoscaling.lastScaleReason}{"\n"}'
    k delete pod e2e-load --wait=false
fi

step "helm test"
"$HELM" test "$RELEASE" -n "$NAMESPACE" --logs --timeout 10m || { dump; exit 1; }

echo
echo "e2e_kind.sh: passed"
