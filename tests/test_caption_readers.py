"""Caption readers on small files the tests make, the vocabulary, and every bad input's one-line error."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from vitscope.caption.readers import load_coco, load_flickr8k, load_karpathy, read_karpathy
from vitscope.data import DataError
from vitscope.sequence.vocab import BOS, EOS, PAD, UNK, Vocabulary, detokenize, tokenize


def _image(path, color, size=(20, 12), mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path)
    return path


def _one_line(err):
    msg = str(err.value)
    assert "\n" not in msg
    return msg


# -- COCO --------------------------------------------------------------------------------------------
def _coco(tmp_path, annotations=None, extra_images=()):
    _image(tmp_path / "imgs/a.jpg", (255, 0, 0))
    _image(tmp_path / "imgs/b.png", (0, 0, 255, 0), mode="RGBA")  # transparent: white, as a viewer shows it
    images = [{"id": 7, "file_name": "a.jpg"}, {"id": 9, "file_name": "b.png"}, *extra_images]
    anns = annotations or [{"image_id": 9, "caption": "A blank, white card."},
                           {"image_id": 7, "caption": "a red square"}, {"image_id": 7, "caption": "Red."}]
    f = tmp_path / "captions_val2014.json"
    f.write_text(json.dumps({"images": images, "annotations": anns}))
    return f


def test_coco_reader(tmp_path):
    ds = load_coco(_coco(tmp_path), tmp_path / "imgs", image_size=8)
    assert ds.names == ["a.jpg", "b.png"]
    assert ds.captions == [["a red square", "Red."], ["A blank, white card."]]
    assert ds.images.dtype == torch.uint8 and ds.images.shape == (2, 3, 8, 8)
    assert ds.images[0, 0].float().mean() > 200 and ds.images[0, 2].float().mean() < 30  # red
    assert int(ds.images[1].min()) == 255  # transparency over white
    assert ds.tokenized()[1] == [["a", "blank", ",", "white", "card", "."]]


def test_coco_bad_inputs(tmp_path):
    missing = _coco(tmp_path, extra_images=[{"id": 11, "file_name": "gone.jpg"}],
                    annotations=[{"image_id": 11, "caption": "x"}, {"image_id": 7, "caption": "y"}])
    with pytest.raises(DataError) as e:
        load_coco(missing, tmp_path / "imgs")
    assert "missing" in _one_line(e) and "gone.jpg" in str(e.value) and str(missing) in str(e.value)
    empty = _coco(tmp_path, annotations=[{"image_id": 7, "caption": "  "}])
    with pytest.raises(DataError) as e:
        load_coco(empty, tmp_path / "imgs")
    assert "empty caption" in _one_line(e) and "'annotations' entry 0" in str(e.value)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError) as e:
        load_coco(bad, tmp_path)
    assert "not valid JSON" in _one_line(e)


def test_corrupt_images_are_skipped_or_refused(tmp_path):
    f = _coco(tmp_path)
    (tmp_path / "imgs/a.jpg").write_bytes(b"not a jpeg")
    with pytest.warns(UserWarning, match="skipped 1 unreadable"):
        ds = load_coco(f, tmp_path / "imgs", image_size=8)
    assert ds.names == ["b.png"] and ds.captions == [["A blank, white card."]]
    with pytest.raises(DataError) as e:
        load_coco(f, tmp_path / "imgs", image_size=8, on_error="raise")
    assert "a.jpg" in _one_line(e)


# -- Karpathy ----------------------------------------------------------------------------------------
def _karpathy(tmp_path, sentences=None):
    images = []
    for i, split in enumerate(["train", "restval", "val", "test", "test"]):
        _image(tmp_path / "coco" / "val2014" / f"{i}.jpg", (i * 40, 100, 0))
        images.append({"filename": f"{i}.jpg", "filepath": "val2014", "split": split,
                       "sentences": [{"tokens": ["image", str(i)], "raw": f"Image {i}."},
                                     {"tokens": ["picture", "number", str(i)]}]})
    if sentences is not None:
        images[0]["sentences"] = sentences
    f = tmp_path / "dataset_coco.json"
    f.write_text(json.dumps({"images": images, "dataset": "coco"}))
    return f


def test_karpathy_reader_puts_restval_in_train(tmp_path):
    f = _karpathy(tmp_path)
    train = load_karpathy(f, tmp_path / "coco", "train", image_size=8)
    assert train.names == ["0.jpg", "1.jpg"]
    assert train.captions[1] == ["Image 1.", "picture number 1"]  # raw when there, else the tokens
    assert len(load_karpathy(f, tmp_path / "coco", "test", image_size=8)) == 2
    assert read_karpathy(f, "val")[0] == ["val2014/2.jpg"]


def test_karpathy_bad_inputs(tmp_path):
    f = _karpathy(tmp_path)
    with pytest.raises(DataError) as e:
        load_karpathy(f, tmp_path / "coco", "restval")
    assert "unknown split 'restval'" in _one_line(e)
    with pytest.raises(DataError) as e:
        load_karpathy(f, tmp_path / "elsewhere", "train")
    assert "missing from" in _one_line(e)
    f = _karpathy(tmp_path, sentences=[{"tokens": [], "raw": ""}])
    with pytest.raises(DataError) as e:
        load_karpathy(f, tmp_path / "coco", "train")
    assert "empty caption" in _one_line(e)


# -- Flickr8k ----------------------------------------------------------------------------------------
def _flickr(tmp_path, lines=None):
    for name in ("1000_a.jpg", "1001_b.jpg", "1002_c.jpg"):
        _image(tmp_path / "Flicker8k_Dataset" / name, (10, 200, 10))
    tokens = tmp_path / "Flickr8k.token.txt"
    tokens.write_text("\n".join(lines or [
        "1000_a.jpg#0\tA dog runs .", "1000_a.jpg#1\tA brown dog running on grass .",
        "1001_b.jpg#0\tTwo children play .", "1002_c.jpg#0\tA boat ."]) + "\n")
    (tmp_path / "Flickr_8k.trainImages.txt").write_text("1000_a.jpg\n1002_c.jpg\n")
    (tmp_path / "Flickr_8k.devImages.txt").write_text("1001_b.jpg\n")
    (tmp_path / "Flickr_8k.testImages.txt").write_text("1001_b.jpg\n")
    return tokens


def test_flickr8k_reader(tmp_path):
    f = _flickr(tmp_path)
    train = load_flickr8k(f, tmp_path / "Flicker8k_Dataset", "train", image_size=8)
    assert train.names == ["1000_a.jpg", "1002_c.jpg"]
    assert train.captions[0] == ["A dog runs .", "A brown dog running on grass ."]
    val = load_flickr8k(f, tmp_path / "Flicker8k_Dataset", "val", image_size=8)
    assert val.captions == [["Two children play ."]]
    assert len(load_flickr8k(f, tmp_path / "Flicker8k_Dataset", image_size=8)) == 3


def test_flickr8k_bad_inputs(tmp_path):
    f = _flickr(tmp_path)
    with pytest.raises(DataError) as e:
        load_flickr8k(f, tmp_path / "Flicker8k_Dataset", "everything")
    assert "unknown split" in _one_line(e)
    f = _flickr(tmp_path, lines=["1000_a.jpg#0\t   "])
    with pytest.raises(DataError) as e:
        load_flickr8k(f, tmp_path / "Flicker8k_Dataset")
    assert "empty caption" in _one_line(e) and "line 1" in str(e.value)
    f = _flickr(tmp_path, lines=["1000_a.jpg A dog"])
    with pytest.raises(DataError) as e:
        load_flickr8k(f, tmp_path / "Flicker8k_Dataset")
    assert "expected 'name.jpg#k<TAB>caption'" in _one_line(e)
    f = _flickr(tmp_path, lines=["9999_z.jpg#0\tA ghost ."])
    with pytest.raises(DataError) as e:
        load_flickr8k(f, tmp_path / "Flicker8k_Dataset")
    assert "missing from" in _one_line(e) and "9999_z.jpg" in str(e.value)


# -- vocabulary --------------------------------------------------------------------------------------
def test_vocabulary_from_training_captions_only(tmp_path):
    train = load_flickr8k(_flickr(tmp_path), tmp_path / "Flicker8k_Dataset", "train", image_size=8)
    vocab = train.build_vocab(min_count=2)
    assert vocab.words[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"] and (PAD, BOS, EOS, UNK) == (0, 1, 2, 3)
    assert set(vocab.words[4:]) == {"a", "dog", "."}  # seen twice in train; 'children' (val) never
    assert vocab.encode("A dog plays!") == [BOS, vocab.index["a"], vocab.index["dog"], UNK, UNK, EOS]
    back = Vocabulary.from_json(json.dumps(vocab.to_dict()))
    assert back == vocab and back.fingerprint == vocab.fingerprint
    idx, tokens = train.pairs(vocab, max_len=5)
    assert idx.tolist() == [0, 0, 1] and tokens.shape == (3, 5)
    assert tokens[0].tolist() == [BOS, vocab.index["a"], vocab.index["dog"], UNK, vocab.index["."]][:4] + [EOS]
    assert tokens[2].tolist() == [BOS, vocab.index["a"], UNK, vocab.index["."], EOS]  # fits exactly: no pad


def test_vocabulary_errors_and_round_trips():
    assert tokenize("A T-shirt, top-left. Man's hat!") == ["a", "t-shirt", ",", "top-left", ".", "man's", "hat", "!"]
    assert detokenize(tokenize("two items: a bag (top left), a coat.")) == "two items: a bag (top left), a coat."
    vocab = Vocabulary.build(["a bag", "a coat"])
    ids = torch.tensor([BOS, vocab.index["a"], vocab.index["bag"], EOS, vocab.index["coat"], PAD])
    assert vocab.decode(ids) == "a bag"
    d = vocab.to_dict()
    d["words"] = d["words"][:-1]
    with pytest.raises(ValueError, match="sha256"):
        Vocabulary.from_dict(d)
    with pytest.raises(ValueError, match="starts with"):
        Vocabulary(["a", "b"])
    with pytest.raises(ValueError, match="not a vitscope caption vocabulary"):
        Vocabulary.from_dict({"words": ["<pad>"]})
    assert np.array_equal(vocab.encode_batch(["a bag", "a"]).numpy(),
                          [[BOS, vocab.index["a"], vocab.index["bag"], EOS], [BOS, vocab.index["a"], EOS, PAD]])
