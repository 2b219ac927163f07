"""What a benchmark ran on: machine, versions and commit, printed beside every table.

Shared by the scripts in this folder so every RESULTS.md section carries the same evidence:

    from _machine import machine_info, machine_header
    print(machine_header())          # markdown bullet list
    info = machine_info()            # the same facts as a dict, e.g. for JSON output

and `rate_text`, how every table prints a rate such as images/s.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Instruction-set extensions that decide matmul and attention speed on CPU.
_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor describes them all
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    model = fields.get("model name", model)
    if "cpu family" in fields:
        model += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    present = set(fields.get("flags", "").split())
    flags = [f for f in _ISA_FLAGS if f in present]
    return model, flags


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def commit() -> str:
    """Short hash of HEAD, with '+dirty' when tracked files differ from it."""
    rev = _git("rev-parse", "--short=10", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return rev + ("+dirty" if dirty else "")


def uncommitted() -> str:
    """Tracked files that differ from HEAD (what '+dirty' means), or 'none'."""
    paths = _git("diff", "--name-only", "HEAD").splitlines()
    return ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "") or "none"


def kernels_running() -> str:
    """vitscope's kernels that can run here (name, instruction set, dtype), as `vitscope bench` lists them:
    a table's vitscope rows are only comparable between machines, or commits, that run the same ones."""
    from vitscope import kernels

    running = [f"{k.name} ({k.isa or 'oneDNN'}, {'/'.join(k.dtypes)})" for k in kernels.KERNELS
               if kernels.why_not(k) is None]
    cap = os.environ.get("VITSCOPE_ISA")
    return (", ".join(running) or "none") + (f" (capped by VITSCOPE_ISA={cap})" if cap else "")


def machine_info() -> dict[str, object]:
    """Facts about this machine and software, for a benchmark's header."""
    import torch

    from vitscope.kernels import bf16

    model, flags = _cpuinfo()
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": model,
        "cpu_flags": " ".join(flags) or "none of " + ", ".join(_ISA_FLAGS),
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_matmul": "native (oneDNN)" if bf16.native_matmul() else "emulated (PyTorch's fallback loop; slow)",
        "vitscope_kernels": kernels_running(),
        "python": platform.python_version(),
        "vitscope_commit": commit(),
        "uncommitted": uncommitted(),
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?",
    }


def machine_header(extra: dict[str, object] | None = None) -> str:
    """Markdown bullet list of `machine_info()` (plus `extra` facts), one fact per line."""
    info = {**machine_info(), **(extra or {})}
    labels = {
        "date": "date",
        "cpu": "CPU",
        "cpu_flags": "CPU ISA flags",
        "cores": "logical cores",
        "memory_gib": "memory (GiB)",
        "torch_threads": "torch threads",
        "torch": "torch",
        "torch_cpu_capability": "torch CPU capability",
        "bf16_matmul": "bfloat16 matmuls",
        "vitscope_kernels": "vitscope's kernels that run here",
        "python": "python",
        "vitscope_commit": "vitscope commit",
        "uncommitted": "tracked files changed since that commit",
        "load_average": "load average (1, 5, 15 min) at start",
    }
    return "\n".join(f"- {labels.get(k, k)}: {v}" for k, v in info.items())


def rate_text(rate: float) -> str:
    """A rate for a table: whole numbers from 100 up, one decimal below (ViT-S/16 trains at 3-4 images/s on
    2 cores, where whole numbers would read 3 and 4 for 3.4 and 3.6)."""
    return f"{rate:,.0f}" if rate >= 99.95 else f"{rate:.1f}"


if __name__ == "__main__":
    print(machine_header())
