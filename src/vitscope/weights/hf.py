"""Hugging Face transformers' ViT in and out, without importing transformers: key maps, config conversion,
`load_hf` and `export_hf`."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from torch import Tensor

from vitscope.errors import ConfigError, InputError
from vitscope.io import atomic_write
from vitscope.vit import VisionTransformer, ViTConfig
from vitscope.weights.files import PathLike, StateDict, few, load_checked, read_safetensors, read_tensors, torch_load

# -- key maps --------------------------------------------------------------------
# Block parameters: (transformers 4 name, transformers 5 name) -> ours. "q"/"k"/"v" are fused into qkv.
_HF_BLOCK = {
    ("attention.attention.query", "attention.q_proj"): "q",
    ("attention.attention.key", "attention.k_proj"): "k",
    ("attention.attention.value", "attention.v_proj"): "v",
    ("attention.output.dense", "attention.o_proj"): "attn.proj",
    ("intermediate.dense", "mlp.fc1"): "mlp.fc1",
    ("output.dense", "mlp.fc2"): "mlp.fc2",
    ("layernorm_before", "layernorm_before"): "norm1",
    ("layernorm_after", "layernorm_after"): "norm2",
}
_HF_TOP = {
    "embeddings.cls_token": "cls_token",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight",
    "layernorm.bias": "norm.bias",
    "classifier.weight": "head.weight",
    "classifier.bias": "head.bias",
}
_HF_BLOCK_RE = re.compile(r"^(?:encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$")
# transformers' ViTConfig defaults, for config.json files that leave a field out.
_HF_DEFAULTS = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                    hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    layer_norm_eps=1e-12, image_size=224, patch_size=16, num_channels=3, qkv_bias=True)


# config.json's fields that vitscope reads, with what each must hold: a field of the wrong type is one InputError
# naming the file and the field, not a TypeError (or a ZeroDivisionError) from the conversion below.
_HF_COUNTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "num_channels")
_HF_RATES = ("hidden_dropout_prob", "attention_probs_dropout_prob")


def _check_hf_config(c: dict, source: str) -> None:
    def bad(name: str, must: str) -> InputError:
        return InputError(f"{source}: its field {name!r} is {c[name]!r}; it must be {must} (is it a transformers "
                          f"ViT config.json?)")

    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for name in _HF_COUNTS:
        if not whole(c[name]):
            raise bad(name, "a whole number of at least 1")
    for name in ("image_size", "patch_size"):
        v = c[name]
        if not (whole(v) or isinstance(v, (list, tuple)) and len(v) == 2 and all(whole(x) for x in v)):
            raise bad(name, "a whole number of pixels of at least 1, or two of them")
    for name in _HF_RATES:
        if not (number(c[name]) and 0 <= c[name] < 1):
            raise bad(name, "a probability in [0, 1)")
    if not (number(c["layer_norm_eps"]) and c["layer_norm_eps"] > 0):
        raise bad("layer_norm_eps", "a number above 0")
    if not isinstance(c["qkv_bias"], bool):
        raise bad("qkv_bias", "true or false")
    if not isinstance(c["hidden_act"], str):
        raise bad("hidden_act", "a string such as 'gelu'")
    if c.get("head_dim") is not None and not whole(c["head_dim"]):
        raise bad("head_dim", "a whole number of at least 1")


def _vit_config_from_hf(c: dict, num_classes: int, source: str = "the transformers config") -> ViTConfig:
    c = {**_HF_DEFAULTS, **c}
    _check_hf_config(c, source)
    if c.get("model_type", "vit") != "vit":
        raise InputError(f"{source}: expected a transformers ViT config (model_type 'vit'), got {c['model_type']!r}")
    if c["hidden_act"] != "gelu":
        raise InputError(f"{source}: hidden_act {c['hidden_act']!r} is not supported: vitscope's ViT uses exact (erf) "
                         f"GELU, transformers' 'gelu'")
    dim, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("head_dim") not in (None, dim // heads) or dim % heads:
        raise InputError(f"{source}: hidden_size {dim} must equal num_attention_heads {heads} x head_dim")
    patch = c["patch_size"]
    if isinstance(patch, (list, tuple)):
        if patch[0] != patch[1]:
            raise InputError(f"{source}: only square patches are supported, got patch_size {patch}")
        patch = patch[0]
    mlp_ratio = c["intermediate_size"] / dim
    if int(dim * mlp_ratio) != c["intermediate_size"]:
        raise InputError(f"{source}: intermediate_size {c['intermediate_size']} is not representable as "
                         f"int(hidden_size * mlp_ratio) for hidden_size {dim}")
    img = c["image_size"]
    try:
        return ViTConfig(
            img_size=tuple(img) if isinstance(img, (list, tuple)) else img, patch_size=patch,
            in_chans=c["num_channels"], num_classes=num_classes, embed_dim=dim, depth=c["num_hidden_layers"],
            num_heads=heads, mlp_ratio=mlp_ratio, qkv_bias=c["qkv_bias"], norm_eps=c["layer_norm_eps"],
            pos_embed_antialias=False, pos_drop_rate=c["hidden_dropout_prob"],
            proj_drop_rate=c["hidden_dropout_prob"], attn_drop_rate=c["attention_probs_dropout_prob"],
        )
    except ConfigError as e:  # a value of the right type that no ViT has: say which file it came from
        raise InputError(f"{source}: {e}") from None


def hf_to_vitscope(state_dict: StateDict, hf_config: dict, *,
                   source: str = "the transformers config") -> tuple[ViTConfig, dict[str, Tensor]]:
    """Convert a transformers ViTModel / ViTForImageClassification state dict (transformers 4 or 5 key
    names, with or without the `vit.` prefix) and its config dict into our config and state dict.

    ViTModel's pooler (dense + tanh) has no counterpart here and is dropped; compare its
    `last_hidden_state` with our `forward_features`.
    """
    ours: dict[str, Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, Tensor]] = {}
    unknown = []
    for key, t in state_dict.items():
        name = key[len("vit."):] if key.startswith("vit.") else key
        if name.startswith("pooler."):
            continue
        if name in _HF_TOP:
            ours[_HF_TOP[name]] = t
        elif m := _HF_BLOCK_RE.match(name):
            i, part, kind = int(m.group(1)), m.group(2), m.group(3)
            target = next((v for names, v in _HF_BLOCK.items() if part in names), None)
            if target is None:
                unknown.append(key)
            elif target in ("q", "k", "v"):
                qkv.setdefault((i, kind), {})[target] = t
            else:
                ours[f"blocks.{i}.{target}.{kind}"] = t
        else:
            unknown.append(key)
    if unknown:
        raise InputError(f"transformers checkpoint has tensors vitscope cannot map: {few(unknown)}")
    for (i, kind), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise InputError(f"transformers checkpoint layer {i} has only {sorted(parts)} "
                             f"of query/key/value {kind}")
        ours[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    num_classes = ours["head.weight"].shape[0] if "head.weight" in ours else 0
    if hasattr(hf_config, "to_dict"):  # a transformers ViTConfig object works as well as its dict
        hf_config = hf_config.to_dict()
    return _vit_config_from_hf(dict(hf_config), num_classes, source), ours


def _read_hf_folder(folder: Path) -> dict[str, Tensor]:
    if (folder / "model.safetensors").exists():
        return read_safetensors(folder / "model.safetensors")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        sd: dict[str, Tensor] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            sd.update(read_safetensors(folder / shard))
        return sd
    if (folder / "pytorch_model.bin").exists():
        return torch_load(folder / "pytorch_model.bin")
    raise FileNotFoundError(f"{folder} has no model.safetensors (or shards, or pytorch_model.bin)")


def load_hf(source: PathLike | StateDict, config: dict | PathLike | None = None) -> VisionTransformer:
    """A transformers ViT as a vitscope model (eval mode), without importing transformers.

    `source`: a `save_pretrained` folder (config.json + model.safetensors), a weights file, or a
    state dict. `config`: the config dict or a config.json path; read from the folder when omitted.
    """
    if isinstance(source, Mapping):
        sd, folder = dict(source), None
    else:
        path = Path(source)
        folder = path if path.is_dir() else path.parent
        sd = _read_hf_folder(path) if path.is_dir() else read_tensors(path)
    if config is None:
        if folder is None or not (folder / "config.json").exists():
            raise ConfigError("load_hf needs the transformers config: pass config= (a dict or a "
                             "config.json path)")
        config = folder / "config.json"
    source_name = "the config given"
    if not isinstance(config, Mapping):
        source_name = str(config)
        config = _read_config_json(Path(config))
    cfg, ours = hf_to_vitscope(sd, dict(config), source=source_name)
    model = VisionTransformer(cfg)
    return load_checked(model, ours, "transformers checkpoint").eval()


def _read_config_json(path: Path) -> dict:
    """A transformers config.json as a dict, or an InputError naming the file."""
    if not path.is_file():
        raise FileNotFoundError(f"no transformers config at {path}")
    try:
        config = json.loads(path.read_bytes().decode("utf-8-sig"))
    except (ValueError, RecursionError) as e:  # bad JSON, not UTF-8, nested past Python's limit
        raise InputError(f"{path}: not valid JSON ({str(e).split(':')[0] or type(e).__name__}); the file is damaged "
                         f"or is not a transformers config.json") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: holds a {type(config).__name__}, not an object of config fields; is it a "
                         f"transformers config.json?")
    return config


def export_hf(model: VisionTransformer, folder: PathLike, *, labels: list[str] | None = None,
              layout: Literal["checkpoint", "module"] = "checkpoint") -> Path:
    """Write `config.json` + `model.safetensors` that `ViTForImageClassification.from_pretrained` loads.

    layout "checkpoint" uses the key names transformers' `save_pretrained` writes (the classic
    `vit.encoder.layer.{i}.attention.attention.query` ones, read by transformers 4 and 5); "module"
    uses transformers 5's module names (`vit.layers.{i}.attention.q_proj`).

    At the trained image size the outputs are ours exactly. At other sizes transformers'
    `interpolate_pos_encoding` resamples the table with plain bicubic, timm (our default) with
    antialiased bicubic; build the model with `pos_embed_antialias=False` to agree there as well.
    """
    cfg = model.config
    problems = [why for bad, why in [
        (not cfg.class_token or cfg.global_pool != "token", "it needs a class token and token pooling"),
        (cfg.pos_embed != "learn", f"pos_embed={cfg.pos_embed!r} (transformers has learned tables only)"),
        (bool(cfg.stem), "a conv stem"), (cfg.init_values is not None, "layer scale"),
        (cfg.qk_norm, "qk_norm"), (not isinstance(model.fc_norm, torch.nn.Identity), "fc_norm"),
        (cfg.num_classes <= 0, "no classifier head (num_classes=0)"),
    ] if bad]
    if problems:
        raise ConfigError("this model cannot be exported to transformers' ViT: " + "; ".join(problems))
    if labels is not None and len(labels) != cfg.num_classes:
        raise ConfigError(f"{len(labels)} labels given for a {cfg.num_classes}-class head")
    labels = labels or [f"LABEL_{i}" for i in range(cfg.num_classes)]
    d, hidden = cfg.embed_dim, int(cfg.embed_dim * cfg.mlp_ratio)
    img = list(cfg.img_size) if isinstance(cfg.img_size, tuple) else cfg.img_size
    hf_config = {
        "architectures": ["ViTForImageClassification"], "model_type": "vit",
        "hidden_size": d, "num_hidden_layers": cfg.depth, "num_attention_heads": cfg.num_heads,
        "intermediate_size": hidden, "hidden_act": "gelu", "hidden_dropout_prob": cfg.proj_drop_rate,
        "attention_probs_dropout_prob": cfg.attn_drop_rate, "initializer_range": 0.02,
        "layer_norm_eps": cfg.norm_eps, "image_size": img, "patch_size": cfg.patch_size,
        "num_channels": cfg.in_chans, "qkv_bias": cfg.qkv_bias, "encoder_stride": cfg.patch_size,
        "pooler_output_size": d, "pooler_act": "tanh",
        "id2label": {str(i): name for i, name in enumerate(labels)},
        "label2id": {name: i for i, name in enumerate(labels)},
    }
    top = {v: k for k, v in _HF_TOP.items()}
    v5 = layout == "module"
    block_names = {v: names[1] if v5 else names[0] for names, v in _HF_BLOCK.items()}
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        if name in top:
            hf_name = top[name]
            out[hf_name if hf_name.startswith("classifier.") else "vit." + hf_name] = t
            continue
        m = re.match(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m is None:
            raise ValueError(f"no transformers name for {name!r}")
        i, part, kind = m.groups()
        prefix = f"vit.layers.{i}." if v5 else f"vit.encoder.layer.{i}."
        if part == "attn.qkv":
            for which, chunk in zip("qkv", t.chunk(3, dim=0)):
                out[f"{prefix}{block_names[which]}.{kind}"] = chunk.contiguous()
        else:
            out[f"{prefix}{block_names[part]}.{kind}"] = t
    folder = Path(folder)
    atomic_write(folder / "model.safetensors", lambda tmp: save_file(out, tmp, metadata={"format": "pt"}))
    atomic_write(folder / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(hf_config, indent=2)))
    return folder
