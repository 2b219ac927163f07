"""Getting weights in and out: our safetensors format, timm's ViT weights, resume state (transformers' ViT
weights: vitscope.weights.hf, re-exported here; a run's checkpoint as one unit: vitscope.training.checkpointing).

Every loader goes through `check_state_dict`, so a checkpoint that does not fit the model is an
error naming the tensor, never a torch traceback. Every writer goes through `atomic_write`, so a
crash leaves the old file or the new one, never half of one. Nothing here unpickles code:
weights are safetensors, and resume state is read with `torch.load(weights_only=True)`. A file that is
not a checkpoint at all (an image, a text file, a pickle) is named as what it is.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import struct
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from vitscope.positional import resample_pos_embed
from vitscope.vit import VisionTransformer, ViTConfig

FORMAT_VERSION = "1"
StateDict = Mapping[str, Tensor]
PathLike = str | os.PathLike


# -- writing files safely -------------------------------------------------------------------------
def atomic_write(path: PathLike, write_fn: Callable[[str], None]) -> Path:
    """Call `write_fn(tmp_path)` on a temporary file beside `path`, fsync it, then rename it over `path`.

    The rename is atomic on POSIX and Windows, so readers see the old file or the new one. If
    `write_fn` raises, the temporary file is removed and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write_fn(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path


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
            parts.append(f"it lacks {len(missing)} tensor(s) the model needs: {_few(missing)}")
        if unexpected:
            parts.append(f"it has {len(unexpected)} tensor(s) the model does not know: {_few(unexpected)}")
        raise ValueError(f"{source} does not fit the model: " + "; ".join(parts) + ". Was it saved "
                         "from a different kind of model (timm, transformers, another preset)?")
    for name, want in expected.items():
        got = state_dict[name]
        if _shape(got) != _shape(want):
            raise ValueError(f"{source} tensor {name!r} has shape {_shape(got)} but the model expects "
                             f"{_shape(want)} — was it saved from a different preset?")


def _few(keys: list[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f", … ({len(keys) - n} more)" if len(keys) > n else "")


def _load_checked(model: VisionTransformer, state_dict: StateDict, source: str) -> VisionTransformer:
    check_state_dict(model, state_dict, source=source)
    model.load_state_dict(state_dict, strict=True)
    return model


def _damaged(path: PathLike, e: Exception) -> ValueError:
    kind = _sniff(path)
    if kind is not None:
        return ValueError(f"{path} is {kind}, not a checkpoint vitscope can read: give the .safetensors file a "
                          f"run wrote (or a timm or transformers checkpoint)")
    reason = str(e).split(". ")[0].rstrip(".") or type(e).__name__  # torch's reader adds a paragraph of guesses
    return ValueError(f"{path} cannot be read ({reason}): the file is cut short or damaged. vitscope writes each "
                      f"checkpoint whole, so it changed after it was saved (a copy or download that stopped?): "
                      f"copy it again, or use another checkpoint")


# The first bytes of files that are often mistaken for a checkpoint.
_MAGIC = [(b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
          (b"PK\x03\x04", "a zip archive (torch.save's format: load it with create_from_timm / load_weights)"),
          (b"\x80", "a Python pickle")]


def _sniff(path: PathLike) -> str | None:
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
            try:
                head.decode("utf-8")
                return "a text file"
            except UnicodeDecodeError:
                return "not a safetensors file"
    return None


_SAFETENSORS_ERRORS = tuple(e for e in (getattr(safetensors, "SafetensorError", None), OSError) if e)


def _load_safetensors(path: PathLike) -> dict[str, Tensor]:
    try:
        return load_file(path)
    except _SAFETENSORS_ERRORS as e:
        raise _damaged(path, e) from None


def _read_tensors(path: PathLike) -> dict[str, Tensor]:
    """A file's tensors by name: safetensors, or a torch.save'd state dict (also one nested under
    'state_dict' or 'model', as training scripts save them)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a checkpoint file")
    if path.suffix == ".safetensors":
        return _load_safetensors(path)
    obj = _torch_load(path)
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not obj or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items()):
        what = (f"a {type(obj).__name__}" if not isinstance(obj, Mapping) else
                "an empty dict" if not obj else "a dict whose values are not all tensors")
        raise ValueError(f"{path} holds {what}, not a state dict (tensor names to tensors): save the model's "
                         f"state_dict(), or use vitscope.weights.checkpoints.save_model")
    return dict(obj)


def _torch_load(path: PathLike, map_location="cpu"):
    try:
        with warnings.catch_warnings():  # torch warns about old formats before failing on them
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower() and "unsupported global" not in str(e).lower():
            raise _damaged(path, e) from None  # a pickle stream cut short
        raise ValueError(f"{path} holds Python objects other than tensors and plain containers; vitscope "
                         f"does not unpickle code. Re-save it with tensors, numbers and strings only."
                         ) from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a folder, not a checkpoint file") from None
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError, AttributeError, TypeError,
            UnicodeDecodeError, struct.error, zipfile.BadZipFile) as e:  # torch's reader on a cut-short or damaged file
        raise _damaged(path, e) from None


# -- our format: safetensors + the ViTConfig in the metadata --------------------------------------
def save_model(model: VisionTransformer, path: PathLike, *, metadata: dict | None = None) -> Path:
    """Write the weights as safetensors with the config (and any `metadata`, JSON-encoded) in the header."""
    return atomic_write(path, model_file_writer(model, metadata))


def model_file_writer(model: VisionTransformer, metadata: dict | None = None) -> Callable[[str], None]:
    """A function writing `save_model`'s file to the path it is given (for `atomic_write`)."""
    header = {"format": "pt", "vitscope_format": FORMAT_VERSION, "config": json.dumps(model.config.to_dict())}
    for k, v in (metadata or {}).items():
        if k in header:
            raise ValueError(f"metadata key {k!r} is reserved by vitscope; pick another name")
        header[str(k)] = v if isinstance(v, str) else json.dumps(v)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    return lambda tmp: save_file(tensors, tmp, metadata=header)


def read_metadata(path: PathLike) -> dict[str, str]:
    """The safetensors header metadata of `path` (strings, as stored)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except _SAFETENSORS_ERRORS as e:
        if not Path(path).exists():
            raise FileNotFoundError(f"no checkpoint at {path}") from None
        raise _damaged(path, e) from None


RUN_CHECKPOINTS = ("best.safetensors", "last.safetensors")


def find_checkpoint(path: PathLike) -> Path:
    """A .safetensors file as given, or a run directory's best (else last) checkpoint."""
    p = Path(path)
    if p.is_dir():
        for name in RUN_CHECKPOINTS:
            if (p / name).is_file():
                return p / name
        raise FileNotFoundError(f"{p} holds no {' or '.join(RUN_CHECKPOINTS)}; is it a vitscope run directory?")
    if not p.is_file():
        raise FileNotFoundError(f"no checkpoint at {p}: give a run directory or a .safetensors file")
    return p


def load_model(path: PathLike, *, map_location: str | torch.device = "cpu") -> VisionTransformer:
    """Rebuild the model saved by `save_model` from its config and load its weights strictly (eval mode)."""
    meta = read_metadata(path)
    if "config" not in meta:
        raise ValueError(f"{path} has no vitscope config in its metadata; for timm weights use "
                         f"create_from_timm(), for transformers weights load_hf()")
    version = meta.get("vitscope_format", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ValueError(f"{path} is vitscope checkpoint format {version}; this vitscope reads format "
                         f"{FORMAT_VERSION}. Upgrade vitscope.")
    model = VisionTransformer(ViTConfig.from_dict(json.loads(meta["config"])))
    _load_checked(model, _load_safetensors(path), source=str(path))
    return model.to(map_location).eval()


def load_weights(model: VisionTransformer, path_or_state_dict: PathLike | StateDict) -> VisionTransformer:
    """Load our own weights (a file from `save_model`, or a state dict) into `model`, strictly."""
    if isinstance(path_or_state_dict, Mapping):
        return _load_checked(model, path_or_state_dict, "state dict")
    return _load_checked(model, _read_tensors(path_or_state_dict), str(path_or_state_dict))


# -- training-resume state ------------------------------------------------------------------------
def save_training_state(path: PathLike, state: dict) -> Path:
    """Optimizer, scheduler, RNG and data position: tensors, numbers, strings and containers only."""
    return atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_training_state(path: PathLike, *, map_location: str | torch.device = "cpu") -> dict:
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} is missing (the optimizer, random state and data position that a "
                                f"run saves beside its weights)")
    return _torch_load(path, map_location)


# -- timm -----------------------------------------------------------------------------------------
def _strip_prefix(sd: StateDict) -> dict[str, Tensor]:
    """timm's own names; a state dict nested under `model.` or `module.` is read from that prefix only."""
    for prefix in ("model.", "module."):
        if any(k.startswith(prefix) for k in sd):
            return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    return dict(sd)


def _as_state_dict(path_or_sd: PathLike | StateDict) -> dict[str, Tensor]:
    return dict(path_or_sd) if isinstance(path_or_sd, Mapping) else _read_tensors(path_or_sd)


def load_timm_state_dict(model: VisionTransformer, state_dict: PathLike | StateDict) -> VisionTransformer:
    """Load a timm VisionTransformer state dict. A `pos_embed` for another grid is resampled as timm's
    checkpoint filter does (bicubic, antialiased)."""
    sd = _strip_prefix(_as_state_dict(state_dict))
    pos = sd.get("pos_embed")
    if pos is not None and model.pos_embed is not None and pos.shape != model.pos_embed.shape:
        if pos.shape[-1] == model.pos_embed.shape[-1]:
            sd["pos_embed"] = resample_pos_embed(pos, model.patch_embed.grid_size,
                                                 num_prefix_tokens=model.num_prefix_tokens, antialias=True)
    return _load_checked(model, sd, "timm checkpoint")


def config_from_timm_state_dict(state_dict: PathLike | StateDict, **hints) -> ViTConfig:
    """Read a ViTConfig off a timm state dict's shapes; `hints` (ViTConfig fields) win over what is read.

    The number of heads is not in the weights (unless qk_norm is on): pass `num_heads`, which for
    timm's presets is embed_dim // 64.
    """
    sd = _strip_prefix(_as_state_dict(state_dict))
    if "patch_embed.proj.weight" not in sd:
        raise ValueError("not a timm ViT state dict: no 'patch_embed.proj.weight'")
    embed_dim, in_chans, patch, _ = sd["patch_embed.proj.weight"].shape
    depth = 1 + max((int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)
    cfg: dict = dict(embed_dim=embed_dim, in_chans=in_chans, patch_size=patch, depth=depth,
                     class_token="cls_token" in sd, qkv_bias="blocks.0.attn.qkv.bias" in sd,
                     qk_norm="blocks.0.attn.q_norm.weight" in sd,
                     num_classes=sd["head.weight"].shape[0] if "head.weight" in sd else 0)
    if "blocks.0.mlp.fc1.weight" in sd:
        cfg["mlp_ratio"] = sd["blocks.0.mlp.fc1.weight"].shape[0] / embed_dim
    if "blocks.0.ls1.gamma" in sd:
        cfg["init_values"] = 1e-5  # only makes the LayerScale exist; its values come from the weights
    if cfg["qk_norm"]:
        cfg["num_heads"] = embed_dim // sd["blocks.0.attn.q_norm.weight"].shape[0]
    has_fc_norm = "fc_norm.weight" in sd
    cfg["global_pool"] = "avg" if has_fc_norm or not cfg["class_token"] else "token"
    if has_fc_norm != (cfg["global_pool"] == "avg"):
        cfg["fc_norm"] = has_fc_norm
    if "pos_embed" in sd:
        grid = sd["pos_embed"].shape[1] - int(cfg["class_token"])
        side = math.isqrt(grid)
        if side * side == grid:
            cfg["img_size"] = side * patch
        elif "img_size" not in hints:
            raise ValueError(f"pos_embed has {grid} positions, not a square grid; pass img_size=(H, W)")
    else:
        cfg["pos_embed"] = "none"
    cfg.update(hints)
    if "num_heads" not in cfg:
        raise ValueError(f"the number of heads cannot be read from the weights; pass num_heads= "
                         f"(timm's presets use embed_dim // 64 = {max(embed_dim // 64, 1)})")
    return ViTConfig(**cfg)


def create_from_timm(path_or_state_dict: PathLike | StateDict, **config) -> VisionTransformer:
    """Build a model from a timm checkpoint: config read from the weights (plus `config`), weights loaded."""
    sd = _strip_prefix(_as_state_dict(path_or_state_dict))
    model = VisionTransformer(config_from_timm_state_dict(sd, **config))
    return load_timm_state_dict(model, sd).eval()


# transformers' ViT: its own module, re-exported here where it always was
from vitscope.weights.hf import export_hf, hf_to_vitscope, load_hf  # noqa: E402

__all__ = ["atomic_write", "check_state_dict", "config_from_timm_state_dict", "create_from_timm", "export_hf",
           "find_checkpoint", "hf_to_vitscope", "load_hf", "load_model", "load_timm_state_dict",
           "load_training_state", "load_weights", "model_file_writer", "read_metadata", "save_model",
           "save_training_state"]
