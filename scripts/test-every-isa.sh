#!/usr/bin/env bash
# The kernel tests again under each smaller instruction set this CPU has (VITSCOPE_ISA caps the kernels at
# it), so an AVX-512 or AMX machine also tests the AVX2 kernels, and so on: every variant the CPU can run.
# `make test` has already run them at the CPU's best set.
set -euo pipefail
cd "$(dirname "$0")/.."
isas=$(.venv/bin/python -c "from vitscope.kernels import native; print(' '.join(native.supported_isas()))")
best=${isas##* }
for isa in $isas; do
  [ "$isa" = "$best" ] && continue
  echo "kernel tests with the instruction set capped at $isa (VITSCOPE_ISA=$isa):"
  rc=0
  VITSCOPE_ISA=$isa .venv/bin/python -m pytest -q tests/kernels "$@" || rc=$?
  [ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"  # 5: no test selected (e.g. -m slow where none is slow)
done
echo "kernel variants tested on this CPU: ${isas:-none (no AVX2: the kernels do not run here)}"
