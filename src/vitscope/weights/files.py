"""Tensor files in and out of the weights package: safetensors and torch.save'd state dicts read safely, a file
that is not a checkpoint named as what it is, and a state dict checked against a model tensor by tensor.

Nothing here unpickles code: torch files are read with `torch.load(weights_only=True)`. Every loader goes through
`check_state_dict`, so a checkpoint that does not fit the model is an error naming the tensor, never a torch
traceback. `model_io` (vitscope's format, timm's) and `hf` (transformers') both read through this module.
"""

from __future__ import annotations

import os
import pickle
import struct
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import safetensors
import torch
from safetensors.torch import load_file
from torch import Tensor

from vitscope.errors import InputError

StateDict = Mapping[str, Tensor]
PathLike = str | os.PathLike
ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)

# Keys a captioner's checkpoint holds beside a classifier's metadata (the caption package writes them): how a
# reader of classifiers tells a captioning run from one of its own.
CAPTIONER_KEY = "captioner"
VOCAB_KEY = "vitscope.caption.vocab"
TRANSLATOR_KEY = "translator"  # a translator's checkpoint (vitscope.translate.run writes it)


# -- checking a state dict against a model --------------------------------------------------------
def _shape(t) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def check_state_dict(model: torch.nn.Module, state_dict: StateDict, *, source: str = "checkpoint") -> None:
    """Raise a ValueError saying what does not fit: missing or unknown keys, or the first shape mismatch."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"it lacks {len(missing)} tensor(s) the model needs: {few(missing)}")
        if unexpected:
            parts.append(f"it has {len(unexpected)} tensor(s) the model does not know: {few(unexpected)}")
        raise InputError(f"{source} does not fit the model: " + "; ".join(parts) + ". Was it saved "
                         "from a different kind of model (timm, transformers, another preset)?")
    for name, want in expected.items():
        got = state_dict[name]
        if _shape(got) != _shape(want):
            raise InputError(f"{source} tensor {name!r} has shape {_shape(got)} but the model expects "
                             f"{_shape(want)} — was it saved from a different preset?")


def few(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f", … ({len(keys) - n} more)" if len(keys) > n else "")


def load_checked(model: ModuleT, state_dict: StateDict, source: str) -> ModuleT:
    check_state_dict(model, state_dict, source=source)
    model.load_state_dict(state_dict, strict=True)
    return model


def check_finite(state_dict: StateDict, source: str) -> None:
    """An InputError where a checkpoint holds NaN or infinite weights: the training that wrote it diverged."""
    bad = [name for name, t in state_dict.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise InputError(f"{source} holds NaN or infinite weights ({len(bad)} of {len(state_dict)} tensors, e.g. "
                         f"{bad[0]}): the training that wrote it diverged; use an earlier checkpoint (a run's "
                         f"best.safetensors)")


def damaged(path: PathLike, e: Exception) -> InputError:
    kind = sniff(path)
    if kind is not None:
        return InputError(f"{path} is {kind}, not a checkpoint vitscope can read: give the .safetensors file a "
                          f"run wrote (or a timm or transformers checkpoint)")
    reason = str(e).split(". ")[0].rstrip(".") or type(e).__name__  # torch's reader adds a paragraph of guesses
    return InputError(f"{path} cannot be read ({reason}): the file is cut short or damaged. vitscope writes each "
                      f"checkpoint whole, so it changed after it was saved (a copy or download that stopped?): "
                      f"copy it again, or use another checkpoint")


# The first bytes of files that are often mistaken for a checkpoint.
_MAGIC = [(b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
          (b"PK\x03\x04", "a zip archive (torch.save's format: load it with create_from_timm / load_weights)"),
          (b"\x80", "a Python pickle")]


def sniff(path: PathLike) -> str | None:
    """What a file that fails to load as a checkpoint is instead, where its first bytes say (else None:
    it is a checkpoint cut short or damaged)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None
    suffix = Path(path).suffix
    for magic, kind in _MAGIC:
        if head.startswith(magic) and not (suffix != ".safetensors" and magic in (b"PK\x03\x04", b"\x80")):
            return kind
    if suffix == ".safetensors" and len(head) >= 8:
        n = int.from_bytes(head[:8], "little")
        if head[8:9] != b"{" or n > 100_000_000:  # a safetensors file starts with its header's length, then JSON
            if _is_text(head):
                return "a text file"
            return (f"not a safetensors file (its first 8 bytes give a header of {n:,} bytes)" if n > 100_000_000
                    else "not a safetensors file")
    return None


def _is_text(head: bytes) -> bool:
    """Whether a file's first bytes read as text: UTF-8 (a character cut at the end allowed) with no control
    characters but white space. A binary header can be valid UTF-8 by chance (its length's bytes, then '{}')."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:
            return False
        text = head[: e.start].decode("utf-8")
    return bool(text) and all(c.isprintable() or c in "\t\n\r" for c in text)


SAFETENSORS_ERRORS = tuple(e for e in (getattr(safetensors, "SafetensorError", None), OSError) if e)


def read_safetensors(path: PathLike) -> dict[str, Tensor]:
    try:
        return load_file(path)
    except SAFETENSORS_ERRORS as e:
        raise damaged(path, e) from None


def read_tensors(path: PathLike) -> dict[str, Tensor]:
    """A file's tensors by name: safetensors, or a torch.save'd state dict (also one nested under
    'state_dict' or 'model', as training scripts save them)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_dir():
        raise InputError(f"{path} is a folder, not a checkpoint file")
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    obj = torch_load(path)
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not obj or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items()):
        what = (f"a {type(obj).__name__}" if not isinstance(obj, Mapping) else
                "an empty dict" if not obj else "a dict whose values are not all tensors")
        raise InputError(f"{path} holds {what}, not a state dict (tensor names to tensors): save the model's "
                         f"state_dict(), or use vitscope.weights.save_model")
    return dict(obj)


def torch_load(path: PathLike, map_location="cpu"):
    try:
        with warnings.catch_warnings():  # torch warns about old formats before failing on them
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower() and "unsupported global" not in str(e).lower():
            raise damaged(path, e) from None  # a pickle stream cut short
        raise InputError(f"{path} holds Python objects other than tensors and plain containers; vitscope "
                         f"does not unpickle code. Re-save it with tensors, numbers and strings only."
                         ) from None
    except IsADirectoryError:
        raise InputError(f"{path} is a folder, not a checkpoint file") from None
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError, AttributeError, TypeError,
            UnicodeDecodeError, struct.error, zipfile.BadZipFile) as e:  # torch's reader on a cut-short or damaged file
        raise damaged(path, e) from None



# -- state dicts as other libraries nest them ------------------------------------------------------
def strip_prefix(sd: StateDict) -> dict[str, Tensor]:
    """timm's own names; a state dict nested under `model.` or `module.` is read from that prefix only."""
    for prefix in ("model.", "module."):
        if any(k.startswith(prefix) for k in sd):
            return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    return dict(sd)


def as_state_dict(path_or_sd: PathLike | StateDict) -> dict[str, Tensor]:
    return dict(path_or_sd) if isinstance(path_or_sd, Mapping) else read_tensors(path_or_sd)
