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

Resume (`find_checkpoint`) checks the unit: every file present, of the size and hash the manifest
gives, and the weights and state at the manifest's step. A run written before manifests existed
(last.safetensors + last.state.pt) resumes when both hold the same step and is refused otherwise.
`FAULT` lets the fault tests stop the process at each point between and during the writes.
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

import torch

from vitscope.errors import VitscopeError
from vitscope.io import atomic_write
from vitscope.training.progress import best_metric_key
from vitscope.weights.model_io import (
    load_training_state,
    load_weights,
    model_file_writer,
    read_metadata,
    save_training_state,
)

MANIFEST = "checkpoint.json"
LAST = "last.safetensors"
LEGACY_STATE = "last.state.pt"
LEGACY_EMA = "last.ema.safetensors"
_STEP_FILE = re.compile(r"^step-(\d+)\.(safetensors|ema\.safetensors|state\.pt)$")

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


def _sha256(path: Path) -> str:
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
                and all(isinstance(v, str) and _STEP_FILE.match(v) for v in m["files"].values())):
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
                    "sha256": {p.name: _sha256(p) for p in written}}
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
        m = _STEP_FILE.match(p.name)
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


# -- finding and loading ------------------------------------------------------------------------------
def _refuse(run_dir: Path, what: str, weights_hint: bool = True) -> CheckpointError:
    hint = (f"Continue from the weights alone with: vitscope train --resume {run_dir} --weights-only (the "
            f"optimizer and random state start afresh, so the result will differ from an uninterrupted run), or "
            if weights_hint else "Or ")
    # `what` may be another error's message, with its own full stop
    return CheckpointError(f"cannot resume {run_dir}: {what.rstrip().rstrip('.')}. {hint}train again: vitscope train "
                           f"--config {run_dir / 'config.json'} --out NEW_DIR")


def find_checkpoint(run_dir: Path, *, weights_only: bool = False) -> Checkpoint:
    """The run's checkpoint, checked as a unit; a CheckpointError saying what was found where it is not one.

    With `weights_only` the weights alone (the manifest's, else last.safetensors) are enough."""
    run_dir = Path(run_dir)
    try:
        m = read_manifest(run_dir)
    except CheckpointError:
        if not weights_only or not (run_dir / LAST).is_file():
            raise
        m = None  # the weights alone: last.safetensors, whatever the manifest says
    if m is not None:
        files = m["files"]
        step = m["step"]
        paths = {k: run_dir / v for k, v in files.items()}
        needed = ["weights"] if weights_only else list(paths)
        for key in needed:
            p = paths[key]
            if not p.is_file():
                raise _refuse(run_dir, f"its {MANIFEST} names step {step}, but {p.name} is missing",
                              weights_hint=key != "weights")
            want_size, want_hash = m.get("bytes", {}).get(p.name), m["sha256"].get(p.name)
            if (want_size is not None and p.stat().st_size != want_size) or _sha256(p) != want_hash:
                raise _refuse(run_dir, f"{p.name} is not the file {MANIFEST} was written with (its size or SHA-256 "
                                       f"differ: changed or copied over since)", weights_hint=key != "weights")
        ckpt = Checkpoint(run_dir, step, paths["weights"], None if weights_only else paths["state"],
                          paths.get("ema"))
        _check_weights_step(ckpt)
        return ckpt
    weights, state = run_dir / LAST, run_dir / LEGACY_STATE
    steps = sorted(p.name for p in run_dir.glob("step-*") if _STEP_FILE.match(p.name)) if run_dir.is_dir() else []
    if steps and not state.is_file() and not weights_only:  # today's layout, its manifest gone
        what = "is a folder" if (run_dir / MANIFEST).is_dir() else "is missing"
        raise _refuse(run_dir, f"{run_dir / MANIFEST}, the file that says which step files form the checkpoint, "
                               f"{what}, so {', '.join(steps[:3])} cannot be checked as one unit")
    if not weights.is_file() and not state.is_file():
        raise CheckpointError(f"cannot resume {run_dir}: it holds no checkpoint yet (stopped before its first "
                              f"one); train it again: vitscope train --config {run_dir / 'config.json'} "
                              f"--out {run_dir} --overwrite")
    if not weights.is_file():
        raise _refuse(run_dir, f"{LAST} is missing beside {LEGACY_STATE}", weights_hint=False)
    ema = run_dir / LEGACY_EMA
    if weights_only:
        return Checkpoint(run_dir, _weights_step(weights), weights, None, ema if ema.is_file() else None)
    if not state.is_file():
        raise _refuse(run_dir, f"{state} is missing (the optimizer, random state and data position that a run "
                               f"saves beside {LAST})")
    state_step = _state_step(run_dir, state)
    weights_step = _weights_step(weights)
    if weights_step != state_step:
        raise _refuse(run_dir, f"its checkpoint is a mixed pair: {LAST} holds step {weights_step} but "
                               f"{LEGACY_STATE} step {state_step} (a run stopped between the two writes)")
    return Checkpoint(run_dir, state_step, weights, state, ema if ema.is_file() else None)


def _weights_step(path: Path) -> int:
    try:
        return read_metadata(path).json("step", int, -1)
    except ValueError as e:
        raise CheckpointError(f"cannot resume {path.parent}: {e}") from None


def _state_step(run_dir: Path, path: Path) -> int:
    state = _load_state(run_dir, path)
    return state["step"]


def _check_weights_step(ckpt: Checkpoint) -> None:
    got = _weights_step(ckpt.weights)
    if got != ckpt.step:
        raise _refuse(ckpt.run_dir, f"{ckpt.weights.name} holds step {got} but {MANIFEST} says {ckpt.step}",
                      weights_hint=False)


# What a state file must hold, with the type of each entry.
_STATE_KEYS = {"optimizer": dict, "generator": torch.Tensor, "torch_rng": torch.Tensor, "step": int,
               "best_metric": float, "train_time_s": float, "seen": int}


def _load_state(run_dir: Path, path: Path) -> dict:
    try:
        state = load_training_state(path)
    except (OSError, ValueError) as e:
        raise _refuse(run_dir, str(e)) from None
    if not isinstance(state, dict):
        raise _refuse(run_dir, f"{path.name} holds a {type(state).__name__}, not a training state")
    for key, kind in _STATE_KEYS.items():
        key = best_metric_key(state) if key == "best_metric" else key
        value = state.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else (
            isinstance(value, kind) and not isinstance(value, bool))
        if not ok:
            have = "is missing" if key not in state else f"is a {type(value).__name__}, not a {kind.__name__}"
            raise _refuse(run_dir, f"{path.name}: its {key!r} {have}")
    for key in ("generator", "torch_rng"):
        if state[key].dtype != torch.uint8 or state[key].ndim != 1:
            raise _refuse(run_dir, f"{path.name}: its {key!r} is not a random generator's state (a 1-D uint8 tensor)")
    return state


def load_checkpoint(ckpt: Checkpoint, *, model, ema, optimizer, generator: torch.Generator) -> dict:
    """Load `ckpt` into the model (and EMA), optimizer and generator and torch's RNG; returns the state."""
    try:
        load_weights(model, ckpt.weights)
        if ema is not None:
            if ckpt.ema is None:
                raise _refuse(ckpt.run_dir, f"the run averages its weights (ema_decay) but {ckpt.describe()} has "
                                            f"no .ema.safetensors", weights_hint=False)
            load_weights(ema, ckpt.ema)
    except ValueError as e:
        raise _refuse(ckpt.run_dir, str(e), weights_hint=False) from None
    state = _load_state(ckpt.run_dir, ckpt.state)
    if state["step"] != ckpt.step:
        raise _refuse(ckpt.run_dir, f"{ckpt.state.name} holds step {state['step']} but {ckpt.weights.name} "
                                    f"step {ckpt.step}")
    try:
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
    except (ValueError, RuntimeError, KeyError, TypeError) as e:
        what = f"{e.args[0]!r} is missing from its optimizer state" if isinstance(e, KeyError) else str(e)
        raise _refuse(ckpt.run_dir, f"{ckpt.state.name} does not fit this run's model and optimizer ({what})"
                      ) from None
    return state


def load_weights_alone(ckpt: Checkpoint, *, model, ema) -> None:
    try:
        load_weights(model, ckpt.weights)
        if ema is not None:
            load_weights(ema, ckpt.ema if ckpt.ema is not None else ckpt.weights)
    except ValueError as e:
        raise CheckpointError(f"cannot resume {ckpt.run_dir} from its weights: {e}") from None
