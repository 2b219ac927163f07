"""Caption files of the wrong shape, image paths that leave the image folder, and vocabularies that cannot
caption: each is one line that names the file, the entry and what to do (a DataError or ConfigError from
the API; exit code 2 and one stderr line from `vitscope train --task caption`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import raises_one_line
from test_caption_cli import one_line_error
from vitscope.caption.readers import (
    MAX_CAPTION_TOKENS,
    load_coco,
    load_flickr8k,
    load_karpathy,
    read_coco,
    read_karpathy,
)
from vitscope.cli import main
from vitscope.data import DataError


def _png(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), 120, np.uint8)).save(path)
    return path



def _raises(call, *fragments, error=DataError) -> str:
    return raises_one_line(call, *fragments, error=error)


def coco_file(tmp_path: Path, images=None, annotations=None, name="captions.json") -> Path:
    """A COCO captions file over tmp_path/images/{a,b}.png (both written), with entries as given."""
    for f in ("a.png", "b.png"):
        _png(tmp_path / "images" / f)
    images = images if images is not None else [{"id": 0, "file_name": "a.png"}, {"id": 1, "file_name": "b.png"}]
    annotations = annotations if annotations is not None else [
        {"image_id": 0, "caption": "a grey square"}, {"image_id": 1, "caption": "another grey square"}]
    path = tmp_path / name
    path.write_text(json.dumps({"images": images, "annotations": annotations}))
    return path


def karpathy_file(tmp_path: Path, first=None) -> Path:
    """A Karpathy split file over tmp_path/root/imgs/{0,1}.png: 0 in train, 1 in test; `first` edits image 0."""
    images = []
    for i, split in enumerate(("train", "test")):
        _png(tmp_path / "root" / "imgs" / f"{i}.png")
        images.append({"filename": f"{i}.png", "filepath": "imgs", "split": split,
                       "sentences": [{"tokens": ["a", "grey", "square"], "raw": "A grey square."}]})
    images[0].update(first or {})
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps({"images": images}))
    return path


def flickr_root(tmp_path: Path, token_bytes: bytes | None = None) -> Path:
    """A Flickr8k folder: token file, split lists, images in Flicker8k_Dataset."""
    root = tmp_path / "flickr"
    for name in ("1000_a.jpg", "1001_b.jpg"):
        _png(root / "Flicker8k_Dataset" / name)
    (root / "Flickr8k.token.txt").write_bytes(token_bytes if token_bytes is not None else
                                              b"1000_a.jpg#0\tA grey square .\n1001_b.jpg#0\tA grey box .\n")
    (root / "Flickr_8k.trainImages.txt").write_text("1000_a.jpg\n")
    (root / "Flickr_8k.devImages.txt").write_text("1001_b.jpg\n")
    (root / "Flickr_8k.testImages.txt").write_text("1001_b.jpg\n")
    return root


# -- the shape of a COCO file ----------------------------------------------------------------------------
@pytest.mark.parametrize("value, said", [(None, "'file_name' null"), (42, "'file_name' the number 42"),
                                         (["a.png"], "'file_name' a list (1 item)"), ("", "'file_name' the string ''"),
                                         (True, "'file_name' true")])
def test_coco_file_name_of_the_wrong_type(tmp_path, value, said):
    path = coco_file(tmp_path, images=[{"id": 0, "file_name": "a.png"}, {"id": 1, "file_name": value}])
    _raises(lambda: load_coco(path, tmp_path / "images"), str(path), "'images' entry 1", said,
            "must be a non-empty string")


def test_coco_caption_that_is_not_a_string_is_not_called_empty(tmp_path):
    path = coco_file(tmp_path, annotations=[{"image_id": 0, "caption": 42}])
    msg = _raises(lambda: read_coco(path), str(path), "'annotations' entry 0", "'caption' the number 42",
                  "must be a string")
    assert "empty" not in msg
    path = coco_file(tmp_path, annotations=[{"image_id": 0, "caption": "fine"}, {"image_id": 1, "caption": ["a", "b"]}])
    msg = _raises(lambda: read_coco(path), "'annotations' entry 1", "'caption' a list (2 items)")
    assert "unhashable" not in msg and "lacks the field" not in msg
    path = coco_file(tmp_path, annotations=[{"image_id": [0], "caption": "a grey square"}])
    msg = _raises(lambda: read_coco(path), "'annotations' entry 0", "'image_id' a list (1 item)")
    assert "unhashable" not in msg


def test_coco_entries_that_are_not_objects_or_lack_a_field(tmp_path):
    path = coco_file(tmp_path, annotations=["a grey square"])
    _raises(lambda: read_coco(path), "'annotations' entry 0 is the string 'a grey square', not an object",
            "'image_id'", "'caption'")
    path = coco_file(tmp_path, images=[{"id": 0}])
    _raises(lambda: read_coco(path), "'images' entry 0 has no 'file_name' field")
    path = coco_file(tmp_path, images=[{"id": 0, "file_name": "a.png"}, {"id": 0, "file_name": "b.png"}])
    _raises(lambda: read_coco(path), "'images' entry 1 repeats the id 0")


def test_json_that_python_cannot_read_names_the_file(tmp_path):
    for text, said in (("[" * 100_000 + "]" * 100_000, "not valid JSON"),
                       ('{"images": [{"id": ' + "9" * 5000 + ', "file_name": "a.png"}], "annotations": []}',
                        "not valid JSON")):
        path = tmp_path / "captions.json"
        path.write_text(text)
        _raises(lambda p=path: read_coco(p), str(path), said)


def test_coco_file_without_annotations_says_so(tmp_path):
    path = coco_file(tmp_path, annotations=[])
    msg = _raises(lambda: load_coco(path, tmp_path / "images"), str(path), "no image has a caption",
                  "2 images, 0 annotations")
    assert "could be read" not in msg


def test_a_caption_past_the_length_cap_names_its_entry(tmp_path):
    words = " ".join(f"w{i}" for i in range(200_000))
    path = coco_file(tmp_path, annotations=[{"image_id": 0, "caption": "fine"}, {"image_id": 1, "caption": words}])
    _raises(lambda: read_coco(path), str(path), "'annotations' entry 1", "200,000 words",
            f"the {MAX_CAPTION_TOKENS:,} a caption may have")
    # at the cap itself a caption is still read
    path = coco_file(tmp_path, annotations=[{"image_id": 0, "caption": " ".join(["word"] * MAX_CAPTION_TOKENS)}])
    assert len(read_coco(path)[1][0][0].split()) == MAX_CAPTION_TOKENS


# -- the shape of a Karpathy file ------------------------------------------------------------------------
def test_karpathy_sentences_that_are_strings(tmp_path):
    path = karpathy_file(tmp_path, {"sentences": ["A grey square."]})
    _raises(lambda: read_karpathy(path, "train"), str(path), "image imgs/0.png ('images' entry 0), sentence 0",
            "is the string 'A grey square.', not an object")


def test_karpathy_tokens_that_are_a_string_are_refused_not_spelled_out(tmp_path):
    path = karpathy_file(tmp_path, {"sentences": [{"tokens": "a grey square"}]})
    _raises(lambda: read_karpathy(path, "train"), str(path), "sentence 0", "'tokens' the string 'a grey square'",
            "list of strings")
    path = karpathy_file(tmp_path, {"sentences": [{"words": ["a", "grey", "square"]}]})
    _raises(lambda: read_karpathy(path, "train"), "sentence 0 has neither 'raw' nor 'tokens'")
    path = karpathy_file(tmp_path, {"sentences": [{"tokens": ["a", 3]}]})
    _raises(lambda: read_karpathy(path, "train"), "'tokens' holding the number 3", "list of strings")
    # tokens are used when there is no raw text, and a blank raw text does not hide them
    path = karpathy_file(tmp_path, {"sentences": [{"tokens": ["a", "grey", "square"], "raw": " "}]})
    assert read_karpathy(path, "train")[1] == [["a grey square"]]


def test_karpathy_image_fields_of_the_wrong_type(tmp_path):
    path = karpathy_file(tmp_path, {"sentences": "A grey square."})
    _raises(lambda: read_karpathy(path, "train"), "'images' entry 0", "'sentences' the string", "list of sentences")
    path = karpathy_file(tmp_path, {"split": None})
    _raises(lambda: read_karpathy(path, "train"), "'images' entry 0", "'split' null")
    path = karpathy_file(tmp_path, {"filepath": 7})
    _raises(lambda: read_karpathy(path, "train"), "'images' entry 0", "'filepath' the number 7")


# -- Flickr8k text ---------------------------------------------------------------------------------------
def test_flickr8k_token_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    root = flickr_root(tmp_path, b"1000_a.jpg#0\tA grey square .\n1001_b.jpg#0\tA gr\xe9y box .\n")
    token = root / "Flickr8k.token.txt"
    _raises(lambda: load_flickr8k(token, root / "Flicker8k_Dataset", "train"), f"{token}:2", "not UTF-8",
            "byte 0xe9", "save the Flickr8k token file as UTF-8")
    (root / "Flickr_8k.trainImages.txt").write_bytes(b"1000_\xffa.jpg\n")
    token.write_bytes(b"1000_a.jpg#0\tA grey square .\n")
    _raises(lambda: load_flickr8k(token, root / "Flicker8k_Dataset", "train"), "Flickr_8k.trainImages.txt:1",
            "not UTF-8")


def test_flickr8k_token_file_without_captions(tmp_path):
    root = flickr_root(tmp_path, b"\n\n")
    token = root / "Flickr8k.token.txt"
    msg = _raises(lambda: load_flickr8k(token, root / "Flicker8k_Dataset"), str(token), "holds no caption")
    assert "could be read" not in msg


# -- where an image may be read from ---------------------------------------------------------------------
def test_coco_image_paths_that_leave_the_image_folder(tmp_path):
    secret = _png(tmp_path / "secret.png")
    (tmp_path / "images").mkdir()
    os.symlink(secret, tmp_path / "images" / "link.png")
    for name in ("../secret.png", str(secret), "link.png", "sub/../../secret.png"):
        path = coco_file(tmp_path, images=[{"id": 0, "file_name": "a.png"}, {"id": 1, "file_name": name}])
        _raises(lambda p=path: load_coco(p, tmp_path / "images"), str(path), f"image {name!r}",
                f"leads to {secret}", "outside the image folder")


def test_image_names_that_cannot_be_a_path(tmp_path):
    (tmp_path / "images").mkdir()
    os.symlink(tmp_path / "images" / "loop.png", tmp_path / "images" / "loop.png")  # a link to itself
    for name, said in (("a\x00.png", "embedded null byte"), ("loop.png", "loop.png")):
        path = coco_file(tmp_path, images=[{"id": 0, "file_name": "a.png"}, {"id": 1, "file_name": name}])
        _raises(lambda p=path: load_coco(p, tmp_path / "images"), str(path), f"image {name!r}", said)


def test_links_and_dots_that_stay_inside_the_image_folder_are_read(tmp_path):
    _png(tmp_path / "images" / "sub" / "inner.png")
    os.symlink(tmp_path / "images" / "sub" / "inner.png", tmp_path / "images" / "link.png")
    path = coco_file(tmp_path, images=[{"id": 0, "file_name": "link.png"}, {"id": 1, "file_name": "sub/../b.png"}])
    ds = load_coco(path, tmp_path / "images", image_size=8)
    assert ds.names == ["link.png", "b.png"]  # the entry's name, not the link's target
    # an image folder that is itself a link is fine: its images are inside it
    os.symlink(tmp_path / "images", tmp_path / "linked")
    assert len(load_coco(path, tmp_path / "linked", image_size=8)) == 2


def test_karpathy_and_flickr8k_image_paths_that_leave_the_folder(tmp_path):
    secret = _png(tmp_path / "secret.png")
    path = karpathy_file(tmp_path, {"filename": "../../secret.png"})
    _raises(lambda: load_karpathy(path, tmp_path / "root", "train"), str(path), "image 'imgs/../../secret.png'",
            f"leads to {secret}", "outside the image folder")
    root = flickr_root(tmp_path, b"../secret.jpg#0\tA grey square .\n")
    _png(root / "secret.jpg")
    token = root / "Flickr8k.token.txt"
    _raises(lambda: load_flickr8k(token, root / "Flicker8k_Dataset"), str(token), "image '../secret.jpg'",
            "outside the image folder")


# -- from the command line -------------------------------------------------------------------------------
def _train_args(tmp_path: Path, dataset: str, data_dir: Path, captions_file: Path | None, *extra: str) -> list[str]:
    args = ["train", "--task", "caption", "--dataset", dataset, "--data-dir", str(data_dir), "--model",
            "vit_tiny_patch7_28", "--image-size", "28", "--batch-size", "1", "--out", str(tmp_path / "run"),
            "--no-progress", *extra]
    return args + (["--captions-file", str(captions_file)] if captions_file else [])


def _cli_case(tmp_path: Path, case: str) -> tuple[list[str], tuple[str, ...]]:
    """The arguments of `vitscope train` for one bad input, and what its error line must say."""
    images = tmp_path / "images"
    if case in ("file_name null", "file_name number", "file_name list", "caption number", "no annotations",
                "../ in file_name", "min count"):
        imgs = {"file_name null": None, "file_name number": 3, "file_name list": ["b.png"]}
        entries = [{"id": 0, "file_name": "a.png"},
                   {"id": 1, "file_name": "../secret.png" if case == "../ in file_name" else imgs.get(case, "b.png")}]
        anns = [{"image_id": 0, "caption": "a grey square"}, {"image_id": 1, "caption": 42 if "caption" in case
                                                                else "a grey square"}]
        path = coco_file(tmp_path, entries, [] if case == "no annotations" else anns)
        _png(tmp_path / "secret.png")
        want = {"file_name null": "'file_name' null", "file_name number": "'file_name' the number 3",
                "file_name list": "'file_name' a list", "caption number": "'caption' the number 42",
                "no annotations": "no image has a caption", "../ in file_name": "outside the image folder",
                "min count": "keeps no word"}[case]
        if case == "min count":
            return (_train_args(tmp_path, "coco", images, path, "--vocab-min-count", "1000000"),
                    ("--vocab-min-count", "at most 2"))
        return _train_args(tmp_path, "coco", images, path), (str(path), want)
    if case in ("sentences strings", "tokens string"):
        first = {"sentences": ["A grey square."]} if case == "sentences strings" else {
            "sentences": [{"tokens": "a grey square"}]}
        path = karpathy_file(tmp_path, first)
        return _train_args(tmp_path, "karpathy", tmp_path / "root", path), (str(path), "sentence 0")
    root = flickr_root(tmp_path, b"1000_a.jpg#0\tA gr\xe9y square .\n1001_b.jpg#0\tA grey box .\n")
    return _train_args(tmp_path, "flickr8k", root, None), (str(root / "Flickr8k.token.txt:1"), "not UTF-8")


@pytest.mark.parametrize("case", ["file_name null", "file_name number", "file_name list", "caption number",
                                  "no annotations", "../ in file_name", "min count", "sentences strings",
                                  "tokens string", "not utf-8"])
def test_train_on_a_bad_caption_input_is_one_line_and_no_run(tmp_path, capsys, case):
    args, fragments = _cli_case(tmp_path, case)
    err = one_line_error(capsys, main(args), *fragments)
    assert "Traceback" not in err and "could be read" not in err and "unhashable" not in err
    assert not (tmp_path / "run").exists()


def test_the_vitscope_command_exits_2_with_one_line(tmp_path):
    """The command in its own process, as a user runs it: exit code 2 and a single stderr line."""
    args, fragments = _cli_case(tmp_path, "../ in file_name")
    r = subprocess.run([sys.executable, "-m", "vitscope", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vitscope train: error: "), r.stderr
    assert all(f in lines[0] for f in fragments), lines[0]
    assert not (tmp_path / "run").exists()


def test_train_says_once_when_most_words_become_unknown(tmp_path):
    rng = np.random.default_rng(0)
    for f in ("a.png", "b.png"):  # not one colour: a constant image has no spread to normalise by
        (tmp_path / "images").mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "images" / f)
    path = tmp_path / "captions.json"
    path.write_text(json.dumps({"images": [{"id": 0, "file_name": "a.png"}, {"id": 1, "file_name": "b.png"}],
                                "annotations": [{"image_id": 0, "caption": "a grey square"},
                                                {"image_id": 1, "caption": "a grey box"},
                                                {"image_id": 1, "caption": "one red circle"}]}))
    tiny = ["--set", "depth=1", "--set", "embed_dim=32", "--set", "num_heads=2", "--decoder-set", "dim=32",
            "--decoder-set", "depth=1", "--decoder-set", "num_heads=2", "--epochs", "1", "--explain-images", "0",
            "--threads", "1", "--amp", "fp32", "--vocab-min-count", "2"]
    with pytest.warns(UserWarning) as record:
        assert main(_train_args(tmp_path, "coco", tmp_path / "images", path, *tiny)) == 0
    # as the CLI prints it (main installed its formatter): one line of vitscope's, not Python's file:line form
    said = [warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in record
            if "<unk>" in str(w.message)]
    assert len(said) == 1 and said[0].count("\n") == 1, said
    assert said[0].startswith("vitscope train: warning: 56% of the training captions' words become <unk>"), said
    assert "--vocab-min-count) 2 (it keeps 2 of 7 distinct words)" in said[0]
