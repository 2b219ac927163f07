"""A write that fails (a file past `ulimit -f`, a full disk) ends a command in one line naming the file, with
exit code 2, keeping the committed checkpoint and leaving no temporary or uncommitted files.

safetensors and torch.save do not raise OSError when the OS refuses a write (SafetensorError, and a
RuntimeError "unexpected pos"); `vitscope.io.atomic_write` turns both into the OSError behind them."""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from vitscope.io import atomic_write

TINY = ["train", "--model", "vit_tiny_patch4_28", "--dataset", "digits", "--epochs", "1", "--batch-size", "128",
        "--set", "embed_dim=16", "--set", "depth=1", "--set", "num_heads=2", "--explain-images", "0"]


def _vitscope(args: list[str], cwd: Path, fsize: int | None = None) -> subprocess.CompletedProcess:
    def limit():
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "vitscope", *args], cwd=cwd, capture_output=True, text=True,
                          preexec_fn=limit, env=env, timeout=300)


def _last_line(stderr: str) -> str:
    lines = [x.strip() for x in stderr.replace("\r", "\n").splitlines() if x.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def sizes(tmp_path_factory) -> dict[str, int]:
    """The sizes of a whole tiny run's files, so each limit below falls between two of them."""
    root = tmp_path_factory.mktemp("whole")
    done = _vitscope([*TINY, "--out", "run"], root)
    assert done.returncode == 0, done.stderr
    return {p.name: p.stat().st_size for p in (root / "run").iterdir()}


def _committed_only(run: Path) -> None:
    """No temporary file, and step files only where checkpoint.json commits them."""
    names = {p.name for p in run.iterdir()}
    assert not [n for n in names if n.endswith(".tmp")], names
    if "checkpoint.json" not in names:
        assert not [n for n in names if n.startswith("step-")], names


@pytest.mark.parametrize("fails_at", ["best.safetensors", "step-00000011.state.pt", "curves.png"])
def test_a_write_past_the_file_size_limit_is_one_line(sizes, tmp_path, fails_at):
    below = {"best.safetensors": 0, "step-00000011.state.pt": sizes["best.safetensors"],
             "curves.png": max(v for k, v in sizes.items() if k not in ("curves.png", "explorer.html"))}[fails_at]
    if not below < sizes[fails_at]:
        pytest.skip(f"{fails_at} is not the largest file written before it here")
    limit = (below + sizes[fails_at]) // 2 if below else sizes[fails_at] // 2
    done = _vitscope([*TINY, "--out", "run"], tmp_path, fsize=max(limit, 4096))
    line = _last_line(done.stderr)
    assert done.returncode == 2, done.stderr[-2000:]
    assert line.startswith("vitscope train: error:") and "File too large" in line, line
    assert fails_at.split("-")[0] in line or fails_at in line, line  # names the file (a step's by its folder)
    assert ("is kept" in line) or ("no checkpoint" in line) or ("no earlier checkpoint" in line), line
    assert "Traceback" not in done.stderr
    _committed_only(tmp_path / "run")


def test_a_resume_that_cannot_write_is_one_line_and_keeps_the_checkpoint(tmp_path):
    """A run stopped at step 6 (its checkpoint committed) resumes under a file-size limit its next state file
    exceeds: one line naming that file and the kept checkpoint, which then resumes once the limit is gone."""
    from test_faults import fault_config
    from vitscope.training.loop import train

    run = tmp_path / "run"
    cfg = fault_config()  # digits, checkpoints at steps 4, 8, 11, ...
    train(cfg, run, progress=False, max_steps=6)
    manifest = (run / "checkpoint.json").read_text()
    weights, state = (run / "step-00000006.safetensors").stat().st_size, (run / "step-00000006.state.pt").stat().st_size
    assert weights < state
    done = _vitscope(["train", "--resume", "run"], tmp_path, fsize=(weights + state) // 2)
    line = _last_line(done.stderr)
    assert done.returncode == 2 and "File too large" in line and "step-00000008.state.pt" in line, line
    assert "step 6" in line and "is kept" in line and "--resume" in line, line
    assert (run / "checkpoint.json").read_text() == manifest  # the committed checkpoint survives as it was
    _committed_only(run)
    assert _vitscope(["train", "--resume", "run"], tmp_path).returncode == 0  # and the run goes on from it


def test_a_writers_own_error_for_a_full_disk_becomes_the_os_error_naming_the_file(tmp_path):
    class SafetensorError(Exception):  # what safetensors raises, with the OS's error in its text
        pass

    def full(tmp):
        Path(tmp).write_bytes(b"half")
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                              "\"No space left on device\" }) (os error 28)")

    with pytest.raises(OSError) as caught:
        atomic_write(tmp_path / "w.safetensors", full)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "w.safetensors")
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone, nothing was renamed into place


def test_a_writers_bug_keeps_its_own_error(tmp_path):
    def buggy(tmp):
        raise KeyError("a bug in the writer, not a failed write")

    with pytest.raises(KeyError):
        atomic_write(tmp_path / "x.json", buggy)
    assert list(tmp_path.iterdir()) == []
