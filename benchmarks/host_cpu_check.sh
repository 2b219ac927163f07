#!/usr/bin/env bash
# The CPU side of a lent GPU machine, in one call: which of vitscope's kernel variants its processor runs, their
# tests (tests/kernels, every variant the CPU has), and the caption decoding benchmark against transformers in
# the CPU's fastest dtype (bench_caption.py, one thread, on cores the tests leave alone). Its python3 needs
# torch and transformers; a C compiler builds the kernels.
#
#   benchmarks/host_cpu_check.sh OUT_DIR [DTYPE]       DTYPE: bfloat16 (default) or float32
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?give a folder for the logs}
dtype=${2:-bfloat16}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
{ lscpu; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'capability', torch.backends.cpu.get_cpu_capability())"; gcc --version | head -1; } > "$out/cpu.txt" 2>&1
grep -E "^Model name|^CPU\(s\)" "$out/cpu.txt"
echo "flags: $(grep -o -E 'amx_[a-z0-9]+|avx512_bf16|avx512f|avx2' "$out/cpu.txt" | sort -u | tr '\n' ' ')"
tail -2 "$out/cpu.txt"
python3 - <<'PY' 2>&1 | tee -a "$out/cpu.txt"
import sys
sys.path.insert(0, "benchmarks")
from _machine import machine_header
print(machine_header())
PY
# the tests on cores 0-7, the benchmark's one thread on core 12 (its processes run one after another)
(timeout 300 taskset -c 0-7 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels > "$out/kernels.log" 2>&1;
 echo "kernel tests exit $?" >> "$out/kernels.log") &
timeout 330 taskset -c 12 python3 benchmarks/bench_caption.py --rounds 2 --repeats 2 --dtypes "$dtype" \
  > "$out/caption.log" 2>&1
echo "bench exit $?"
wait
tail -4 "$out/kernels.log"
grep -E "^\|" "$out/caption.log"
