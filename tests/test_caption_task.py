"""The task interface the training loop and CLI use: data by name, model by config, the vocabulary
with the checkpoint, a batch -> loss, a split -> metrics; and a few steps of training that lower the loss."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_caption_models import one_thread  # noqa: F401 (autouse)
from test_caption_scenes import _source
from vitscope.caption.dataset import CaptionDataset
from vitscope.caption.scenes import ScenesConfig, make_scenes
from vitscope.caption.task import (
    CaptionTask,
    CaptionTaskConfig,
    captioner_from_dict,
    captioner_to_dict,
    check_vocab,
    load_caption_dataset,
    load_vocab,
    save_vocab,
    trim_padding,
    vocab_from_metadata,
    vocab_metadata,
)
from vitscope.caption.transformer import EncoderSpec
from vitscope.caption.vocab import PAD, Vocabulary
from vitscope.data import DataError

ENCODER = EncoderSpec("vit_tiny_patch7_28", dict(depth=1, embed_dim=32, num_heads=2))


def _scenes(n=24, split="train"):
    items, labels = _source(60)
    images, scenes, captions = make_scenes(items, labels, n, config=ScenesConfig(), split=split)
    return CaptionDataset(images, captions, "toy_scenes", (0.3,), (0.3,), scenes=scenes)


def _task(kind, data):
    decoder = dict(dim=32, depth=1, num_heads=2, drop=0.0) if kind == "transformer" else dict(
        embed_dim=32, hidden_dim=32, attn_dim=16, drop=0.0)
    return CaptionTask(CaptionTaskConfig(kind=kind, encoder=ENCODER, decoder=decoder, max_len=24), data.build_vocab())


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_batch_to_loss_to_metrics(kind):
    torch.manual_seed(0)
    data = _scenes()
    task = _task(kind, data)
    model = task.build_model(img_size=56)
    index, tokens = task.pairs(data)
    assert len(index) == 5 * len(data)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    rows = torch.arange(16)
    images, batch_tokens = task.batch(data, index, tokens, rows)
    x = (images.float() / 255 - 0.3) / 0.3
    # the same batch: the cross-entropy must fall (the LSTM's regulariser has a floor of its own:
    # with fewer words than image tokens no attention can cover every token once)
    first = task.losses(model, x, batch_tokens)["xent"].item()
    for _ in range(8):
        terms = task.losses(model, x, batch_tokens)
        opt.zero_grad()
        terms["loss"].backward()
        opt.step()
    assert terms["xent"].item() < first * 0.8
    result = task.evaluate(model, data.subset(range(6)), mean=(0.3,), std=(0.3,), beam=2, batch_size=4)
    m = result.metrics
    assert set(m) >= {"bleu1", "bleu4", "cider", "item_accuracy", "exact_match", "grounding", "grounding_per_layer"}
    assert len(result.captions) == 6 and m["beam"] == 2 and model.training  # evaluate restores the mode
    assert len(m["grounding_per_layer"]) in (0, 1)  # one decoder layer; the LSTM's alignment counts as one


def test_checkpoint_round_trip_with_vocabulary(tmp_path):
    data = _scenes(8)
    task = _task("transformer", data)
    model = task.build_model(img_size=56)
    save_file(model.state_dict(), tmp_path / "w.safetensors", metadata=vocab_metadata(task.vocab))
    from safetensors import safe_open

    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        vocab = vocab_from_metadata(f.metadata())
    assert vocab == task.vocab
    again = captioner_from_dict(captioner_to_dict(model))
    again.load_state_dict(load_file(tmp_path / "w.safetensors"))
    check_vocab(again, vocab)
    assert load_vocab(save_vocab(vocab, tmp_path / "vocab.json")) == vocab
    with pytest.raises(ValueError, match="use the vocabulary saved with this run"):
        check_vocab(again, Vocabulary.build(["just a few other words"]))
    with pytest.raises(ValueError, match="no caption vocabulary"):
        vocab_from_metadata({"format": "pt"})


def test_trim_padding_and_dataset_names(tmp_path):
    t = torch.tensor([[1, 4, 2, PAD, PAD], [1, 2, PAD, PAD, PAD]])
    assert trim_padding(t).tolist() == [[1, 4, 2], [1, 2, PAD]]
    with pytest.raises(DataError, match="Did you mean fmnist_scenes"):
        load_caption_dataset("fmnist_scene", "train")
    with pytest.raises(DataError, match="needs the folder"):
        load_caption_dataset("coco", "val")
    with pytest.raises(DataError, match="captions_val"):
        load_caption_dataset("coco", "val", root=tmp_path)
