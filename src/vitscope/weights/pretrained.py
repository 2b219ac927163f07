"""Pretrained weights for the ImageNet presets: timm's checkpoints on the Hugging Face hub, the files
`timm.create_model(name, pretrained=True)` fetches.

    model = create_model("vit_small_patch16_224", pretrained=True)         # timm's numbers, 1000 classes
    model = create_model("vit_small_patch16_224", pretrained=True, num_classes=37, in_chans=1, img_size=112)
    model = create_model("vit_small_patch16_224", pretrained="downloads/model.safetensors")

Each file is downloaded once into `$VITSCOPE_DATA/weights/` (default `~/.cache/vitscope/weights/`), written
whole or not at all, and read as safetensors (nothing is unpickled). `HF_ENDPOINT` points at a hub mirror;
with `HF_HUB_OFFLINE=1` only the cache is used. A model whose shape differs from the checkpoint's gets the
weights adapted as timm adapts them: another `num_classes` keeps the head freshly initialised, another
`img_size` resamples the position table (bicubic, antialiased), another `in_chans` sums the patch
embedding's RGB filters into one channel, or repeats them and scales by 3 / in_chans.
"""

from __future__ import annotations

import math
import os
import urllib.request
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

from vitscope.errors import VitscopeError
from vitscope.io import atomic_write, data_root
from vitscope.vit import VisionTransformer
from vitscope.weights.files import as_state_dict, strip_prefix
from vitscope.weights.model_io import load_timm_state_dict

# vitscope preset -> the pretrained tag timm loads for it by default (ImageNet-21k, fine-tuned on 1k)
TIMM_WEIGHTS = {
    "vit_tiny_patch16_224": "vit_tiny_patch16_224.augreg_in21k_ft_in1k",
    "vit_small_patch16_224": "vit_small_patch16_224.augreg_in21k_ft_in1k",
    "vit_base_patch16_224": "vit_base_patch16_224.augreg2_in21k_ft_in1k",
    "vit_large_patch16_224": "vit_large_patch16_224.augreg_in21k_ft_in1k",
}
# the input normalisation they were trained with (timm's IMAGENET_INCEPTION_MEAN and _STD), per channel
MEAN = 0.5
STD = 0.5


class WeightsError(VitscopeError, RuntimeError):
    """Pretrained weights could not be found or fetched; the message says what to do."""


def has_weights(name: str) -> bool:
    return name in TIMM_WEIGHTS


def weights_url(name: str) -> str:
    """Where the hub (or `HF_ENDPOINT`'s mirror) serves the preset's timm checkpoint."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    return f"{endpoint}/timm/{_tag(name)}/resolve/main/model.safetensors"


def weights_file(name: str, *, progress: bool = True, opener: Callable | None = None) -> Path:
    """The preset's checkpoint in the cache, downloaded first if it is not there."""
    path = data_root() / "weights" / f"{_tag(name)}.safetensors"
    if path.is_file():
        return path
    url = weights_url(name)
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise WeightsError(f"{name}'s weights are not in {path.parent} and HF_HUB_OFFLINE is set; download "
                           f"{url} to {path}, or unset HF_HUB_OFFLINE")
    _fetch(url, path, progress=progress, opener=opener or urllib.request.urlopen)
    return path


def _tag(name: str) -> str:
    if name not in TIMM_WEIGHTS:
        raise WeightsError(f"no pretrained weights for {name!r}; these presets have them: "
                           f"{', '.join(TIMM_WEIGHTS)} (or pass pretrained=PATH to a timm checkpoint)")
    return TIMM_WEIGHTS[name]


def _fetch(url: str, path: Path, *, progress: bool, opener: Callable) -> None:
    """Stream `url` to a temporary file beside `path`, check it is a ViT checkpoint, then rename it."""
    from tqdm.auto import tqdm

    def stream(tmp: str) -> None:
        with open(tmp, "wb") as f, opener(url, timeout=60) as response:
            size = int(getattr(response, "headers", {}).get("Content-Length") or 0)
            with tqdm(total=size or None, unit="B", unit_scale=True, desc=f"download {path.stem}",
                      disable=not progress) as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
        _check_checkpoint(Path(tmp), url)

    try:
        atomic_write(path, stream)
    except OSError as e:  # URLError, HTTPError, timeouts, a full disk
        raise WeightsError(f"could not download {url} ({e}); on a machine without access, fetch the file "
                           f"elsewhere and put it at {path}, or pass pretrained=PATH") from None


def _check_checkpoint(path: Path, url: str) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
    except Exception as e:  # safetensors' own error type: a cut-short or non-safetensors answer
        raise WeightsError(f"{url} did not give a safetensors file ({e}); nothing was kept") from None
    if not any(k.endswith("patch_embed.proj.weight") for k in keys):  # timm's names, maybe under `model.`
        raise WeightsError(f"{url} is not a timm ViT checkpoint (no patch_embed.proj.weight); nothing was kept")


# -- adapting the weights to the model -------------------------------------------------------------
def adapt_input_channels(weight: Tensor, in_chans: int) -> Tensor:
    """Patch-embedding filters (O, 3, P, P) for `in_chans` input channels, as timm's `adapt_input_conv`:
    summed for one channel (a grey image then gives the RGB model's output for that grey repeated), else
    the RGB filters repeated and scaled by 3 / in_chans."""
    o, c, ph, pw = weight.shape
    if in_chans == c:
        return weight
    if in_chans == 1:
        return weight.sum(dim=1, keepdim=True)
    reps = math.ceil(in_chans / c)
    return weight.repeat(1, reps, 1, 1)[:, :in_chans] * (c / in_chans)


def load_pretrained(model: VisionTransformer, source: str | Path | dict[str, Tensor]) -> VisionTransformer:
    """Load a timm checkpoint (a file or a state dict) into `model`, adapting the head, the input channels
    and the position table where the model's shape differs; every other tensor must match exactly."""
    sd = strip_prefix(as_state_dict(source))
    own = model.state_dict()
    for key in ("head.weight", "head.bias"):
        if key in sd and (key not in own or own[key].shape != sd[key].shape):
            if key in own:
                sd[key] = own[key].clone()  # another number of classes: the model's fresh head
            else:
                del sd[key]  # num_classes=0: no head
    # the conv that reads the image: the stem's first when there is a stem (the projection then reads its
    # channels, not the image's), else the patch projection
    first = "patch_embed.stem.0.weight" if "patch_embed.stem.0.weight" in own else "patch_embed.proj.weight"
    w = sd.get(first)
    if w is not None and w.dim() == 4 and w.shape[1] != model.config.in_chans:
        sd[first] = adapt_input_channels(w, model.config.in_chans)
    return load_timm_state_dict(model, sd, source="the state dict" if isinstance(source, dict) else str(source))
