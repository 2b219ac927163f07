"""A run directory's keeping: never overwritten by surprise, one training at a time, tidy after a crash.

- `check_target` refuses, before any work, to train into a directory that holds a run (unless
  resuming it or told to overwrite it), into a file, or where nothing can be written.
- `RunLock` keeps a second training out while one runs there; the lock file names the holder's
  process. It is an advisory `flock`, so a killed process holds it no longer.
- `take` makes the directory the training's once it can start: locked, tidied, its config written.
- `clean_stale` removes what a killed run left behind: `.*.tmp` files and uncommitted checkpoint files.
- `cut_metrics` drops the metric rows past the checkpoint a run resumes from, so no epoch is twice.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path

from vitscope.errors import VitscopeError
from vitscope.io import atomic_write
from vitscope.training.checkpointing import (
    LAST,
    LEGACY_EMA,
    LEGACY_STATE,
    MANIFEST,
    Checkpoint,
    link_last,
    remove_other_steps,
)

LOCK = ".vitscope.lock"
# Files a training writes; the first ones mark a directory as holding a run.
RUN_MARKERS = ("config.json", "metrics.jsonl", MANIFEST, LAST, "best.safetensors", "summary.json", LEGACY_STATE)
# probes.html: runs before the explorers took its slider wrote it; --overwrite removes it with the rest.
RUN_FILES = (*RUN_MARKERS, LEGACY_EMA, "curves.png", "confusion.png", "explorer.html", "caption_attention.png",
             "captions.html", "alignment.png", "translations.html", "probes.safetensors", "probes.png",
             "probes.html")


class RunDirError(VitscopeError):
    """A run directory that cannot be trained into as asked. The message says what to do."""


def run_files(run_dir: Path) -> list[str]:
    """The names in `run_dir` that mark a vitscope run."""
    if not run_dir.is_dir():
        return []
    names = [n for n in RUN_MARKERS if (run_dir / n).exists()]
    return names + sorted(p.name for p in run_dir.glob("step-*.state.pt"))


def check_target(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Before any work: `run_dir` can take this training, or a RunDirError says why not and what to do."""
    _not_a_file(run_dir)
    if resume:
        if not (run_dir / "config.json").is_file():
            why = "does not exist" if not run_dir.exists() else "holds no config.json: not a vitscope run"
            raise RunDirError(f"cannot resume {run_dir}: it {why}; give the folder a `vitscope train` wrote")
    elif not overwrite:
        found = run_files(run_dir)
        if found:
            raise RunDirError(f"{run_dir} already holds a run ({', '.join(found[:4])}); continue it with "
                              f"--resume {run_dir}, train into another --out, or pass --overwrite to replace it")
    probe_writable(run_dir)


def _not_a_file(path: Path) -> None:
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise RunDirError(f"{p} is a file, where the run's folder {'goes' if p == path else 'should be'}; "
                                  f"choose another --out")
            return


def probe_writable(path: Path) -> None:
    """Write and remove a file in `path` (or the nearest folder above it that exists): the one test that
    also holds for root and for a read-only file system. Leaves the folder as it was."""
    target = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    try:
        fd, tmp = tempfile.mkstemp(dir=target, prefix=".vitscope-probe.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise RunDirError(f"cannot write in {target}: {e.strerror or e}; choose a folder you can write to "
                          f"(--out), or make it writable") from None


class RunLock:
    """`with RunLock(run_dir):` holds the run directory for one training (the folder must exist)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.fd: int | None = None
        self.created = False  # False: a killed training's lock file was there before
        self.previous = b""

    def acquire(self) -> RunLock:
        while True:
            self.created = not self.path.exists()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                _flock(fd)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                who = f"process {holder}" if holder else "another process"
                raise RunDirError(f"{self.path.parent} is in use by another training ({who}, which holds "
                                  f"{self.path}); wait for it to end or stop it, or train into another --out"
                                  ) from None
            # The holder before us may have removed the file after we opened it: lock the file at the path.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.previous = os.pread(fd, 4096, 0)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self, remove: bool = True) -> None:
        """Unlock; `remove` the lock file too (a start that failed leaves a stale one from before as it was)."""
        if self.fd is None:
            return
        try:
            if remove:
                self.path.unlink(missing_ok=True)
            else:
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, self.previous, 0)
        finally:
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, exc_type, *exc) -> None:
        self.release(remove=exc_type is None or self.created)


def _flock(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # Windows: the file's existence is the lock
        if os.fstat(fd).st_size:
            raise BlockingIOError(errno.EWOULDBLOCK, "locked") from None
        return
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError, AttributeError):
        return None


def take(run_dir: Path, held: ExitStack, config: dict, found: Checkpoint | None, *, overwrite: bool) -> None:
    """Make `run_dir` this training's, now that it can start: locked, tidied after a crash, and for a new run
    holding its config (and no earlier run's files, with `overwrite`)."""
    if found is not None:  # locked since the start
        clean_stale(run_dir, keep_step=found.step)
        cut_metrics(run_dir / "metrics.jsonl", found.step)
        if found.state is not None and found.weights.name != LAST:
            link_last(found)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    held.enter_context(RunLock(run_dir))
    if overwrite:
        clear_run(run_dir)
    else:
        check_target(run_dir, resume=False, overwrite=False)  # another training may have got there first
    clean_stale(run_dir, keep_step=None)
    atomic_write(run_dir / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2)))


def clean_stale(run_dir: Path, *, keep_step: int | None) -> list[Path]:
    """Remove the temporary files (`.*.tmp`) of writes a killed process never finished, and checkpoint files
    of any step but `keep_step` (the committed one; None: keep none). Call with the lock held."""
    removed = [p for p in run_dir.glob(".*.tmp") if p.is_file()]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed + remove_other_steps(run_dir, keep_step)


def clear_run(run_dir: Path) -> None:
    """--overwrite: remove the files a training writes (and nothing else in the folder)."""
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    remove_other_steps(run_dir, None)


def cut_metrics(path: Path, step: int) -> int:
    """Keep the rows of metrics.jsonl up to `step` (and drop a line a crash cut short); returns the number of
    rows dropped. The file is rewritten whole, so a crash here leaves the old one."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            keep = isinstance(row, dict) and int(row.get("step", 0)) <= step
        except (ValueError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        elif line.strip():
            dropped += 1
    if dropped:
        atomic_write(path, lambda tmp: Path(tmp).write_text("".join(k + "\n" for k in kept)))
    return dropped
