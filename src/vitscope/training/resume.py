"""Resuming a run: its checkpoint found, checked as one unit and loaded into the model, optimizer and generators.

Resume (`find_checkpoint`) checks the unit checkpointing.py writes: every file present, of the size and hash the
manifest gives, and the weights and state at the manifest's step. A run written before manifests existed
(last.safetensors + last.state.pt) resumes when both hold the same step and is refused otherwise. Every refusal
says what was found and the ways on (--weights-only, or training again). `changed_since` names the config fields
that differ from the ones the checkpoint was trained with, which the loop refuses unless told otherwise.

Apart from checkpointing.py because a run reads a checkpoint once, at its start, and answers to whatever it
finds there (damaged, copied over, from an older vitscope), while it writes one the same way at every save.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vitscope.training.checkpointing import (
    LAST,
    LEGACY_EMA,
    LEGACY_STATE,
    MANIFEST,
    STEP_FILE,
    Checkpoint,
    CheckpointError,
    file_sha256,
    read_manifest,
)
from vitscope.training.config import TrainConfig
from vitscope.training.options import TASK_OPTIONS, nest_task_options
from vitscope.training.progress import best_metric_key
from vitscope.weights.model_io import load_training_state, load_weights, read_metadata


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
            if (want_size is not None and p.stat().st_size != want_size) or file_sha256(p) != want_hash:
                raise _refuse(run_dir, f"{p.name} is not the file {MANIFEST} was written with (its size or SHA-256 "
                                       f"differ: changed or copied over since)", weights_hint=key != "weights")
        ckpt = Checkpoint(run_dir, step, paths["weights"], None if weights_only else paths["state"],
                          paths.get("ema"))
        _check_weights_step(ckpt)
        return ckpt
    weights, state = run_dir / LAST, run_dir / LEGACY_STATE
    steps = sorted(p.name for p in run_dir.glob("step-*") if STEP_FILE.match(p.name)) if run_dir.is_dir() else []
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


# -- the config it was trained with -----------------------------------------------------------------
def changed_since(found: Checkpoint, cfg: TrainConfig) -> list[str]:
    """The config fields that differ from the ones the checkpoint was trained with (its weights' metadata);
    fields one side lacks (a run from before the field existed) are not compared."""
    try:
        saved = read_metadata(found.weights).json("train_config", dict, {})
    except (OSError, ValueError):
        return []  # an unreadable record: find_checkpoint's own checks speak for the files
    now = config_by_name(json.loads(json.dumps(cfg.to_dict())))  # as saved: tuples become lists
    saved = config_by_name(nest_task_options(saved))  # a checkpoint from before the options were nested
    return sorted(k for k in saved.keys() & now.keys() if saved[k] != now[k])


def config_by_name(config: dict) -> dict:
    """A config dict with each option under its own dotted name (caption.max_len, image.model), so a change names
    it."""
    nested = ("image", *TASK_OPTIONS)
    out = {k: v for k, v in config.items() if k not in nested or not isinstance(v, dict)}
    for key in nested:
        if isinstance(config.get(key), dict):
            out |= {f"{key}.{k}": v for k, v in config[key].items()}
    return out
