# syntax=docker/dockerfile:1
#
# Ferry images. Two targets:
#   docker build -t ferry:0.1.0 .                      # GPU (default, last stage)
#   docker build --target cpu -t ferry:0.1.0-cpu .     # CPU torch, serves the embedded tiny model
#
# Both install the project into a virtual environment in a builder stage and copy only that environment
# into a slim runtime stage: no pip caches, no source tree, and no model weights (mount them at /models); the CPU
# image keeps g++ for its attention kernel (see the cpu stage).
#
# Changing the GPU stack: torch, the CUDA base and flash-attn must agree. flash-attn is installed from
# one of its prebuilt release wheels (never built from source: that takes hours and needs nvcc); the
# wheel's name encodes what it was built for:
#   flash_attn-<ver>+cu<CUDA major>torch<torch major.minor>cxx11abi<TRUE|FALSE>-cp<python>-...whl
# so a new TORCH_VERSION needs a FLASH_ATTN_WHEEL whose name says the same torch minor, CUDA 12, the
# image's Python (3.12 on Ubuntu 24.04 = cp312) and cxx11abiTRUE (torch >= 2.7 wheels use the C++11 ABI).
# Pick it from https://github.com/Dao-AILab/flash-attention/releases and keep TORCH_INDEX (the CUDA
# build of torch) and CUDA_IMAGE on the same CUDA major version, e.g.:
#   docker build --build-arg TORCH_VERSION=2.8.0 --build-arg FLASH_ATTN_WHEEL=<url> .

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG CPU_IMAGE=python:3.12-slim-bookworm
ARG TORCH_VERSION=2.8.0

# ---------------------------------------------------------------------------------------------------
# CPU builder: CPU-only torch (a few hundred MB instead of several GB of CUDA libraries).
FROM ${CPU_IMAGE} AS cpu-builder
ARG TORCH_VERSION
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY server /src/server
COPY bench /src/bench
COPY ferry /src/ferry
# A regular (non-editable) install: the runtime stage needs the venv only, not /src.
RUN pip install /src

# ---------------------------------------------------------------------------------------------------
# CPU runtime. `docker run -p 8000:8000 ferry:0.1.0-cpu` serves the embedded default model, which
# ships inside the package (server/default_model/), so it works with no volume and no network.
FROM ${CPU_IMAGE} AS cpu
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/ferry \
    FERRY_STATE_DIR=/data/ferry
# A fixed high UID that matches the Helm chart's securityContext and no host user. FERRY_STATE_DIR (/data/ferry,
# owned by that user) holds the SQLite database of stored responses, conversations, files and batches when no
# --database-url is given: mount a volume there (`-v ferry-state:/data/ferry`) for them to outlive the container.
# g++: the CPU attention kernel is C++ that torch's extension tooling compiles for the CPU it finds
# (engine/attention/cpu_kernel.py), and `--compile` levels other than none have inductor build C++ kernels at start-up.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 ferry \
    && useradd --uid 10001 --gid ferry --create-home --home-dir /home/ferry --shell /usr/sbin/nologin ferry \
    && mkdir -p /models /data/ferry && chown ferry:ferry /models /data/ferry
COPY --from=cpu-builder /opt/venv /opt/venv
USER 10001
WORKDIR /home/ferry
# Built now, into the image's ~/.cache/torch_extensions, so a container starts without a build; a node whose CPU
# has another instruction set (AVX2 against AVX-512) builds its own at first start (about 25 s, then cached). And
# the embedded model's tokenizer class, recorded into ~/.cache/ferry so that the front end's start skips
# transformers' AutoTokenizer and torch (server/tokenizer_class.py).
RUN python -c "from engine.attention.cpu_kernel import load_kernel; load_kernel()" \
    && python -c "from server.cli import DEFAULT_MODEL_DIR; from server.tokens import Tokenizer; Tokenizer.load(DEFAULT_MODEL_DIR)"
VOLUME ["/models"]
EXPOSE 8000
# /health is liveness (engine process alive and stepping). Python instead of curl: nothing to install.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# Listen on all interfaces inside the container (the CLI's default is loopback, unreachable through
# -p). Arguments given to `docker run` are appended; for a repeated flag the last one wins, so
# `--port 9000` still works (then publish and health-check 9000 yourself).
ENTRYPOINT ["ferry", "serve", "--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------------------
# GPU builder: CUDA torch + flash-attn from a prebuilt wheel + ferry[gpu].
FROM ${CUDA_IMAGE} AS gpu-builder
ARG TORCH_VERSION
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG FLASH_ATTN_WHEEL=https://github.com/Dao-AILab/flash-attention/releases/download/v2.8.3/flash_attn-2.8.3%2Bcu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu's own python3 (3.12 on 24.04): the same interpreter path exists in the runtime stage, so the
# venv copied there keeps working. apt packages are not pinned to versions: the archive drops old ones,
# so a pin breaks the build within weeks; the base image tag fixes the Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# flash-attn goes in before the project, so `ferry[gpu]`'s flash-attn requirement is already satisfied
# and pip never falls back to the source distribution on PyPI. (The wheel URL pins its exact version,
# which hadolint cannot see.)
# hadolint ignore=DL3013
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
    && pip install "flash-attn @ ${FLASH_ATTN_WHEEL}"
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY server /src/server
COPY bench /src/bench
COPY ferry /src/ferry
RUN pip install "/src[gpu]"

# ---------------------------------------------------------------------------------------------------
# GPU runtime (the default target). Needs the NVIDIA container toolkit: `docker run --gpus all`.
# No compiler here: nothing in Ferry JIT-compiles on a GPU today (`--compile` is refused on CUDA). Should it
# adopt torch.compile or Triton kernels there, add gcc and python3-dev (Triton builds a small C launcher on first use).
FROM ${CUDA_IMAGE} AS gpu
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/ferry \
    FERRY_STATE_DIR=/data/ferry
# The same user and state folder as the CPU image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 ferry \
    && useradd --uid 10001 --gid ferry --create-home --home-dir /home/ferry --shell /usr/sbin/nologin ferry \
    && mkdir -p /models /data/ferry && chown ferry:ferry /models /data/ferry
COPY --from=gpu-builder /opt/venv /opt/venv
USER 10001
WORKDIR /home/ferry
# The embedded model's tokenizer class, recorded as in the CPU image.
RUN python -c "from server.cli import DEFAULT_MODEL_DIR; from server.tokens import Tokenizer; Tokenizer.load(DEFAULT_MODEL_DIR)"
VOLUME ["/models"]
EXPOSE 8000
# Loading a large model takes minutes: failures during start-period do not count.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# e.g. docker run --gpus all -p 8000:8000 -v /data/models:/models ferry:0.1.0 --model /models/Llama-3.1-8B-Instruct
ENTRYPOINT ["ferry", "serve", "--host", "0.0.0.0", "--port", "8000"]
