"""What `vitscope eval | predict | explain` accept as the model: a run, a checkpoint, a timm file or a preset.

    open_model("runs/fmnist_quick")            # a run directory: its best.safetensors, else last
    open_model("runs/fmnist_quick/last.safetensors")
    open_model("vit_small_patch16_224")        # a preset with pretrained weights (vitscope.weights.pretrained)
    open_model("downloads/model.safetensors")  # a timm checkpoint (no vitscope config in it)

Each gives the model in eval mode and what is known of its inputs and outputs: class names, the
normalising mean and std, the dataset it was trained on. A checkpoint from vitscope records them; for
timm's ImageNet weights the classes are ImageNet's indices 0-999 and mean and std are 0.5.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vitscope.data import dataset_options, load_dataset
from vitscope.errors import InputError
from vitscope.kernels import apply
from vitscope.models import create_model, get_config, list_models
from vitscope.vit import VisionTransformer
from vitscope.weights.files import CAPTIONER_KEY, TRANSLATOR_KEY, VOCAB_KEY, check_finite, read_tensors, strip_prefix
from vitscope.weights.model_io import Metadata, create_from_timm, find_checkpoint, load_model, read_metadata
from vitscope.weights.pretrained import MEAN, STD, has_weights, weights_file


@dataclass
class ModelInfo:
    classes: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    dataset: str | None  # the dataset the run trained on, where it says
    source: str  # the file the weights came from
    named_classes: bool  # whether the classes came with the weights (else they are the output indices)
    normalisation_known: bool  # whether mean and std came with the weights (else 0.5 is assumed)
    train_config: dict  # the run's TrainConfig as saved with a vitscope checkpoint (empty for others)


def open_model(source: str | Path, *, kernels: bool = False) -> tuple[VisionTransformer, ModelInfo]:
    """The model `source` names (see the module docstring), in eval mode, and what it says about itself;
    with `kernels`, vitscope's CPU kernels swapped in (vitscope.kernels.apply)."""
    model, info = _open(source)
    if kernels:
        apply(model)
    return model, info


def _open(source: str | Path) -> tuple[VisionTransformer, ModelInfo]:
    model, info = _open_unchecked(source)

    check_finite(model.state_dict(), info.source)
    if len(info.classes) != model.num_classes:
        raise InputError(f"{info.source} names {len(info.classes)} classes but its head has {model.num_classes} "
                         f"outputs: its metadata does not belong to its weights; use the checkpoint its run wrote")
    return model, info


def _open_unchecked(source: str | Path) -> tuple[VisionTransformer, ModelInfo]:
    path = Path(source)
    if not path.exists() and has_weights(str(source)):
        file = weights_file(str(source))
        model = create_model(str(source), pretrained=file).eval()
        return model, _info(model, {}, file, mean=MEAN, std=STD)
    if not path.exists() and str(source) in list_models():
        raise FileNotFoundError(f"the preset {source} has no pretrained weights; give a run directory or a "
                                f"checkpoint, or one of the presets `vitscope models` lists with weights")
    ckpt = find_checkpoint(path)
    meta = read_metadata(ckpt) if ckpt.suffix == ".safetensors" else {}
    if TRANSLATOR_KEY in meta:
        raise InputError(f"{source} is a translation run, not a classifier: translate with vitscope translate "
                         f"{source} \"SENTENCE\", or score it with vitscope eval {source}")
    if CAPTIONER_KEY in meta or VOCAB_KEY in meta:
        raise InputError(f"{source} is a captioning run, not a classifier: caption its images with vitscope caption "
                         f"{source} IMAGE..., or score it with vitscope eval {source}")
    if "vitscope_format" not in meta:  # save_model has always written it; else timm's: shape read off the weights
        try:
            model = create_from_timm(ckpt, **_head_count_hint(ckpt, meta)).eval()
        except ValueError as e:
            if "num_heads" not in str(e):
                raise
            raise InputError(f"{ckpt} holds weights without vitscope's config, and no preset has their shape, so their "
                             f"number of heads is unknown: save the model with vitscope.weights.save_model("
                             f"model, 'model.safetensors'), which records its config, and give that file") from None
        return model, _info(model, {}, ckpt)
    model = load_model(ckpt).eval()
    return model, _info(model, meta, ckpt)


def load_data(model: VisionTransformer, info: ModelInfo, name: str, split: str | None = None,
              data_dir: str | Path | None = None):
    """(one split of dataset `name` as `model` reads it, that split's name): image folders and Pets decoded to
    its channels and (square) size, and for the run's own dataset the run's files and evaluation split where
    none are given."""
    run = info.train_config if name == info.dataset else {}
    split = split or run.get("eval_split") or "test"
    h, w = model.patch_embed.img_size
    extra = {"channels": model.config.in_chans} if "channels" in dataset_options(name) else {}
    image = run.get("image") if isinstance(run.get("image"), dict) else run  # TrainConfig.image, or flat (older)
    data = load_dataset(name, split, root=data_dir or image.get("data_dir"), image_size=h if h == w else None,
                        **extra)
    return data, split


def _head_count_hint(ckpt: Path, meta: dict[str, str]) -> dict:
    """The number of heads, which a timm state dict does not show: from the constructor arguments a file may
    carry in its metadata (`config`), else from the preset of the same width, depth and patch size."""
    try:
        args = json.loads(meta.get("config", "{}"))
    except json.JSONDecodeError:
        args = {}
    if isinstance(args, dict) and isinstance(args.get("num_heads"), int):
        return {"num_heads": args["num_heads"]}
    shapes = _shapes(ckpt)
    w = shapes.get("patch_embed.proj.weight")
    depth = len({k.split(".")[1] for k in shapes if k.startswith("blocks.")})
    if w is None:
        return {}
    for name in list_models():
        cfg = get_config(name)
        if (cfg.embed_dim, cfg.depth, cfg.patch_size) == (w[0], depth, w[-1]) and not cfg.stem:
            return {"num_heads": cfg.num_heads}
    return {}


def _shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape under timm's names; a safetensors file is read for its header only."""
    from safetensors import safe_open

    if ckpt.suffix == ".safetensors":
        with safe_open(str(ckpt), framework="pt") as f:
            raw = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    else:
        raw = {k: tuple(v.shape) for k, v in read_tensors(ckpt).items()}
    return strip_prefix(raw)


def _info(model: VisionTransformer, meta: Mapping[str, str], source: Path, mean: float | None = None,
          std: float | None = None) -> ModelInfo:
    meta = meta if isinstance(meta, Metadata) else Metadata(meta, source)
    c = model.config.in_chans
    named = "classes" in meta
    known = "mean" in meta and "std" in meta
    classes = meta.json("classes", list) if named else [str(i) for i in range(model.num_classes)]
    if not all(isinstance(name, str) for name in classes):
        raise InputError(f"{source}: its metadata 'classes' is not a list of class names; the file is damaged or "
                         f"was not written by vitscope")
    plain = (lambda v: (v if v is not None else 0.5,) * c)
    return ModelInfo(
        classes=classes,
        mean=meta.numbers("mean", c, plain(mean)) if known else plain(mean),
        std=meta.numbers("std", c, plain(std)) if known else plain(std),
        dataset=meta.get("dataset"),
        source=str(source),
        named_classes=named,
        normalisation_known=known or mean is not None,
        train_config=meta.json("train_config", dict, {}),
    )
