# syntax=docker/dockerfile:1
# rnnserve container images, two targets:
#   CPU (default, last stage):  docker build -t rnnserve:cpu .
#   CUDA:                       docker build --target cuda -t rnnserve:cuda .
# Both run on python:3.11-slim: the CUDA torch wheels carry their own CUDA
# runtime and cuDNN libraries and the NVIDIA container toolkit mounts the host's
# driver, so an nvidia/cuda base would only add a second copy of those libraries
# and a different Python.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0

FROM ${PYTHON_IMAGE} AS python-base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# Only what `pip install .` needs, so edits to tests or docs keep the cache.
FROM python-base AS source
WORKDIR /src
COPY pyproject.toml README.md rnnserve_cli.py ./
COPY model/ model/
COPY server/ server/
COPY training/ training/
COPY benchmarks/ benchmarks/

# torch first, from its own index: the project's `torch==2.13.0` pin is then
# already satisfied, so pip never pulls the default multi-GB CUDA build.
FROM python-base AS build-cpu
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=source /src /src
RUN pip install --no-cache-dir /src

FROM python-base AS build-cuda
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "${TORCH_CUDA_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=source /src /src
RUN pip install --no-cache-dir /src

# Everything both images share: user, weights, settings, health check.
FROM python-base AS runtime
# A home of its own: torch and matplotlib write caches under $HOME; /app stays root-owned.
RUN useradd --system --no-log-init --uid 10001 --user-group --create-home --home-dir /home/rnnserve --shell /usr/sbin/nologin rnnserve
WORKDIR /app
# Owned by root: the server only reads its weights.
COPY weights/ /app/weights/
# 0.0.0.0 only inside the container; docker-compose.yml publishes the port on the host's loopback.
ENV RNNSERVE_HOST=0.0.0.0 \
    RNNSERVE_PORT=8000 \
    RNNSERVE_WEIGHTS=/app/weights \
    RNNSERVE_DEVICE=auto \
    HOME=/home/rnnserve
USER 10001:10001
EXPOSE 8000
# slim has no curl: ask /health with the standard library; a 503 or no answer raises -> unhealthy.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('RNNSERVE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["rnnserve"]
CMD ["serve"]

FROM runtime AS cuda
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=build-cuda /opt/venv /opt/venv

# Last stage = default target.
FROM runtime AS cpu
# A C++ compiler, used here at build time: `rnnserve build-kernels` builds the CPU decode kernels
# (model/kernels/loader.py) and compiles the shipped models' decode steps into inductor's cache, in a folder the
# server reads, so that a container serving on a CPU of the same class runs no compiler. On another CPU class
# the server logs that the kernels were not built for it and compiles its decode steps in the background.
USER 0:0
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build-cpu /opt/venv /opt/venv
ENV TORCH_EXTENSIONS_DIR=/opt/rnnserve-cache/torch_extensions \
    TORCHINDUCTOR_CACHE_DIR=/opt/rnnserve-cache/inductor
RUN rnnserve build-kernels --weights /app/weights \
    && chown -R 10001:10001 /opt/rnnserve-cache
USER 10001:10001
