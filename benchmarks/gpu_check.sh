#!/usr/bin/env bash
# Issue 5's checks on a CUDA GPU machine, in one call: the CUDA tests, bench_gpu.py's tables, and the
# default training run (`make run`'s preset) on the GPU. Its python3 needs torch and transformers;
# vit-pytorch and kornia may come as wheels in .whl/ (installed into /tmp/site, no index).
#
#   benchmarks/gpu_check.sh OUT_DIR [PART ...]     PARTs: tests bench probe compile train (default: all)
#
# DATA names Fashion-MNIST's folder (default Debian's). Each part has its own time limit, so one that
# hangs cannot take the others' time; each writes its log into OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?give a folder for the logs}
shift
parts=${*:-tests bench probe train}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
data=${DATA:-/usr/share/datasets/fashion-mnist}

for part in $parts; do
  start=$(date +%s)
  case $part in
    tests)
      { nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
        timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py; } > "$out/tests.log" 2>&1
      tail -n 4 "$out/tests.log" ;;
    bench)  # eager ViT rows and the attention table
      timeout 200 python3 benchmarks/bench_gpu.py --out "$out/gpu.md" > "$out/bench.log" 2>&1
      grep -E "^\| (fmnist|vit_s)" "$out/bench.log" ;;
    probe)  # does ViT-S/16's training step compile with Inductor's coalesce tiling analysis off?
      timeout 150 python3 benchmarks/bench_gpu.py --compile --compile-only --no-coalesce-tiling --shapes vit_s16 \
        --impls vitscope vit-pytorch --no-attention --out "$out/probe.md" > "$out/probe.log" 2>&1
      grep -E "^\| vit_s|rror" "$out/probe.log" | cut -c1-220 ;;
    compile)  # every compiled training row, the tiling analysis off
      timeout 420 python3 benchmarks/bench_gpu.py --compile --compile-only --no-coalesce-tiling --no-attention \
        --out "$out/compile.md" > "$out/compile.log" 2>&1
      grep -E "^\| (fmnist|vit_s)" "$out/compile.log" | cut -c1-220 ;;
    train)  # `make run`'s job on the GPU: fmnist_quick, seed 0
      rm -rf /tmp/gpu_run
      timeout 240 python3 -m vitscope train --preset fmnist_quick --data-dir "$data" --out /tmp/gpu_run \
        --no-progress > "$out/train.log" 2>&1
      cp /tmp/gpu_run/metrics.jsonl "$out/" 2>/dev/null
      cat /tmp/gpu_run/summary.json >> "$out/train.log" 2>/dev/null
      tail -n 6 "$out/train.log" ;;
    *) echo "unknown part $part" ;;
  esac
  echo "== $part: $(( $(date +%s) - start )) s"
done
