"""A run's checkpoint: weights, optimizer, schedule, RNG and data position at one step, as one unit.

The files of step N are written whole first (each through `atomic_write`), under names stamped with
the step, and only then `checkpoint.json` is renamed into place, naming them with their sizes and
SHA-256. That rename is the commit: a crash before it leaves the previous checkpoint in force (the
new files are orphans, removed at the next start), a crash after it the new one. So the files can
never be a mixed pair:

    checkpoint.json                 {"step": N, "files": {...}, "sha256": {...}}, written last
    step-0000000N.safetensors       the weights, with the run's classes, mean and std (eval reads them)
    step-0000000N.ema.safetensors   the moving average of the weights, with --ema-decay
    step-0000000N.state.pt          optimizer, generators, step, data position (torch.load weights_only)
    last.safetensors                a hard link to the committed weights, for eval, predict and explain

Finding, checking and loading a checkpoint to resume from is resume.py's. `FAULT` lets the fault tests stop
the process at each point between and during the writes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vitscope.errors import VitscopeError
from vitscope.io import atomic_write
from vitscope.weights.model_io import model_file_writer, save_training_state

MANIFEST = "checkpoint.json"
LAST = "last.safetensors"
LEGACY_STATE = "last.state.pt"
LEGACY_EMA = "last.ema.safetensors"
STEP_FILE = re.compile(r"^step-(\d+)\.(safetensors|ema\.safetensors|state\.pt)$")

# The fault tests set this to a function of the point's name ("after-weights", ...) that kills the
# process or raises there; None in every real run.
FAULT: Callable[[str], None] | None = None


def _fault(point: str) -> None:
    if FAULT is not None:
        FAULT(point)


class CheckpointError(VitscopeError):
    """A checkpoint that cannot be written, or a run that cannot be resumed from what it holds. One line."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as found on disk: its step and files."""

    run_dir: Path
    step: int
    weights: Path
    state: Path | None  # None: weights alone (resume --weights-only)
    ema: Path | None

    def describe(self) -> str:
        names = [p.name for p in (self.weights, self.ema, self.state) if p is not None]
        return f"step {self.step} ({' + '.join(names)})"


def stamp(step: int) -> str:
    return f"step-{step:08d}"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(run_dir: Path) -> dict | None:
    """The committed checkpoint's manifest, or None where there is none."""
    path = run_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text())
        if not (isinstance(m, dict) and isinstance(m.get("step"), int) and isinstance(m.get("files"), dict)
                and isinstance(m.get("sha256"), dict) and {"weights", "state"} <= set(m["files"])
                and all(isinstance(v, str) and STEP_FILE.match(v) for v in m["files"].values())):
            raise ValueError("not a vitscope checkpoint manifest")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot resume {run_dir}: {path} is damaged ({e}); vitscope writes it whole, so "
                              f"it changed after it was saved. Continue from the weights alone with --weights-only, "
                              f"or train again") from None
    return m


# -- writing ------------------------------------------------------------------------------------------
def save_checkpoint(run_dir: Path, step: int, *, model, ema, state: dict, metadata: dict,
                    previous: Checkpoint | None) -> Checkpoint:
    """Write step `step` as one unit (see the module docstring) and drop the previous one.

    An OSError (a full disk, a folder made read-only) removes what was written of this step and raises a
    CheckpointError saying that `previous` is kept."""
    run_dir = Path(run_dir)
    base = stamp(step)
    weights, state_file = run_dir / f"{base}.safetensors", run_dir / f"{base}.state.pt"
    ema_file = run_dir / f"{base}.ema.safetensors" if ema is not None else None
    meta = {**metadata, "step": str(step)}
    written: list[Path] = []
    try:
        _fault("before-weights")
        atomic_write(weights, _during(model_file_writer(model, meta), "during-weights"))
        written.append(weights)
        _fault("after-weights")
        if ema_file is not None:
            atomic_write(ema_file, model_file_writer(ema, meta))
            written.append(ema_file)
            _fault("after-ema")
        save_training_state(state_file, {**state, "step": step})
        written.append(state_file)
        _fault("after-state")
        files = {"weights": weights.name, "state": state_file.name}
        if ema_file is not None:
            files["ema"] = ema_file.name
        manifest = {"format": 1, "step": step, "files": files,
                    "bytes": {p.name: p.stat().st_size for p in written},
                    "sha256": {p.name: file_sha256(p) for p in written}}
        atomic_write(run_dir / MANIFEST, _during(lambda tmp: Path(tmp).write_text(json.dumps(manifest, indent=2)),
                                                 "during-manifest"))
    except OSError as e:
        committed = _committed_step(run_dir) == step
        if not committed:
            for p in written:
                p.unlink(missing_ok=True)
        if previous is not None:
            kept, again = (f"the previous checkpoint, {previous.describe()}, is kept",
                           f"continue with: vitscope train --resume {run_dir}")
        else:
            kept, again = "there is no earlier checkpoint", f"train again (with --overwrite to reuse {run_dir})"
        raise CheckpointError(f"could not write the checkpoint of step {step} to {run_dir}: {_os_reason(e)}; "
                              f"{kept}. {_os_advice(e)}, then {again}") from e
    _fault("after-manifest")
    found = Checkpoint(run_dir, step, weights, state_file, ema_file)
    link_last(found)
    _fault("after-link")
    remove_other_steps(run_dir, keep=step)
    for name in (LEGACY_STATE, LEGACY_EMA):  # a run from before manifests, now superseded
        (run_dir / name).unlink(missing_ok=True)
    return found


def _during(write: Callable[[str], None], point: str) -> Callable[[str], None]:
    """`write`, then the fault point: the temporary file is whole but not yet renamed."""
    def run(tmp: str) -> None:
        write(tmp)
        _fault(point)
    return run


def _committed_step(run_dir: Path) -> int | None:
    try:
        m = read_manifest(run_dir)
    except CheckpointError:
        return None
    return m["step"] if m else None


def link_last(ckpt: Checkpoint) -> None:
    """Point last.safetensors at the checkpoint's weights (a hard link renamed into place; a copy where the
    file system has no hard links). Readers see the previous last.safetensors or this one."""
    target = ckpt.run_dir / LAST
    tmp = ckpt.run_dir / f".{LAST}.link.tmp"
    tmp.unlink(missing_ok=True)
    try:
        if target.exists() and os.path.samefile(ckpt.weights, target):
            return  # already linked (a resume): renaming a link onto its own file is a no-op that keeps tmp
        os.link(ckpt.weights, tmp)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        data = ckpt.weights.read_bytes()
        atomic_write(target, lambda t: Path(t).write_bytes(data))


def remove_other_steps(run_dir: Path, keep: int | None) -> list[Path]:
    """Delete step-stamped files of any step but `keep`: superseded checkpoints and uncommitted orphans."""
    removed = []
    for p in run_dir.iterdir() if run_dir.is_dir() else ():
        m = STEP_FILE.match(p.name)
        if m and int(m.group(1)) != keep:
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _os_reason(e: OSError) -> str:
    where = f" ({e.filename})" if e.filename else ""
    return f"{e.strerror or e}{where}"


def _os_advice(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "Free some disk space"
    if e.errno == errno.EFBIG:
        return "Raise the file-size limit (ulimit -f)"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "Make the folder writable"
    return "Fix the folder"
