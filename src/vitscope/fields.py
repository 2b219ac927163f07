"""Typed dataclass configs checked against their own type hints, so a value of the wrong kind (`--set
depth=abc`, `"epochs": "two"` in a JSON config) is one clear error naming the field, not a failure deep
inside the model or the loop. `ViTConfig` and `TrainConfig` both check themselves with it; the decoders'
configs check the sizes they share with `check_decoder_sizes`."""

from __future__ import annotations

import math
import typing
from typing import Literal

from vitscope.errors import ConfigError


def type_ok(value, tp) -> bool:
    """Whether `value` is of the annotated type `tp` (an int passes as a float, a bool never as a number)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or (origin is not None and type(None) in args):
        return any(type_ok(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is Literal:
        return value in args
    if origin is tuple:
        return isinstance(value, (tuple, list)) and len(value) == len(args) and all(
            type_ok(v, a) for v, a in zip(value, args))
    if origin is list:
        return isinstance(value, (list, tuple)) and all(type_ok(v, args[0]) for v in value) if args else True
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    return isinstance(value, tp) if isinstance(tp, type) else True


def type_name(tp) -> str:
    """How an error names the type `tp` to a user."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if type(None) in args:
        return " or ".join(type_name(a) for a in args if a is not type(None)) + " or none"
    if origin is typing.Union:
        return " or ".join(type_name(a) for a in args)
    if origin is tuple:
        return f"{len(args)} numbers"
    if origin is list:
        return f"a list of {type_name(args[0])}" if args else "a list"
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
            dict: "an object of fields"}.get(tp, getattr(tp, "__name__", str(tp)))


def check_types(cfg) -> None:
    """Every field of the dataclass `cfg` of its annotated type, else a ValueError naming the field."""
    hints = typing.get_type_hints(type(cfg))
    for name in cfg.__dataclass_fields__:
        value = getattr(cfg, name)
        if not type_ok(value, hints[name]):
            raise ConfigError(f"{name} must be {type_name(hints[name])}, got {value!r}")


def check_decoder_sizes(cfg, sizes: tuple[str, ...]) -> None:
    """What every decoder's config asks of the fields they share: each of `sizes` at least 1, `max_len` room for
    `<bos>` and one word, `drop` in [0, 1); else a ConfigError naming the field."""
    for name in sizes:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.max_len < 2:
        raise ConfigError(f"max_len must leave room for <bos> and one word, got {cfg.max_len}")
    if not 0 <= cfg.drop < 1:
        raise ConfigError(f"drop must be in [0, 1), got {cfg.drop}")


def check_transformer_shape(cfg) -> None:
    """What a transformer decoder's config asks of its block: an MLP ratio above 0, and `dim` split into
    `num_heads` equal heads; else a ConfigError naming the field."""
    if not (math.isfinite(cfg.mlp_ratio) and cfg.mlp_ratio > 0):
        raise ConfigError(f"mlp_ratio must be a finite number above 0, got {cfg.mlp_ratio}")
    if cfg.dim % cfg.num_heads:
        raise ConfigError(f"dim ({cfg.dim}) must divide into num_heads ({cfg.num_heads}) equal heads")
