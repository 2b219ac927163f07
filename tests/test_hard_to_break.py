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
from vitscope.caption.builders import CaptionTaskConfig, build_captioner, captioner_to_dict, vocab_metadata
from vitscope.caption.run import CAPTIONER_KEY
from vitscope.caption.transformer import EncoderSpec
from vitscope.cli import main
from vitscope.errors import InputError
from vitscope.sequence.vocab import SPECIALS, Vocabulary
from vitscope.translate.builders import ParallelData, build_translator
from vitscope.translate.language import make_pair
from vitscope.translate.run import translation_metadata
from vitscope.vit import VisionTransformer, ViTConfig
from vitscope.weights.model_io import save_model


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
    from vitscope.weights.model_io import load_model
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


# -- settings the data cannot give, or the task would not read: refused before any work -----------------------
def _flickr8k(root: Path, n: int = 4) -> Path:
    images = root / "Flicker8k_Dataset"
    images.mkdir(parents=True)
    lines = []
    for i in range(n):
        _png(images / f"{i}.jpg", "RGB", 16)
        lines.append(f"{i}.jpg#0\ta grey square number {i}")
    (root / "Flickr8k.token.txt").write_text("\n".join(lines) + "\n")
    for split in ("train", "dev", "test"):
        (root / f"Flickr_8k.{split}Images.txt").write_text("".join(f"{i}.jpg\n" for i in range(n)))
    return root


CAPTION_FLAGS = ["--task", "caption", "--init-weights", "none", "--model", "vit_tiny_patch4_28", "--set",
                 "embed_dim=8", "--set", "depth=1", "--set", "num_heads=2", "--decoder-set", "dim=8",
                 "--decoder-set", "depth=1", "--decoder-set", "num_heads=2", "--image-size", "16", "--epochs", "1",
                 "--batch-size", "2", "--threads", "1", "--amp", "fp32", "--explain-images", "0", "--no-progress"]
CLASSIFY_FLAGS = ["--model", "vit_tiny_patch4_28", "--set", "embed_dim=8", "--set", "depth=1", "--set",
                  "num_heads=2", "--epochs", "1", "--batch-size", "64", "--threads", "1", "--amp", "fp32",
                  "--explain-images", "0", "--no-progress"]
TRANSLATE_FLAGS = ["--task", "translate", "--train-sentences", "64", "--test-sentences", "8", "--max-words", "8",
                   "--epochs", "1", "--batch-size", "32", "--threads", "1", "--explain-images", "0",
                   "--decoder-set", "embed_dim=8", "--decoder-set", "hidden_dim=8", "--decoder-set", "attn_dim=8",
                   "--no-progress"]


@pytest.mark.parametrize("data, in_chans, said", [
    ("flickr8k", "2", "flickr8k's images can be read as 1 or 3 channels only"),
    ("fmnist_scenes", "2", "fmnist_scenes's images can be read as 1 channel only"),
    ("fmnist_scenes", "3", "fmnist_scenes's images can be read as 1 channel only"),
])
def test_caption_in_chans_the_data_cannot_give_is_refused_up_front(tmp_path, capsys, monkeypatch, data, in_chans,
                                                                    said):
    from vitscope.caption import builders as captioning

    def never(*a, **k):
        raise AssertionError("the data was read before the setting was checked")

    monkeypatch.setattr(captioning, "load_caption_dataset", never)
    args = ["--dataset", data] + (["--data-dir", str(_flickr8k(tmp_path / "flickr"))] if data == "flickr8k" else [])
    code = main(["train", *CAPTION_FLAGS, *args, "--set", f"in_chans={in_chans}", "--out", str(tmp_path / "out")])
    one_line_error(capsys, code, f"--set in_chans={in_chans}", said)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("data, in_chans", [("digits", "2"), ("digits", "3"), ("folder", "2"), ("folder", "4")])
def test_classify_in_chans_the_data_cannot_give_is_refused_up_front(tmp_path, capsys, monkeypatch, data, in_chans):
    import vitscope.data as data_module

    def never(*a, **k):
        raise AssertionError("the data was read before the setting was checked")

    monkeypatch.setattr(data_module, "load_dataset", never)
    code = main(["train", *CLASSIFY_FLAGS, "--dataset", data, "--data-dir", str(tmp_path), "--set",
                 f"in_chans={in_chans}", "--out", str(tmp_path / "out")])
    one_line_error(capsys, code, f"--set in_chans={in_chans}", f"{data}'s images can be read as")
    assert not (tmp_path / "out").exists()


def test_a_grey_caption_set_of_image_files_trains_with_in_chans_1(tmp_path, capsys):
    root = _flickr8k(tmp_path / "flickr")
    assert main(["train", *CAPTION_FLAGS, "--dataset", "flickr8k", "--data-dir", str(root), "--set", "in_chans=1",
                 "--out", str(tmp_path / "out")]) == 0
    with safe_open(str(tmp_path / "out" / "last.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["captioner"])["config"]["encoder"]["overrides"]["in_chans"] == 1


def test_a_grey_image_folder_classifier_with_in_chans_1(tmp_path):
    for label in ("a", "b"):
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(40):
            _png(tmp_path / "data" / label / f"{i}.png", "RGB", 8)
    assert main(["train", *CLASSIFY_FLAGS, "--dataset", "folder", "--data-dir", str(tmp_path / "data"),
                 "--image-size", "8", "--set", "patch_size=4", "--set", "in_chans=1", "--batch-size", "16",
                 "--eval-split", "val",
                 "--out", str(tmp_path / "out")]) == 0
    from vitscope.weights.model_io import load_model

    assert load_model(tmp_path / "out" / "last.safetensors").config.in_chans == 1


@pytest.mark.parametrize("flags, task, said", [
    (TRANSLATE_FLAGS + ["--set", "in_chans=2"], "translate", "--set in_chans"),
    (TRANSLATE_FLAGS + ["--image-size", "64", "--aug-flip", "false"], "translate", "--image-size, --aug-flip"),
    (TRANSLATE_FLAGS + ["--model", "vit_tiny_patch4_28"], "translate", "--model"),
    (TRANSLATE_FLAGS + ["--pretrained", "true"], "translate", "--pretrained"),
    (TRANSLATE_FLAGS + ["--max-len", "12"], "translate", "--max-len"),
    (CLASSIFY_FLAGS + ["--dataset", "digits", "--eval-beam", "3"], "classify", "--eval-beam"),
    (CLASSIFY_FLAGS + ["--dataset", "digits", "--decoder-set", "dim=8"], "classify", "--decoder-set dim"),
    (CLASSIFY_FLAGS + ["--dataset", "digits", "--max-words", "9", "--captioner", "lstm"], "classify",
     "--captioner, --max-words"),
    (CAPTION_FLAGS + ["--dataset", "fmnist_scenes", "--train-sentences", "10"], "caption", "--train-sentences"),
    (CAPTION_FLAGS + ["--dataset", "fmnist_scenes", "--translator", "transformer"], "caption", "--translator"),
])
def test_a_setting_the_task_would_ignore_is_refused_up_front(tmp_path, capsys, flags, task, said):
    code = main(["train", *flags, "--out", str(tmp_path / "out")])
    one_line_error(capsys, code, f"--task {task}: {said} would be ignored")
    assert not (tmp_path / "out").exists()


def test_a_translator_evaluates_the_split_it_is_given(tmp_path, capsys):
    # eval_split is a field every task reads: a translator evaluates the training sentences when asked, and
    # refuses a split the synthetic pair does not have before any work
    code = main(["train", *TRANSLATE_FLAGS, "--eval-split", "val", "--out", str(tmp_path / "bad")])
    one_line_error(capsys, code, "--eval-split val: the synthetic language pair's splits are train and test")
    assert not (tmp_path / "bad").exists()
    from vitscope.translate.language import make_pair

    pair = make_pair(0, train_size=64, test_size=8, max_words=8)
    for split, examples in (("train", pair.train), ("test", pair.test)):
        out = tmp_path / split
        assert main(["train", *TRANSLATE_FLAGS, "--eval-split", split, "--out", str(out)]) == 0
        shown = [e["source"] for e in json.loads((out / "summary.json").read_text())["examples"]]
        assert shown == [" ".join(e.source) for e in examples[: len(shown)]] and len(shown) == min(8, len(examples))


# -- sentences outside the source language's grammar ----------------------------------------------------------
def test_grammar_note_gives_the_grammatical_order_where_there_is_one():
    from vitscope.translate.language import grammar_note

    assert grammar_note("the king old sees a cat".split()) is None
    assert grammar_note("the old king sees a cat".split()) == 'adjectives follow their noun: "the king old sees a cat"'
    assert grammar_note("a big red dog sees the small cat".split()) == (
        'adjectives follow their noun: "a dog big red sees the cat small"')
    assert grammar_note("the king sees".split()) == "expected a noun at word 4"
    assert grammar_note("sees the king a cat".split()) == "expected a noun at word 1"


def test_translate_notes_a_sentence_outside_the_grammar_in_one_line(ckpts, capsys):
    capsys.readouterr()
    assert main(["translate", str(ckpts["translator"]), "the old king sees a cat", "--beam", "1"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == ('note: not a sentence of the training language (adjectives follow their noun: "the king '
                           'old sees a cat"); the translation below is the model\'s guess.')
    assert out.strip()  # the model's guess is still printed
    assert main(["translate", str(ckpts["translator"]), "the old king sees a cat", "the king sees", "--beam", "1",
                 "--json"]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)
    assert rows[0]["note"].startswith("not a sentence of the training language (adjectives follow their noun")
    assert rows[1]["note"] == ("not a sentence of the training language (expected a noun at word 4); the translation "
                               "below is the model's guess.")
    assert len(err.strip().splitlines()) == 2 and "'the king sees'" in err
    assert main(["translate", str(ckpts["translator"]), "the king old sees a cat", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)[0]["note"] is None and err == ""


# -- empty captions --------------------------------------------------------------------------------------------
def test_an_empty_caption_is_said_in_text_and_empty_in_json(ckpts, tmp_path, capsys):
    from vitscope.sequence.vocab import EOS

    state = load_file(str(ckpts["captioner"]))
    state["decoder.head.bias"][EOS] = 1e4  # <eos> first, whatever the image
    with safe_open(str(ckpts["captioner"]), framework="pt") as f:
        meta = dict(f.metadata())
    ckpt = tmp_path / "eos.safetensors"
    save_file(state, str(ckpt), metadata=meta)
    capsys.readouterr()
    assert main(["caption", str(ckpt), str(ckpts["image"]), "--beam", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("(empty caption)") and err == ""
    assert main(["caption", str(ckpt), str(ckpts["image"]), "--beam", "5", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["caption"] == "" and row["words"] == []


# -- a Karpathy image folder that is a link --------------------------------------------------------------------
def _karpathy(tmp_path: Path, link_target: Path | None = None, filepath: str = "imgs") -> tuple[Path, Path]:
    """dataset_coco.json over root/imgs/{0..3}.png; with `link_target`, root/imgs is a link to that folder."""
    real = link_target or tmp_path / "root" / "imgs"
    real.mkdir(parents=True, exist_ok=True)
    (tmp_path / "root").mkdir(exist_ok=True)
    if link_target is not None:
        (tmp_path / "root" / "imgs").symlink_to(link_target, target_is_directory=True)
    images = []
    for i in range(4):
        _png(real / f"{i}.png", "RGB", 16)
        images.append({"filename": f"{i}.png", "filepath": filepath, "split": "train" if i < 3 else "test",
                       "sentences": [{"raw": f"a grey square number {i}"}]})
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps({"images": images}))
    return path, tmp_path / "root"


def test_a_karpathy_image_folder_that_is_a_link_is_followed(tmp_path, capsys):
    split_file, root = _karpathy(tmp_path, link_target=tmp_path / "elsewhere" / "train2014")
    from vitscope.caption.readers import load_karpathy

    assert len(load_karpathy(split_file, root, "train", image_size=16)) == 3
    assert main(["train", *CAPTION_FLAGS, "--dataset", "karpathy", "--captions-file", str(split_file),
                 "--data-dir", str(root), "--eval-split", "test", "--out", str(tmp_path / "out")]) == 0


def test_a_karpathy_path_that_resolves_outside_the_root_is_still_refused(tmp_path, capsys):
    secret = tmp_path / "secret"
    secret.mkdir()
    _png(secret / "0.png")
    split_file, root = _karpathy(tmp_path, filepath="imgs/../../secret")
    code = main(["train", *CAPTION_FLAGS, "--dataset", "karpathy", "--captions-file", str(split_file),
                 "--data-dir", str(root), "--eval-split", "test", "--out", str(tmp_path / "out")])
    one_line_error(capsys, code, str(split_file), "outside the image folder")
    # an image file in a linked folder that links out of it
    split_file, root = _karpathy(tmp_path / "b", link_target=tmp_path / "b" / "elsewhere")
    (tmp_path / "b" / "elsewhere" / "0.png").unlink()
    (tmp_path / "b" / "elsewhere" / "0.png").symlink_to(secret / "0.png")
    code = main(["train", *CAPTION_FLAGS, "--dataset", "karpathy", "--captions-file", str(split_file),
                 "--data-dir", str(root), "--eval-split", "test", "--out", str(tmp_path / "out")])
    one_line_error(capsys, code, "image 'imgs/0.png'", f"leads to {secret / '0.png'}", "outside the image folder")
    assert not (tmp_path / "out").exists()


# -- the smaller messages --------------------------------------------------------------------------------------
def test_init_weights_names_the_file_not_a_timm_checkpoint(ckpts, tmp_path, capsys):
    for ckpt, flags in ((ckpts["captioner"], []), (ckpts["classifier"], ["--set", "embed_dim=16"])):
        code = main(["train", *CLASSIFY_FLAGS, "--dataset", "digits", *flags, "--init-weights", str(ckpt), "--out",
                     str(tmp_path / "out")])
        err = one_line_error(capsys, code, str(ckpt))
        assert "timm checkpoint" not in err


def test_a_binary_file_with_a_huge_header_is_not_called_text(ckpts, tmp_path, capsys):
    import struct

    for n in (10**9, 10**12):
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(struct.pack("<Q", n) + b"{}")
        code = main(["predict", str(bad), str(ckpts["image"])])
        err = one_line_error(capsys, code, str(bad), "not a safetensors file", f"header of {n:,} bytes")
        assert "text file" not in err
    text = tmp_path / "notes.safetensors"
    text.write_text("these are my notes, not weights\n")
    one_line_error(capsys, main(["predict", str(text), str(ckpts["image"])]), "is a text file")


@pytest.mark.parametrize("flags, why", [
    (["--aug-crop", "rrc"], "a random crop cuts out or moves what they name"),
    (["--aug-cutmix-alpha", "1"], "a mixed image holds two images' items"),
    (["--aug-flip", "true"], "a mirror image swaps left and right"),
])
def test_caption_augmentation_refusals_give_their_own_reason(tmp_path, capsys, flags, why):
    code = main(["train", *CAPTION_FLAGS, "--dataset", "fmnist_scenes", *flags, "--out", str(tmp_path / "out")])
    err = one_line_error(capsys, code, why)
    if "--aug-flip" not in flags:
        assert "mirror" not in err


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("digits") / "run"
    assert main(["train", *CLASSIFY_FLAGS, "--dataset", "digits", "--batch-size", "256", "--out", str(out)]) == 0
    return out


def test_resume_refusals_have_single_full_stops(digits_run, tmp_path, capsys):
    import os
    import pickle
    import shutil

    class Bomb:
        def __reduce__(self):
            return (os.system, ("true",))

    for damage in ("pickle", "step"):
        run = tmp_path / damage
        shutil.copytree(digits_run, run, symlinks=True)
        state = next(run.glob("step-*.state.pt"))
        if damage == "pickle":
            state.unlink()
            state.write_bytes(pickle.dumps({"step": Bomb()}))
            manifest = json.loads((run / "checkpoint.json").read_text())
            import hashlib

            manifest["sha256"][state.name] = hashlib.sha256(state.read_bytes()).hexdigest()
            manifest["bytes"][state.name] = state.stat().st_size
            (run / "checkpoint.json").write_text(json.dumps(manifest))
        else:  # the weights' step differs from the manifest's: no weights-only hint
            manifest = json.loads((run / "checkpoint.json").read_text())
            manifest["step"] += 1
            (run / "checkpoint.json").write_text(json.dumps(manifest))
        code = main(["train", "--resume", str(run), "--no-progress"])
        err = one_line_error(capsys, code, "cannot resume", *{"pickle": ["strings only. Continue from the weights"],
                                                               "step": ["Or train again"]}[damage])
        assert ".." not in err.replace("...", "") and ". or" not in err and "; ." not in err, err


def test_the_top_level_help_is_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1].replace("\n", " ")
    assert description.endswith(".") and "one module per" not in description


@pytest.mark.parametrize("kind, flags, said", [
    ("captioner", ["--flip"], "--flip: test-time views, for classifiers"),
    ("captioner", ["--shift", "2"], "--shift: test-time views"),
    ("translator", ["--flip", "--vocab", "v.json"], "--flip, --vocab: "),
    ("translator", ["--data-dir", "."], "--data-dir: "),
])
def test_eval_flags_the_runs_kind_would_ignore_are_refused(ckpts, capsys, kind, flags, said):
    one_line_error(capsys, main(["eval", str(ckpts[kind]), *flags]), said)
