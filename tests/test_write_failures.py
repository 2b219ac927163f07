"""A write that fails (a file past `ulimit -f`, a full disk) ends a command in one line naming the file, with
exit code 2, keeping the committed checkpoint and leaving no temporary or uncommitted files: for classification
and captioning runs, fresh and resumed.

safetensors and torch.save do not raise OSError when the OS refuses a write (SafetensorError, and a
RuntimeError "unexpected pos"); `vitscope.io.atomic_write` turns both into the OSError behind them. A full disk
is a small tmpfs mounted in a private mount namespace (`unshare -m`, as root; skipped where that is not
allowed), the file-size limit RLIMIT_FSIZE in the child process."""

from __future__ import annotations

import errno
import os
import resource
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_caption_train import toy  # noqa: F401 (a fixture: fmnist_scenes as toy scenes)
from vitscope.io import atomic_write

TINY = ["train", "--model", "vit_tiny_patch4_28", "--dataset", "digits", "--epochs", "1", "--batch-size", "128",
        "--set", "embed_dim=16", "--set", "depth=1", "--set", "num_heads=2", "--explain-images", "0"]


# The caption runs' child: `vitscope` with fmnist_scenes as the toy scenes the caption tests train on (96
# training and 12 test scenes, a few seconds), and the Fashion-MNIST files not needed.
CAPTION_CHILD = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_caption_train import toy_scenes
from vitscope.caption import builders
real = builders.load_caption_dataset
def load(name, split, **kw):
    if name == "fmnist_scenes" and split in ("train", "test"):
        return toy_scenes(split, 96 if split == "train" else 12)
    return real(name, split, **kw)
builders.load_caption_dataset = load
from vitscope.console import main
sys.exit(main(sys.argv[1:]))
"""
CAPTION = ["train", "--task", "caption", "--model", "vit_tiny_patch7_28", "--set", "depth=1", "--set",
           "embed_dim=32", "--set", "num_heads=2", "--decoder-set", "dim=32", "--decoder-set", "depth=1",
           "--decoder-set", "num_heads=2", "--dataset", "fmnist_scenes", "--epochs", "1", "--batch-size", "32",
           "--eval-batch-size", "16", "--amp", "fp32", "--threads", "1", "--max-len", "40", "--explain-images",
           "0", "--no-progress"]


def _command(args: list[str], caption: bool = False) -> list[str]:
    return [sys.executable, *(["-c", CAPTION_CHILD] if caption else ["-m", "vitscope"]), *args]


def _vitscope(args: list[str], cwd: Path, fsize: int | None = None, caption: bool = False
              ) -> subprocess.CompletedProcess:
    def limit():
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(_command(args, caption), cwd=cwd, capture_output=True, text=True,
                          preexec_fn=limit, env=env, timeout=300)


def _on_a_small_disk(args: list[str], tmp: Path, size: int, start_from: Path | None = None,
                     caption: bool = False) -> tuple[subprocess.CompletedProcess, Path]:
    """`vitscope ARGS` with a tmpfs of `size` bytes mounted at tmp/disk in a private mount namespace (holding a
    copy of the run `start_from` as tmp/disk/run, if given; ARGS name tmp/disk/run as their run folder). The
    tmpfs goes with the namespace, so what it held after the command is copied to tmp/after for the test."""
    disk, after = tmp / "disk", tmp / "after"
    disk.mkdir()
    steps = [f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(disk))} || exit 97"]
    if start_from is not None:
        steps.append(f"cp -a {shlex.quote(str(start_from))} {shlex.quote(str(disk / 'run'))} || exit 98")
    steps += [shlex.join(_command(args, caption)), "code=$?",
              f"cp -a {shlex.quote(str(disk))} {shlex.quote(str(after))}", "exit $code"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["unshare", "-m", "sh", "-c", "\n".join(steps)], cwd=tmp, capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode not in (97, 98), done.stderr
    return done, after / "run"


@pytest.fixture(scope="module")
def small_disks(tmp_path_factory) -> None:
    """Skips where this user may not mount a tmpfs in a mount namespace of its own (not root, a container)."""
    where = tmp_path_factory.mktemp("probe")
    if shutil.which("unshare") is None:
        pytest.skip("no unshare command")
    done = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=8k tmpfs {shlex.quote(str(where))}"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {done.stderr.strip()}")


def _pages(*sizes: int) -> int:
    """Bytes a tmpfs spends on files of these sizes (whole 4 KiB pages)."""
    return sum(-(-s // 4096) * 4096 for s in sizes)


def _run_pages(run: Path) -> int:
    """Bytes a tmpfs spends on a run folder's files (hard links once)."""
    seen = {p.stat().st_ino: p.stat().st_size for p in run.iterdir() if p.is_file()}
    return _pages(*seen.values())


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


def _one_line(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2 and one line on stderr, holding every fragment and saying which checkpoint there is."""
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    line = lines[0]
    assert line.startswith("vitscope train: error:"), line
    assert ("is kept" in line) or ("no checkpoint" in line) or ("no earlier checkpoint" in line), line
    for f in fragments:
        assert f in line, line
    return line


# -- a full disk: a small tmpfs as the run folder -------------------------------------------------------------
@pytest.mark.parametrize("fails_at", ["best.safetensors", "state.pt"])
def test_a_full_disk_is_one_line_naming_the_file(small_disks, sizes, tmp_path, fails_at):
    """Room for the run's first files and half of the one that fails: safetensors' SafetensorError (best) and
    torch.save's RuntimeError (the training state) both end as "No space left on device" naming the file."""
    room = _pages(sizes["config.json"], sizes["metrics.jsonl"])
    if fails_at == "state.pt":  # best and the step's weights (last.safetensors is a link to them) fit
        room += 2 * _pages(sizes["best.safetensors"]) + _pages(sizes["step-00000011.state.pt"]) // 2
    else:
        room += _pages(sizes["best.safetensors"]) // 2
    done, run = _on_a_small_disk([*TINY, "--no-progress", "--out", str(tmp_path / "disk" / "run")], tmp_path, room)
    _one_line(done, "No space left on device", fails_at)
    assert "Traceback" not in done.stderr
    _committed_only(run)


@pytest.fixture
def stopped_at_step_6(tmp_path) -> Path:
    """A digits run stopped at step 6, its checkpoint committed; the next is at step 8."""
    from test_faults import fault_config
    from vitscope.training.loop import train

    run = tmp_path / "stopped"
    train(fault_config(), run, progress=False, max_steps=6)
    return run


def test_a_resume_onto_a_full_disk_is_one_line_and_keeps_the_checkpoint(small_disks, stopped_at_step_6, tmp_path):
    run = stopped_at_step_6
    weights, state = (run / "step-00000006.safetensors").stat().st_size, (run / "step-00000006.state.pt").stat().st_size
    room = _run_pages(run) + _pages(weights) + _pages(state) // 2  # step 8's weights fit, its state does not
    done, after = _on_a_small_disk(["train", "--resume", str(tmp_path / "disk" / "run"), "--no-progress"], tmp_path,
                                   room, start_from=run)
    _one_line(done, "No space left on device", "step-00000008", "step 6", "is kept", "--resume")
    assert (after / "checkpoint.json").read_text() == (run / "checkpoint.json").read_text()
    _committed_only(after)
    assert _vitscope(["train", "--resume", str(after), "--no-progress"], tmp_path).returncode == 0  # it goes on


# -- caption runs: the same writes, the same lines ------------------------------------------------------------
@pytest.fixture(scope="module")
def caption_sizes(tmp_path_factory) -> dict[str, int]:
    root = tmp_path_factory.mktemp("caption_whole")
    done = _vitscope([*CAPTION, "--out", "run"], root, caption=True)
    assert done.returncode == 0, done.stderr
    return {p.name: p.stat().st_size for p in (root / "run").iterdir()}


@pytest.mark.slow  # the classification tests above take the same code path
@pytest.mark.parametrize("disk", ["file-size limit", "tmpfs"])
@pytest.mark.parametrize("fails_at", ["best.safetensors", "state.pt"])
def test_a_caption_run_that_cannot_write_is_one_line(caption_sizes, tmp_path, request, disk, fails_at):
    """A caption run (3 steps, then its evaluation, best.safetensors and the checkpoint of step 3) whose
    best.safetensors or training state does not fit."""
    sizes = caption_sizes
    out = tmp_path / ("disk" if disk == "tmpfs" else "") / "run"
    args = [*CAPTION, "--out", str(out)]
    if disk == "tmpfs":
        request.getfixturevalue("small_disks")
        room = _pages(sizes["config.json"], sizes["metrics.jsonl"])
        if fails_at == "state.pt":
            room += 2 * _pages(sizes["best.safetensors"]) + _pages(sizes["step-00000003.state.pt"]) // 2
        else:
            room += _pages(sizes["best.safetensors"]) // 2
        done, run = _on_a_small_disk(args, tmp_path, room, caption=True)
        reason = "No space left on device"
    else:
        weights, state = sizes["best.safetensors"], sizes["step-00000003.state.pt"]
        assert weights < state
        limit = weights // 2 if fails_at == "best.safetensors" else (weights + state) // 2
        done = _vitscope(args, tmp_path, fsize=limit, caption=True)
        run, reason = out, "File too large"
    _one_line(done, reason, fails_at)
    assert "Traceback" not in done.stderr
    _committed_only(run)


@pytest.fixture
def caption_stopped_at_step_5(tmp_path, request) -> Path:
    """A caption run (12 steps an epoch) stopped at step 5, its checkpoint committed; the next is at step 12, after
    the epoch's evaluation and best.safetensors."""
    from test_caption_train import tiny_caption_config
    from vitscope.training.loop import train

    request.getfixturevalue("toy")
    run = tmp_path / "stopped"
    train(tiny_caption_config(epochs=2, explain_images=0), run, progress=False, max_steps=5)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("disk", ["file-size limit", "tmpfs"])
def test_a_caption_resume_that_cannot_write_keeps_the_checkpoint(caption_stopped_at_step_5, tmp_path, request, disk):
    run = caption_stopped_at_step_5
    weights, state = (run / "step-00000005.safetensors").stat().st_size, (run / "step-00000005.state.pt").stat().st_size
    manifest = (run / "checkpoint.json").read_text()
    if disk == "tmpfs":
        request.getfixturevalue("small_disks")
        room = _run_pages(run) + 2 * _pages(weights) + _pages(state) // 2  # best and step 12's weights fit
        done, run = _on_a_small_disk(["train", "--resume", str(tmp_path / "disk" / "run"), "--no-progress"],
                                     tmp_path, room, start_from=run, caption=True)
        reason = "No space left on device"
    else:
        done = _vitscope(["train", "--resume", str(run), "--no-progress"], tmp_path, fsize=(weights + state) // 2,
                         caption=True)
        reason = "File too large"
    _one_line(done, reason, "step-00000012.state.pt", "step 5", "is kept", "--resume")
    assert (run / "checkpoint.json").read_text() == manifest
    _committed_only(run)
