# syntax=docker/dockerfile:1
# pdserve's images, built from one file. Targets:
#   cuda    the workers on NVIDIA GPUs (the chart's image, ghcr.io/pdserve/pdserve): torch's CUDA build, flashinfer
#           with its precompiled kernels, NIXL with UCX and the RDMA verbs libraries. The default target.
#   cpu     workers on CPUs (ghcr.io/pdserve/pdserve-cpu): torch's CPU build; NIXL moves host memory.
#   router  the router only (ghcr.io/pdserve/pdserve-router): no torch and no CUDA library.
# Every target runs as the unprivileged user pdserve (uid 10001) with `pdserve` as its entrypoint.
#
#   docker build --target router -t ghcr.io/pdserve/pdserve-router:0.1.0 .
#   docker build --target cpu    -t ghcr.io/pdserve/pdserve-cpu:0.1.0 .
#   docker build                 -t ghcr.io/pdserve/pdserve:0.1.0 .
# Offline builds (deploy/containers/build.sh): BASE_IMAGE a local Debian image, PIP_FIND_LINKS a folder with torch.

# Debian/Ubuntu with python3 (>= 3.10), venv and pip, for the router and CPU targets.
ARG BASE_IMAGE=python:3.12-slim-bookworm
# The same with NVIDIA's CUDA runtime, for the cuda target (its python3 comes from the distribution).
ARG CUDA_BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

# --- pdserve's wheel, built once and copied into each target --------------------------------------------------------
FROM ${BASE_IMAGE} AS wheel
ARG PIP_FIND_LINKS
WORKDIR /src
COPY . .
RUN python3 -m venv /opt/build && /opt/build/bin/pip install --no-cache-dir -q --upgrade pip \
    && /opt/build/bin/pip wheel --no-cache-dir -q --no-deps --wheel-dir /wheels .

# --- the router: pdserve without its dependencies, then only what the router imports (requirements/router.txt) -------
FROM ${BASE_IMAGE} AS router
ARG PIP_FIND_LINKS
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pdserve pdserve \
    && python3 -m venv /opt/pdserve
# Dependencies before the code: a source change rebuilds only the last layer.
COPY requirements/router.txt /tmp/requirements/
RUN /opt/pdserve/bin/pip install --no-cache-dir -q -r /tmp/requirements/router.txt && rm -rf /tmp/requirements
COPY --from=wheel /wheels /wheels
RUN /opt/pdserve/bin/pip install --no-cache-dir -q --no-deps /wheels/*.whl && rm -rf /wheels
ENV PATH=/opt/pdserve/bin:$PATH HOME=/home/pdserve PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/pdserve
ENTRYPOINT ["pdserve"]
CMD ["router", "--help"]

# --- CPU workers: torch's CPU build first, so pdserve's `torch` requirement is already met ---------------------------
FROM ${BASE_IMAGE} AS cpu
ARG PIP_FIND_LINKS
# Where torch's CPU build comes from; empty when PIP_FIND_LINKS holds it (offline builds).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pdserve pdserve \
    && python3 -m venv /opt/pdserve
RUN /opt/pdserve/bin/pip install --no-cache-dir -q ${TORCH_INDEX_URL:+--index-url $TORCH_INDEX_URL} torch==2.13.0
COPY requirements/ /tmp/requirements/
RUN /opt/pdserve/bin/pip install --no-cache-dir -q -r /tmp/requirements/router.txt -r /tmp/requirements/worker.txt \
    && rm -rf /tmp/requirements
COPY --from=wheel /wheels /wheels
RUN /opt/pdserve/bin/pip install --no-cache-dir -q --no-deps /wheels/*.whl && rm -rf /wheels
ENV PATH=/opt/pdserve/bin:$PATH HOME=/home/pdserve PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/pdserve
ENTRYPOINT ["pdserve"]
CMD ["worker", "--help"]

# --- GPU workers -----------------------------------------------------------------------------------------------------
FROM ${CUDA_BASE_IMAGE} AS cuda
ARG PIP_FIND_LINKS
# flashinfer's kernels compiled ahead of time for this CUDA version (its own index); kernels not in it compile on
# first use into ~/.cache, which the worker does in its warm-up before it reports ready.
ARG FLASHINFER_JIT_CACHE_INDEX=https://flashinfer.ai/whl/cu130
# torch's build for the base image's CUDA version.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV DEBIAN_FRONTEND=noninteractive
# RDMA verbs and connection manager libraries: UCX uses them for KV transfer over InfiniBand/RoCE.
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends python3 python3-venv python3-pip ca-certificates \
       libibverbs1 librdmacm1 ibverbs-providers libnuma1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/pdserve pdserve \
    && python3 -m venv /opt/pdserve
RUN /opt/pdserve/bin/pip install --no-cache-dir -q ${TORCH_INDEX_URL:+--index-url $TORCH_INDEX_URL} torch
COPY --from=wheel /wheels /wheels
RUN /opt/pdserve/bin/pip install --no-cache-dir -q "$(ls /wheels/*.whl)[gpu]" flashinfer-cubin \
    && (/opt/pdserve/bin/pip install --no-cache-dir -q --index-url "$FLASHINFER_JIT_CACHE_INDEX" flashinfer-jit-cache \
        || echo "flashinfer-jit-cache unavailable: kernels compile at the worker's warm-up") \
    && rm -rf /wheels
# Hopper and Blackwell: the architectures flashinfer compiles missing kernels for.
ENV PATH=/opt/pdserve/bin:$PATH HOME=/home/pdserve PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST="9.0a 10.0a"
USER 10001:10001
WORKDIR /home/pdserve
ENTRYPOINT ["pdserve"]
CMD ["worker", "--help"]
