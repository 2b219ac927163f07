"""The model a run will train, checked before any work: each `model_args` field (`--set`) a ViTConfig field of
its type and range, and the weights and a training step's activations within this machine's memory (a rough
upper estimate), so that a model too large to train is one line, not an allocator's traceback."""

from __future__ import annotations

import math
import os

from vitscope.errors import ConfigError
from vitscope.models import get_config
from vitscope.vit import ViTConfig

_POSITIVE_INTS = ("patch_size", "embed_dim", "depth", "num_heads", "in_chans")
_PROBABILITIES = ("drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate")


def check_model(cfg) -> None:
    """For a TrainConfig `cfg` of an image task (not annotated: its module imports this one): the preset
    (`cfg.image.model`) exists, each `model_args` field is a ViTConfig field of its type and range, and a
    training step at `image_size` fits in this machine's memory."""
    image = cfg.image
    base = get_config(image.model).to_dict()  # an unknown preset: its own message, with close names
    known = set(ViTConfig.__dataclass_fields__)
    unknown = sorted(set(image.model_args) - known)
    if unknown:
        raise ConfigError(f"model_args: {', '.join(unknown)} not a model field; choose from {', '.join(sorted(known))}")
    args = {**base, **image.model_args}
    for name in _POSITIVE_INTS:
        v = args[name]
        if isinstance(v, int) and not isinstance(v, bool) and v < 1:
            why = " (a model with no blocks has nothing to train)" if name == "depth" else ""
            raise ConfigError(f"{name} must be at least 1{why}, got {v}")
    for name in _PROBABILITIES:
        v = args[name]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not 0 <= v < 1:
            raise ConfigError(f"{name} is a probability in [0, 1), got {v}")
    for name, low in (("mlp_ratio", 0.0), ("norm_eps", 0.0)):
        v = args[name]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not (math.isfinite(v) and v > low):
            raise ConfigError(f"{name} must be a finite number above {low:g}, got {v}")
    v = args["init_values"]
    if isinstance(v, (int, float)) and not isinstance(v, bool) and not (math.isfinite(v) and v >= 0):
        raise ConfigError(f"init_values is LayerScale's starting scale, a finite number of at least 0 such as 1e-5 "
                          f"(0 or none: no LayerScale), got {v}")
    stem = args["stem"]
    pair = (lambda s: isinstance(s, (list, tuple)) and len(s) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in s))
    if not isinstance(stem, (list, tuple)) or not all(pair(s) for s in stem):
        raise ConfigError(f"stem is a list of [channels, stride] pairs of whole numbers >= 1, e.g. --set "
                         f"stem=[[32,2],[64,2]] (or [] for none); got {stem!r}")
    img = args["img_size"]
    given_img = "img_size" in image.model_args
    if isinstance(img, list):
        img = tuple(img)
    if given_img and not (isinstance(img, int) and not isinstance(img, bool) and img >= 1 or isinstance(img, tuple)
                          and len(img) == 2 and all(isinstance(x, int) and x >= 1 for x in img)):
        raise ConfigError(f"img_size is a number of pixels or [height, width], got {img!r}")
    # The data decides the image size unless img_size is given: check the rest with a size that fits.
    patch = args["patch_size"] if isinstance(args["patch_size"], int) and args["patch_size"] >= 1 else 1
    args["img_size"] = img if given_img else patch
    ViTConfig.from_dict(args)  # types, choices and divisibility, with ViTConfig's own messages
    d, p = args["embed_dim"], args["patch_size"]
    tokens = ((max(img) if isinstance(img, tuple) else img) / p) ** 2 + 1 if given_img else 1
    channels = args["stem"][-1][0] if args["stem"] else args["in_chans"]
    check_params_memory("the model", args["depth"] * (4 + 2 * args["mlp_ratio"]) * d * d
                         + (p * p * channels + tokens + args["num_classes"]) * d, "embed_dim, depth, mlp_ratio")
    # the data is resized to image_size (whatever the model takes), so that side counts where given
    side = image.image_size or ((max(img) if isinstance(img, tuple) else img) if given_img else None)
    if side is not None:
        _check_step_memory(cfg, args, side)
    if given_img and (cfg.task != "classify" or image.image_size not in (None, img)):
        # the encoder is built at the size the images are read at: a second size would be ignored in silence
        raise ConfigError(f"give the image size once, with --image-size (the images are read at it and the model "
                          f"follows), not --set img_size={img!r}"
                          + (f" beside --image-size {image.image_size}" if image.image_size is not None else ""))


def step_bytes(args: dict, side: int, batch: int) -> float:
    """A rough upper estimate of one training step's activations for ViTConfig fields `args` at side x side
    pixels: the stem's feature maps, and per block the attention scores and a dozen token-sized tensors."""
    total = 2.0 * args["in_chans"] * side**2  # the batch of images, augmented in float
    stride = 1
    for channels, s in args["stem"]:
        stride *= s
        total += 3 * channels * (side / stride) ** 2
    tokens = (side / args["patch_size"]) ** 2 + 1
    total += args["depth"] * (2 * args["num_heads"] * tokens**2 + 16 * tokens * args["embed_dim"])
    return 4.0 * batch * total


def _memory_bytes() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_params_memory(what: str, params: float, fields: str) -> None:
    """Refuse a model whose training (weights, gradients and AdamW's two moments: 16 bytes a parameter) cannot fit
    in this machine's memory, before anything is allocated or written."""
    have = _memory_bytes()
    if have is not None and 16 * params > have:
        raise ConfigError(f"{what} would have about {params:,.3g} parameters, {16 * params / 2**30:,.0f} GiB to "
                          f"train, and this machine has {have / 2**30:,.0f} GiB; choose smaller {fields}")


def _check_step_memory(cfg, args: dict, side: int) -> None:
    need = step_bytes(args, side, cfg.batch_size)
    have = _memory_bytes()
    if have is not None and need > have:
        raise ConfigError(f"image_size {side}: a training step at {side}x{side} pixels with batch_size "
                         f"{cfg.batch_size} needs about {need / 2**30:,.0f} GiB for its activations, and this "
                         f"machine has {have / 2**30:,.0f} GiB; choose a smaller --image-size or --batch-size")
