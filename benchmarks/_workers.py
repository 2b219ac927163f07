"""One measurement per process: a benchmark script runs itself with `--worker SPEC` and reads its `RESULT` line.

A fresh process per case keeps each case's peak memory, allocator state and compiled code its own, and a
neighbour's leftovers out of its timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_worker(script: str | Path, spec: dict, *, timeout_s: float, env: dict | None = None) -> dict:
    """`python SCRIPT --worker SPEC`'s result (the JSON after "RESULT " on its stdout), or `spec` with an "error":
    the last line of its stderr, or the timeout."""
    cmd = [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timed out after {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return {**spec, "error": last[:160]}
