"""Getting weights in and out: our safetensors format, timm's ViT weights, resume state (transformers' ViT
weights: vitscope.weights.hf; a run's checkpoint as one unit: vitscope.training.checkpointing).

Files are read through vitscope.weights.files (checked against the model tensor by tensor, nothing
unpickled, a file that is not a checkpoint named as what it is). Every writer goes through `atomic_write`,
so a crash leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vitscope.errors import ConfigError, InputError
from vitscope.io import atomic_write
from vitscope.positional import resample_pos_embed
from vitscope.vit import VisionTransformer, ViTConfig
from vitscope.weights.files import (
    SAFETENSORS_ERRORS,
    PathLike,
    StateDict,
    as_state_dict,
    check_state_dict,
    damaged,
    load_checked,
    read_safetensors,
    read_tensors,
    strip_prefix,
    torch_load,
)

FORMAT_VERSION = "1"


# -- our format: safetensors + the ViTConfig in the metadata --------------------------------------
def save_model(model: VisionTransformer, path: PathLike, *, metadata: dict | None = None) -> Path:
    """Write the weights as safetensors with the config (and any `metadata`, JSON-encoded) in the header."""
    return atomic_write(path, model_file_writer(model, metadata))


def model_file_writer(model: VisionTransformer, metadata: dict | None = None) -> Callable[[str], None]:
    """A function writing `save_model`'s file to the path it is given (for `atomic_write`)."""
    header = {"format": "pt", "vitscope_format": FORMAT_VERSION, "config": json.dumps(model.config.to_dict())}
    for k, v in (metadata or {}).items():
        if k in header:
            raise ConfigError(f"metadata key {k!r} is reserved by vitscope; pick another name")
        header[str(k)] = v if isinstance(v, str) else json.dumps(v)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    return lambda tmp: save_file(tensors, tmp, metadata=header)


_MISSING = object()
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "true or false", type(None): "null", object: "a value"}


def _types(expect) -> tuple[type, ...]:
    return expect if isinstance(expect, tuple) else (expect,)


class Metadata(dict):
    """A checkpoint's safetensors metadata (str -> str, as stored) that knows its file: every JSON value in it is
    read through `json` (and a model or vocabulary built from one through `build`), so a damaged value is one
    InputError naming the file and the key, never a JSONDecodeError from deep inside a loader."""

    def __init__(self, items: Mapping[str, str], path: PathLike):
        super().__init__(items)
        self.path = Path(path)

    def refuse(self, key: str, what: str) -> InputError:
        return InputError(f"{self.path}: its metadata {key!r} {what}; the file is damaged or was not written by "
                          f"vitscope")

    def json(self, key: str, expect: type | tuple[type, ...] = object, default=_MISSING):
        """The JSON value stored under `key`, of type `expect`; `default` where the key is absent (else an
        InputError)."""
        if key not in self:
            if default is _MISSING:
                raise self.refuse(key, "is missing")
            return default
        try:
            value = json.loads(self[key])
        except (ValueError, RecursionError) as e:  # bad syntax, a number past Python's digit limit, deep nesting
            reason = str(e).split(":")[0] or type(e).__name__
            raise self.refuse(key, f"is not valid JSON ({reason})") from None
        if not isinstance(value, expect) or (isinstance(value, bool) and bool not in _types(expect)):
            names = " or ".join(_JSON_NAMES.get(t, t.__name__) for t in _types(expect))
            raise self.refuse(key, f"holds {_JSON_NAMES.get(type(value), type(value).__name__)}, not {names}")
        return value

    def build(self, key: str, make: Callable, expect: type | tuple[type, ...] = dict):
        """make(the JSON value under `key`): a config, a model or a vocabulary rebuilt from the metadata; a value
        `make` cannot use is an InputError naming the file and the key."""
        value = self.json(key, expect)
        try:
            return make(value)
        except InputError as e:
            raise self.refuse(key, f"does not hold what it should ({e})") from None
        except KeyError as e:
            raise self.refuse(key, f"does not hold what it should (no {e.args[0]!r})") from None
        except (TypeError, ValueError, AttributeError, IndexError) as e:  # ConfigError is a ValueError
            raise self.refuse(key, f"does not hold what it should ({str(e) or type(e).__name__})") from None

    def numbers(self, key: str, count: int, default: tuple[float, ...]) -> tuple[float, ...]:
        """A list of `count` finite numbers under `key` (a normalising mean or std), `default` where absent."""
        if key not in self:
            return default
        value = self.json(key, list)
        if len(value) != count or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                          and math.isfinite(v) for v in value):
            raise self.refuse(key, f"is not a list of {count} finite number{'s' * (count != 1)} (one a channel): "
                                     f"{self[key][:60]!r}")
        return tuple(float(v) for v in value)


def read_metadata(path: PathLike) -> Metadata:
    """The safetensors header metadata of `path` (strings, as stored), read through `Metadata`'s checks. A command
    asks several times (what kind of run is this? then: open it); the header is read once for each version of the
    file (its path, modification time and size)."""
    try:
        st = os.stat(path)
    except OSError:
        raise FileNotFoundError(f"no checkpoint at {path}") from None
    return _read_metadata(os.fspath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _read_metadata(path: str, mtime_ns: int, size: int) -> Metadata:
    try:
        with safe_open(path, framework="pt") as f:
            return Metadata(f.metadata() or {}, path)
    except SAFETENSORS_ERRORS as e:
        if not Path(path).exists():
            raise FileNotFoundError(f"no checkpoint at {path}") from None
        raise damaged(path, e) from None


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


def checkpoint_metadata(source: PathLike) -> Metadata | None:
    """The metadata of the .safetensors checkpoint `source` (a run directory or the file) holds, or None where it
    holds none: what the commands read to tell a classifier, a captioner and a translator apart."""
    path = Path(source)
    if not path.exists():
        return None
    try:
        ckpt = find_checkpoint(path)
    except FileNotFoundError:
        return None
    return read_metadata(ckpt) if ckpt.suffix == ".safetensors" else None


def load_model(path: PathLike, *, map_location: str | torch.device = "cpu") -> VisionTransformer:
    """Rebuild the model saved by `save_model` from its config and load its weights strictly (eval mode)."""
    meta = read_metadata(path)
    if "config" not in meta:
        raise InputError(f"{path} has no vitscope config in its metadata; for timm weights use "
                         f"create_from_timm(), for transformers weights load_hf()")
    version = meta.get("vitscope_format", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise InputError(f"{path} is vitscope checkpoint format {version}; this vitscope reads format "
                         f"{FORMAT_VERSION}. Upgrade vitscope.")
    model = meta.build("config", lambda d: VisionTransformer(ViTConfig.from_dict(d)))
    load_checked(model, read_safetensors(path), source=str(path))
    return model.to(map_location).eval()


def load_weights(model: VisionTransformer, path_or_state_dict: PathLike | StateDict) -> VisionTransformer:
    """Load our own weights (a file from `save_model`, or a state dict) into `model`, strictly."""
    if isinstance(path_or_state_dict, Mapping):
        return load_checked(model, path_or_state_dict, "state dict")
    return load_checked(model, read_tensors(path_or_state_dict), str(path_or_state_dict))


# -- training-resume state ------------------------------------------------------------------------
def save_training_state(path: PathLike, state: dict) -> Path:
    """Optimizer, scheduler, RNG and data position: tensors, numbers, strings and containers only."""
    return atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_training_state(path: PathLike, *, map_location: str | torch.device = "cpu") -> dict:
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} is missing (the optimizer, random state and data position that a "
                                f"run saves beside its weights)")
    return torch_load(path, map_location)


# -- timm -----------------------------------------------------------------------------------------
def load_timm_state_dict(model: VisionTransformer, state_dict: PathLike | StateDict, *,
                         source: str | None = None) -> VisionTransformer:
    """Load a timm VisionTransformer state dict (or a vitscope checkpoint: the names are the same). A `pos_embed`
    for another grid is resampled as timm's checkpoint filter does (bicubic, antialiased). `source` names the
    weights in messages (default: the file, else "the state dict")."""
    if source is None:
        source = "the state dict" if isinstance(state_dict, Mapping) else str(state_dict)
    sd = strip_prefix(as_state_dict(state_dict))
    pos = sd.get("pos_embed")
    if pos is not None and model.pos_embed is not None and pos.shape != model.pos_embed.shape:
        if pos.shape[-1] == model.pos_embed.shape[-1]:
            _check_token_layout(pos.shape[1], model.num_prefix_tokens)
            sd["pos_embed"] = resample_pos_embed(pos, model.patch_embed.grid_size,
                                                 num_prefix_tokens=model.num_prefix_tokens, antialias=True)
    return load_checked(model, sd, source)


def _check_token_layout(rows: int, prefix: int) -> None:
    """A position table of `rows` rows resamples to this model's grid only if it has the model's `prefix`
    tokens (the class token) before a square grid; else say which layout the weights came from."""
    if math.isqrt(rows - prefix) ** 2 == rows - prefix:
        return
    theirs = next((p for p in range(4) if rows > p and math.isqrt(rows - p) ** 2 == rows - p), None)
    came = (f"a model with {theirs} class token{'s' if theirs != 1 else ''} before a "
            f"{math.isqrt(rows - theirs)} x {math.isqrt(rows - theirs)} grid" if theirs is not None
            else "a model whose grid is not square")
    raise InputError(f"the weights' position table has {rows} rows: they come from {came}, and this model has "
                     f"{prefix} class token{'s' if prefix != 1 else ''}; start from weights of a model with the same "
                     f"class token (class_token / global_pool), or train from scratch (--init-weights none)")


def config_from_timm_state_dict(state_dict: PathLike | StateDict, **hints) -> ViTConfig:
    """Read a ViTConfig off a timm state dict's shapes; `hints` (ViTConfig fields) win over what is read.

    The number of heads is not in the weights (unless qk_norm is on): pass `num_heads`, which for
    timm's presets is embed_dim // 64.
    """
    sd = strip_prefix(as_state_dict(state_dict))
    if "patch_embed.proj.weight" not in sd:
        raise InputError("not a timm ViT state dict: no 'patch_embed.proj.weight'")
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
            raise InputError(f"pos_embed has {grid} positions, not a square grid; pass img_size=(H, W)")
    else:
        cfg["pos_embed"] = "none"
    cfg.update(hints)
    if "num_heads" not in cfg:
        raise InputError(f"the number of heads cannot be read from the weights; pass num_heads= "
                         f"(timm's presets use embed_dim // 64 = {max(embed_dim // 64, 1)})")
    return ViTConfig(**cfg)


def create_from_timm(path_or_state_dict: PathLike | StateDict, **config) -> VisionTransformer:
    """Build a model from a timm checkpoint: config read from the weights (plus `config`), weights loaded."""
    sd = strip_prefix(as_state_dict(path_or_state_dict))
    model = VisionTransformer(config_from_timm_state_dict(sd, **config))
    source = "the state dict" if isinstance(path_or_state_dict, Mapping) else str(path_or_state_dict)
    return load_timm_state_dict(model, sd, source=source).eval()


__all__ = ["Metadata", "atomic_write", "check_state_dict", "config_from_timm_state_dict", "create_from_timm",
           "find_checkpoint", "load_model", "load_timm_state_dict", "load_training_state", "load_weights",
           "model_file_writer", "read_metadata", "save_model", "save_training_state"]
