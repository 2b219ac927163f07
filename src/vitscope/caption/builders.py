"""Captioning's pieces for vitscope's one training loop (training/caption.py), `vitscope eval` and
`vitscope caption`: data by name, captioners by config, the vocabulary with the checkpoint.

    data  = load_caption_dataset("fmnist_scenes", "train")          # a CaptionDataset, uint8 images
    vocab = data.build_vocab(min_count=1)                          # training split only
    model = build_captioner(CaptionTaskConfig(kind="transformer"), len(vocab), img_size=56, in_chans=1)
    index, tokens = data.pairs(vocab, max_len=32)                  # one row per reference caption
    loss = model.losses(normalize(images, mean, std), sequence.trim_padding(tokens[rows]))["loss"]

The vocabulary travels with the checkpoint as a string in the safetensors metadata
(`vocab_metadata` / `vocab_from_metadata`) or a JSON file beside the weights; `check_vocab`
refuses one that does not match the model's output layer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from vitscope.caption.dataset import CaptionDataset
from vitscope.caption.readers import load_coco, load_flickr8k, load_karpathy
from vitscope.caption.scenes import ScenesConfig, load_scenes
from vitscope.caption.show_attend_tell import ShowAttendTell, ShowAttendTellConfig
from vitscope.caption.transformer import EncoderSpec, TransformerCaptioner, TransformerCaptionerConfig
from vitscope.data import DataError
from vitscope.errors import ConfigError, InputError
from vitscope.sequence.vocab import Vocabulary
from vitscope.weights.files import VOCAB_KEY

CAPTION_DATASETS = ("fmnist_scenes", "fmnist_scenes3", "coco", "karpathy", "flickr8k")
# name -> the channel counts its images can be read as: the scenes are Fashion-MNIST's grey, image files are decoded
# to what the encoder reads
CAPTION_CHANNELS = {"fmnist_scenes": (1,), "fmnist_scenes3": (1,), "coco": (1, 3), "karpathy": (1, 3),
                    "flickr8k": (1, 3)}


# -- data by name ------------------------------------------------------------------------------------
def load_caption_dataset(name: str, split: str, *, root: str | Path | None = None, image_size: int = 224,
                         channels: int = 3, captions_file: str | Path | None = None,
                         verify: bool = True) -> CaptionDataset:
    """One split of a named caption dataset.

    fmnist_scenes / fmnist_scenes3: Fashion-MNIST scenes on 2 x 2 / 3 x 3 cells (splits train, test;
    `root` is where the Fashion-MNIST files are). coco: `root`/annotations/captions_<split>*.json with
    images in `root`/<split>* (or `captions_file` and `root` the image folder). karpathy: `captions_file`
    (dataset_coco.json, ...) with images under `root`. flickr8k: `root`/Flickr8k.token.txt, its split
    lists, and images in `root`/Flicker8k_Dataset (or `captions_file` for the token file).
    """
    if name in ("fmnist_scenes", "fmnist_scenes3"):
        return load_scenes(split, config=ScenesConfig(cells=3 if name.endswith("3") else 2), root=root,
                           verify=verify)
    if name not in CAPTION_DATASETS:
        import difflib

        close = difflib.get_close_matches(name, CAPTION_DATASETS, n=2)
        raise DataError(f"unknown caption dataset {name!r}." + (f" Did you mean {' or '.join(close)}?" if close else "")
                        + f" Known: {', '.join(CAPTION_DATASETS)}")
    if root is None:
        raise DataError(f"caption dataset {name!r} needs the folder that holds it (--data-dir DIR)")
    root = Path(root)
    kw = dict(image_size=image_size, channels=channels)
    if name == "coco":
        if captions_file is None:
            found = sorted((root / "annotations").glob(f"captions_{split}*.json"))
            if not found:
                raise DataError(f"no {root}/annotations/captions_{split}*.json; give the captions file explicitly")
            captions_file = found[-1]
            folders = sorted(p for p in root.glob(f"{split}*") if p.is_dir())
            if not folders:
                raise DataError(f"no image folder {root}/{split}*/ beside the annotations; give its path as root")
            return load_coco(captions_file, folders[-1], **kw)
        return load_coco(captions_file, root, **kw)
    if name == "karpathy":
        if captions_file is None:
            raise DataError("karpathy needs the split file (dataset_coco.json, dataset_flickr8k.json, ...)")
        return load_karpathy(captions_file, root, split, **kw)
    token_file = Path(captions_file) if captions_file is not None else root / "Flickr8k.token.txt"
    folders = [root / d for d in ("Flicker8k_Dataset", "Flickr8k_Dataset", "Images") if (root / d).is_dir()]
    image_dir = folders[0] if folders else root
    return load_flickr8k(token_file, image_dir, split, **kw)


# -- models by config ----------------------------------------------------------------------------------
Captioner = TransformerCaptioner | ShowAttendTell


@dataclass
class CaptionTaskConfig:
    """kind: which captioner; encoder: the ViT preset and overrides; decoder: the captioner's own
    fields (TransformerCaptionerConfig or ShowAttendTellConfig, less vocab_size and encoder)."""

    kind: Literal["transformer", "lstm"] = "transformer"
    encoder: EncoderSpec = field(default_factory=EncoderSpec)
    decoder: dict = field(default_factory=dict)
    max_len: int = 32

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CaptionTaskConfig:
        d = dict(d)
        d["encoder"] = EncoderSpec(**d.get("encoder", {}))
        return cls(**d)


def build_captioner(config: CaptionTaskConfig, vocab_size: int, **encoder_overrides) -> Captioner:
    """The captioner `config` names, for `vocab_size` words; `encoder_overrides` (img_size, in_chans)
    adapt the encoder preset to the data."""
    e = config.encoder
    enc = EncoderSpec(e.preset, {**e.overrides, **encoder_overrides}, e.pretrained)
    kw = dict(max_len=config.max_len, **config.decoder)
    if config.kind == "transformer":
        return TransformerCaptioner(TransformerCaptionerConfig(vocab_size, enc, **kw))
    if config.kind == "lstm":
        return ShowAttendTell(ShowAttendTellConfig(vocab_size, enc, **kw))
    raise ConfigError(f"kind must be 'transformer' or 'lstm', got {config.kind!r}")


def captioner_from_dict(d: dict) -> Captioner:
    """Rebuild a captioner from `captioner_to_dict` (a checkpoint's config), its weights to be loaded
    from the checkpoint: the encoder's pretrained weights are not fetched again."""
    kind = d.get("kind")
    if kind not in ("transformer", "lstm"):
        raise ConfigError(f"not a captioner config (kind {kind!r})")
    config = dict(d["config"])
    config["encoder"] = {**config.get("encoder", {}), "pretrained": False}
    if kind == "transformer":
        return TransformerCaptioner(TransformerCaptionerConfig.from_dict(config))
    return ShowAttendTell(ShowAttendTellConfig.from_dict(config))


def captioner_to_dict(model: Captioner) -> dict:
    return {"kind": model.kind, "config": model.config.to_dict()}


# -- the vocabulary with the checkpoint ----------------------------------------------------------------
def vocab_metadata(vocab: Vocabulary) -> dict[str, str]:
    """For safetensors' metadata (str -> str)."""
    return {VOCAB_KEY: vocab.to_json()}


def vocab_from_metadata(metadata: dict[str, str] | None) -> Vocabulary:
    if not metadata or VOCAB_KEY not in metadata:
        raise InputError("the checkpoint carries no caption vocabulary; was it trained with --task caption?")
    if hasattr(metadata, "build"):  # a checkpoint's Metadata: a damaged value names the file and the key
        return metadata.build(VOCAB_KEY, Vocabulary.from_dict)
    return Vocabulary.from_json(metadata[VOCAB_KEY])


def load_vocab(path: str | Path) -> Vocabulary:
    return Vocabulary.from_json(Path(path).read_text(encoding="utf-8"))


def output_size(model: Captioner) -> int:
    return model.decoder.vocab_size if model.kind == "transformer" else model.head.out_features


def check_vocab(model: Captioner, vocab: Vocabulary) -> None:
    """Refuse a vocabulary whose size differs from the model's output layer."""
    if len(vocab) != output_size(model):
        raise InputError(f"the vocabulary has {len(vocab)} words but the model predicts {output_size(model)}; "
                         "use the vocabulary saved with this run's checkpoint")
