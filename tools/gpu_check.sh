#!/usr/bin/env bash
# One prepared device check for a machine with a CUDA GPU: the `gpu` tests (paged kernel, GPU tier:
# CUDA IPC, pinned registration, streams) and the GPU benchmarks, with logs and JSON under $OUT.
#
# On the lent H200 (Python 3.12 with torch, cupy, msgpack, click, psutil, xxhash, pytest and hypothesis
# already installed) two dependencies travel as wheels. Once, on the development machine:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl lmdb==3.0.0 zstandard==0.25.0
# then run this script with `.whl` carried (about 4-6 minutes of device time):
#   run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# the optional native copy helper (the stand-in path and client puts use it when present)
python3 - <<'PY' >/dev/null 2>&1 || echo "ntcopy not built (optional)"
from setuptools import Extension, setup
setup(name="tierkv-native", script_args=["build_ext", "--inplace", "-q"],
      ext_modules=[Extension("tierkv._native._ntcopy", ["tierkv/_native/ntcopy.c"], extra_compile_args=["-O3"])])
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/client/test_paged.py tests/daemon/test_gpu_tier.py tests/integrations/test_vllm_plan.py tests/integrations/test_vllm_async.py -x \
  2>&1 | tee "$OUT/gpu_tests.log"
timeout 120 python3 tools/bench_paged.py --skip-cpu --out "$OUT/bench_paged.json" 2>&1 | tee "$OUT/bench_paged.log"
timeout 150 python3 tools/bench_transfer.py --skip a,b,c --json "$OUT/bench_transfer.json" 2>&1 \
  | tee "$OUT/bench_transfer.log"
echo "done: $OUT"
