"""Captioning's pieces the training loop and CLI use: data by name, model by config, the vocabulary with the
checkpoint; and the training task's batch -> loss -> a split's metrics, a few steps of which lower the loss."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_caption_models import one_thread  # noqa: F401 (autouse)
from test_caption_scenes import _source
from vitscope.caption import builders as captioning
from vitscope.caption.builders import (
    CaptionTaskConfig,
    build_captioner,
    captioner_from_dict,
    captioner_to_dict,
    check_vocab,
    load_caption_dataset,
    load_vocab,
    vocab_from_metadata,
    vocab_metadata,
)
from vitscope.caption.dataset import CaptionDataset
from vitscope.caption.scenes import ScenesConfig, make_scenes
from vitscope.caption.transformer import EncoderSpec
from vitscope.data import DataError
from vitscope.data.transforms import TrainTransform
from vitscope.sequence.loss import trim_padding
from vitscope.sequence.vocab import PAD, Vocabulary
from vitscope.training.caption import CaptionTask
from vitscope.training.config import TrainConfig
from vitscope.training.distributed import DistInfo
from vitscope.training.options import CaptionOptions, ImageOptions

ENCODER = EncoderSpec("vit_tiny_patch7_28", dict(depth=1, embed_dim=32, num_heads=2))


def _scenes(n=24, split="train"):
    items, labels = _source(60)
    images, scenes, captions = make_scenes(items, labels, n, config=ScenesConfig(), split=split)
    return CaptionDataset(images, captions, "toy_scenes", (0.3,), (0.3,), scenes=scenes)


def _decoder(kind):
    return dict(dim=32, depth=1, num_heads=2, drop=0.0) if kind == "transformer" else dict(
        embed_dim=32, hidden_dim=32, attn_dim=16, drop=0.0)


def _config(kind):
    return CaptionTaskConfig(kind=kind, encoder=ENCODER, decoder=_decoder(kind), max_len=24)


def _training_task(kind, data, monkeypatch):
    """The loop's caption task on `data` (its first 6 scenes the test split), evaluating with beam 2."""
    monkeypatch.setattr(captioning, "load_caption_dataset",
                        lambda name, split, **kw: data if split == "train" else data.subset(range(6)))
    cfg = TrainConfig(task="caption", image=ImageOptions(model="vit_tiny_patch7_28", model_args=dict(ENCODER.overrides),
                                                         augment=TrainTransform(crop="none", flip=False)),
                      caption=CaptionOptions(captioner=kind, decoder_args=_decoder(kind), max_len=24,
                                             eval_beam=2),
                      dataset="fmnist_scenes", batch_size=16, eval_batch_size=4, amp="fp32")
    return CaptionTask.build(cfg, resume=False)


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_batch_to_loss_to_metrics(kind, monkeypatch):
    torch.manual_seed(0)
    data = _scenes()
    task = _training_task(kind, data, monkeypatch)
    model = task.model
    assert len(task.tokens) == int(task.counts.sum()) == 5 * len(data)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    batch = task.batch(torch.arange(16), torch.Generator().manual_seed(0))

    def xent():
        loss, stats = task.loss(task.train_module, batch, slice(None), torch.device("cpu"), False)
        return loss, stats.loss_sum / stats.count

    # the same batch: the cross-entropy must fall (the LSTM's regulariser has a floor of its own:
    # with fewer words than image tokens no attention can cover every token once)
    first = xent()[1]
    for _ in range(8):
        loss, last = xent()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert last < first * 0.8
    ev = task.evaluate(model, device=torch.device("cpu"), bf16=False, info=DistInfo())
    m = ev.detail["metrics"]
    assert set(m) >= {"bleu1", "bleu4", "cider", "item_accuracy", "exact_match", "grounding", "grounding_per_layer"}
    assert len(ev.detail["captions"]) == 6 and m["beam"] == 2 and model.training  # evaluate restores the mode
    assert len(m["grounding_per_layer"]) in (0, 1)  # one decoder layer; the LSTM's alignment counts as one
    assert ev.value == m["item_accuracy"] and task.metric.format(0.5) == "50.00%"  # scenes: named items


def test_checkpoint_round_trip_with_vocabulary(tmp_path):
    data = _scenes(8)
    task_vocab = data.build_vocab()
    model = build_captioner(_config("transformer"), len(task_vocab), img_size=56)
    save_file(model.state_dict(), tmp_path / "w.safetensors", metadata=vocab_metadata(task_vocab))
    from safetensors import safe_open

    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        vocab = vocab_from_metadata(f.metadata())
    assert vocab == task_vocab
    again = captioner_from_dict(captioner_to_dict(model))
    again.load_state_dict(load_file(tmp_path / "w.safetensors"))
    check_vocab(again, vocab)
    (tmp_path / "vocab.json").write_text(vocab.to_json(), encoding="utf-8")
    assert load_vocab(tmp_path / "vocab.json") == vocab
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
