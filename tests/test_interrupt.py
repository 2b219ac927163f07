"""Ctrl-C at any moment of a command, torch's import included, is one line and exit code 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

TINY = ["train", "--model", "vit_tiny_patch4_28", "--dataset", "digits", "--epochs", "3", "--batch-size", "64",
        "--set", "embed_dim=16", "--set", "depth=1", "--set", "num_heads=2", "--explain-images", "0"]


# while Python, then torch, then vitscope loads, or trains
@pytest.mark.parametrize("after_s", [0.3, 0.6, 1.0, 1.5, 2.5])
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(tmp_path, after_s):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "vitscope", *TINY, "--out", str(tmp_path / "run")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(after_s)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    if child.returncode == 0:
        pytest.skip(f"the run finished within {after_s} s, before the signal")
    if child.returncode == -signal.SIGINT and not err.strip():
        pytest.skip("the signal came before the interpreter could take it (a machine too busy to start Python)")
    lines = [x.strip() for x in err.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("train ")]
    assert child.returncode == 130, err[-2000:]
    assert "Traceback" not in err and len(lines) <= 2, lines  # a stopped run also names its checkpoint
    assert lines and ("interrupted" in lines[-1] or "signal" in lines[-1]), lines
