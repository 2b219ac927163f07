"""Issue 64, "hard to break, third round": damaged checkpoint metadata, transformers configs of the wrong type,
impossible or unused settings refused before any work, sentences outside the synthetic language's grammar,
empty captions, and the smaller messages. Every refusal is one line on stderr and exit code 2 (an InputError from
the API); the checkpoints are built in the test, not trained, so each case takes a fraction of a second."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from test_caption_cli import one_line_error
from vitscope.caption.run import CAPTIONER_KEY
from vitscope.caption.task import CaptionTaskConfig, build_captioner, captioner_to_dict, vocab_metadata
from vitscope.caption.transformer import EncoderSpec
from vitscope.caption.vocab import SPECIALS, Vocabulary
from vitscope.cli import main
from vitscope.errors import InputError
from vitscope.translate.data import ParallelData, build_translator
from vitscope.translate.language import make_pair
from vitscope.translate.run import translation_metadata
from vitscope.vit import VisionTransformer, ViTConfig
from vitscope.weights.checkpoints import save_model


# -- tiny checkpoints of each kind, written as the training loop writes them ----------------------------------
def _png(path: Path, mode: str = "L", size: int = 8) -> Path:
    Image.new(mode, (size, size), 128 if mode == "L" else (128, 90, 30)).save(path)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    classifier = VisionTransformer(ViTConfig(img_size=8, patch_size=4, in_chans=1, num_classes=3, embed_dim=8,
                                             depth=1, num_heads=2))
    save_model(classifier, root / "classifier.safetensors", metadata={
        "classes": ["a", "b", "c"], "mean": [0.5], "std": [0.25], "dataset": "digits",
        "train_config": {"dataset": "digits"}})
    vocab = Vocabulary([*SPECIALS, "a", "grey", "square"])
    captioner = build_captioner(CaptionTaskConfig(kind="transformer", max_len=8, decoder=dict(dim=8, depth=1,
                                                                                                num_heads=2),
                                                  encoder=EncoderSpec("vit_tiny_patch4_28", dict(
                                                      embed_dim=8, depth=1, num_heads=2))),
                                len(vocab), in_chans=1, img_size=8)
    save_model(captioner, root / "captioner.safetensors", metadata={
        CAPTIONER_KEY: json.dumps(captioner_to_dict(captioner)), **vocab_metadata(vocab), "mean": [0.5],
        "std": [0.5], "dataset": "coco", "train_config": {"dataset": "coco"}})
    data = ParallelData.build(make_pair(0, train_size=50, test_size=5, max_words=8))
    translator = build_translator("rnn", data, dict(embed_dim=8, hidden_dim=8, attn_dim=8))
    save_model(translator, root / "translator.safetensors",
               metadata={**translation_metadata(translator, data), "train_config": {"seed": 0}})
    _png(root / "grey.png")
    return {"classifier": root / "classifier.safetensors", "captioner": root / "captioner.safetensors",
            "translator": root / "translator.safetensors", "image": root / "grey.png"}


def with_metadata(src: Path, dst: Path, **changes: str | None) -> Path:
    """A copy of the checkpoint `src` at `dst` with metadata keys changed (None: removed)."""
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
    for k, v in changes.items():
        k = k.replace("__", ".")
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    save_file(load_file(str(src)), str(dst), metadata=meta)
    return dst


def test_the_good_checkpoints_work(ckpts, capsys):
    assert main(["predict", str(ckpts["classifier"]), str(ckpts["image"])]) == 0
    assert main(["caption", str(ckpts["captioner"]), str(ckpts["image"]), "--beam", "1"]) == 0
    assert main(["translate", str(ckpts["translator"]), "the dog sees a cat", "--beam", "1"]) == 0


VOCAB = "vitscope.caption.vocab"
DAMAGED_METADATA = [
    # (checkpoint, command, key, value)
    *[("classifier", "predict", key, value) for key in ("config", "classes", "mean", "train_config")
      for value in ("{bad", "[1, 2")],
    ("classifier", "predict", "classes", '{"a": 1}'),
    ("classifier", "predict", "classes", "[1, 2, 3]"),
    ("classifier", "predict", "mean", '["x"]'),
    ("classifier", "predict", "mean", "[0.5, 0.5, 0.5]"),
    ("classifier", "predict", "std", "[NaN]"),
    ("classifier", "predict", "config", '{"embed_dim": "8"}'),
    ("classifier", "predict", "config", "[]"),
    ("classifier", "eval", "config", "{bad"),
    ("classifier", "explain", "classes", "{bad"),
    *[("captioner", "caption", key, value) for key in ("captioner", VOCAB, "train_config", "mean")
      for value in ("{bad", "[1, 2")],
    ("captioner", "caption", "captioner", '{"kind": "transformer"}'),
    ("captioner", "caption", VOCAB, '{"format": 1}'),
    ("captioner", "eval", "captioner", "{bad"),
    *[("translator", "translate", key, value) for key in ("translator", "vitscope.translate.source_vocab",
                                                          "vitscope.translate.target_vocab", "max_words",
                                                          "train_config") for value in ("{bad", '"x"')],
    ("translator", "translate", "translator", '{"kind": "gru"}'),
    ("translator", "translate", "max_words", "-3"),
    ("translator", "eval", "translator", "{bad"),
]


@pytest.mark.parametrize("kind, command, key, value", DAMAGED_METADATA)
def test_damaged_metadata_is_one_line_naming_the_file_and_the_key(ckpts, tmp_path, capsys, kind, command, key,
                                                                   value):
    bad = with_metadata(ckpts[kind], tmp_path / "bad.safetensors", **{key: value})
    args = {"predict": [str(ckpts["image"])], "caption": [str(ckpts["image"])], "eval": [],
            "explain": [str(ckpts["image"]), "--out", str(tmp_path / "out")],
            "translate": ["the dog sees a cat"]}[command]
    code = main([command, str(bad), *args])
    err = one_line_error(capsys, code, str(bad), f"its metadata {key!r}", "damaged or was not written by vitscope")
    assert "JSONDecodeError" not in err
    assert not (tmp_path / "out").exists()


def test_damaged_metadata_from_the_api_is_an_input_error(ckpts, tmp_path):
    from vitscope.caption.run import open_captioner
    from vitscope.translate.run import open_translator
    from vitscope.weights.checkpoints import load_model
    from vitscope.weights.model_source import open_model

    for kind, key, opener in (("classifier", "config", load_model), ("classifier", "classes", open_model),
                              ("captioner", VOCAB, open_captioner), ("translator", "translator", open_translator)):
        bad = with_metadata(ckpts[kind], tmp_path / f"{kind}.safetensors", **{key: "{bad"})
        with pytest.raises(InputError, match=f"its metadata '{key}' is not valid JSON"):
            opener(bad)


# -- transformers' config.json -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    from vitscope.weights.hf import export_hf

    folder = tmp_path_factory.mktemp("hf")
    model = VisionTransformer(ViTConfig(img_size=8, patch_size=4, in_chans=1, num_classes=3, embed_dim=8, depth=1,
                                        num_heads=2))
    export_hf(model, folder)
    return folder


@pytest.mark.parametrize("change, field", [
    ({"hidden_size": "8"}, "hidden_size"), ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_hidden_layers": -1}, "num_hidden_layers"), ({"num_channels": 1.5}, "num_channels"),
    ({"image_size": "big"}, "image_size"), ({"patch_size": [4]}, "patch_size"),
    ({"intermediate_size": None}, "intermediate_size"), ({"layer_norm_eps": "tiny"}, "layer_norm_eps"),
    ({"hidden_dropout_prob": 2}, "hidden_dropout_prob"), ({"qkv_bias": "yes"}, "qkv_bias"),
    ({"num_attention_heads": 3}, "num_attention_heads 3"), ({"image_size": 6}, "img_size"),
])
def test_load_hf_names_the_file_and_field_of_a_config_of_the_wrong_kind(hf_folder, tmp_path, change, field):
    from vitscope.weights.hf import load_hf

    config = json.loads((hf_folder / "config.json").read_text())
    config.update(change)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(InputError) as e:
        load_hf(hf_folder / "model.safetensors", config=path)
    assert str(path) in str(e.value) and field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text, said", [("{bad", "not valid JSON"), ("[1, 2]", "holds a list"),
                                        (b"\xff\xfe{", "not valid JSON")])
def test_load_hf_names_a_damaged_config_json(hf_folder, tmp_path, text, said):
    from vitscope.weights.hf import load_hf

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((hf_folder / "model.safetensors").read_bytes())
    (folder / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(InputError, match=said) as e:
        load_hf(folder)
    assert str(folder / "config.json") in str(e.value)
    assert load_hf(hf_folder).num_classes == 3  # the good one loads
