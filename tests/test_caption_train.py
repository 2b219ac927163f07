"""Captioning through vitscope's one training loop: a tiny run end to end (metrics, checkpoints with the
vocabulary, the per-word figure, the explorer), bit-identical resume for both captioners, and the shared
pieces it needed (the decoder's cross-attention weights, Muon's output layers)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from test_caption_models import one_thread  # noqa: F401 (autouse)
from vitscope.caption import builders as caption_task
from vitscope.caption.builders import VOCAB_KEY, vocab_from_metadata
from vitscope.caption.dataset import CaptionDataset
from vitscope.caption.scenes import ITEM, ScenesConfig, make_scenes
from vitscope.data.transforms import TrainTransform
from vitscope.decoder import TransformerDecoder
from vitscope.inspect.probes import read_probes
from vitscope.training.loop import TrainConfig, train
from vitscope.training.optim import muon_param_names
from vitscope.training.options import CaptionOptions, ImageOptions


def toy_scenes(split: str, n: int) -> CaptionDataset:
    """2 x 2 scenes of flat items whose brightness is their class: a tiny encoder can tell them apart."""
    labels = torch.arange(60) % 10
    items = ((labels + 1) * 23).to(torch.uint8).view(-1, 1, 1, 1).expand(-1, 1, ITEM, ITEM).contiguous()
    images, scenes, captions = make_scenes(items, labels, n, config=ScenesConfig(), split=split)
    return CaptionDataset(images, captions, "fmnist_scenes2", (0.3,), (0.3,),
                          names=[f"{split}-{i}" for i in range(n)], scenes=scenes)


@pytest.fixture
def toy(monkeypatch):
    """`fmnist_scenes` as 96 training and 12 test scenes (the loop and the CLI read it by name)."""
    real = caption_task.load_caption_dataset

    def load(name, split, **kw):
        if name != "fmnist_scenes":
            return real(name, split, **kw)
        if split not in ("train", "test"):
            return real(name, split, **kw)  # its own error
        return toy_scenes(split, 96 if split == "train" else 12)

    monkeypatch.setattr(caption_task, "load_caption_dataset", load)


def tiny_caption_config(**kw) -> TrainConfig:
    """A tiny captioning run; `kw` may hold TrainConfig's fields, the image options' and the caption options'
    (captioner=...)."""
    base = dict(task="caption", captioner="transformer", model="vit_tiny_patch7_28",
                model_args=dict(depth=1, embed_dim=32, num_heads=2, mlp_ratio=2.0),
                decoder_args=dict(dim=32, depth=1, num_heads=2, mlp_ratio=2.0, drop=0.0), dataset="fmnist_scenes",
                epochs=6, batch_size=8, eval_batch_size=16, lr=3e-3, warmup_epochs=0.3, amp="fp32", max_len=40,
                explain_images=2, threads=1, augment=TrainTransform(crop="none", flip=False))
    if kw.get("captioner") == "lstm":
        base["decoder_args"] = dict(embed_dim=32, hidden_dim=32, attn_dim=16, drop=0.0)
    base.update(kw)
    options = {k: base.pop(k) for k in list(base) if k in CaptionOptions.__dataclass_fields__}
    image = {k: base.pop(k) for k in list(base) if k in ImageOptions.__dataclass_fields__}
    return TrainConfig(**base, image=ImageOptions(**image), caption=CaptionOptions(**options))


def test_a_caption_run_trains_end_to_end_through_the_loop(toy, tmp_path):
    res = train(tiny_caption_config(), tmp_path, progress=False)
    for name in ("config.json", "metrics.jsonl", "best.safetensors", "last.safetensors", "curves.png",
                 "summary.json", "caption_attention.png", "captions.html"):
        assert (tmp_path / name).is_file(), name
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[-1]["step"] == 72
    assert rows[-1]["train_loss"] < 0.6 * rows[0]["train_loss"]  # it learns
    assert rows[-1]["test_loss"] < rows[0]["test_loss"]
    assert max(r["test_item_accuracy"] for r in rows) > 0  # and names some items in their cells
    probes = read_probes(tmp_path)  # two test scenes' cross-attention, teacher-forced, before and at every epoch
    assert probes.kind == "caption" and probes.steps == [0, 12, 24, 36, 48, 60, 72] and len(probes.inputs) == 2
    att = probes.attention(72)  # (K, T, L, H, N): N = the class token and the 8 x 8 patches of a 56 x 56 scene
    assert att.shape[0] == 2 and att.shape[2:4] == (1, 2) and att.shape[-1] == 1 + 8 * 8
    torch.testing.assert_close(att.sum(-1), torch.ones(att.shape[:-1]), atol=2e-3, rtol=0)
    assert (tmp_path / "probes.png").is_file()
    assert {"test_bleu4", "test_cider", "test_item_accuracy", "test_exact_match", "test_grounding"} <= set(rows[-1])
    assert res.value == rows[-1]["test_item_accuracy"]  # the metric best.safetensors follows
    with safe_open(str(tmp_path / "last.safetensors"), "pt") as f:
        meta = f.metadata()
    vocab = vocab_from_metadata(meta)  # the vocabulary travels with the weights
    assert "sneaker" in vocab.index and meta[VOCAB_KEY]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["task"] == "caption" and summary["vocabulary"] == len(vocab)
    assert summary["test"]["item_accuracy"] == res.value


@pytest.mark.parametrize("captioner,optimizer", [("transformer", "adamw"), ("transformer", "muon"), ("lstm", "adamw")])
def test_a_caption_run_resumed_mid_epoch_is_bit_identical(toy, tmp_path, captioner, optimizer):
    cfg = tiny_caption_config(captioner=captioner, optimizer=optimizer, epochs=2, batch_size=32, explain_images=0)
    train(cfg, tmp_path / "whole", progress=False)
    train(cfg, tmp_path / "cut", progress=False, max_steps=4)  # stops inside the second epoch (3 steps each)
    train(cfg, tmp_path / "cut", progress=False, resume=True)
    a = load_file(str(tmp_path / "whole" / "last.safetensors"))
    b = load_file(str(tmp_path / "cut" / "last.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

    def rows(d):
        return [{k: v for k, v in json.loads(line).items() if k not in ("train_time_s", "train_cpu_s", "images_per_s")}
                for line in (d / "metrics.jsonl").read_text().splitlines()]

    assert rows(tmp_path / "whole") == rows(tmp_path / "cut")


def test_the_decoder_returns_the_cross_attention_its_blocks_compute():
    torch.manual_seed(0)
    dec = TransformerDecoder(11, 16, 2, 2, 8, context_dim=12).eval()
    tokens, context = torch.randint(0, 11, (3, 5)), torch.randn(3, 7, 12)
    logits, weights = dec(tokens, context, return_weights=True)
    torch.testing.assert_close(logits, dec(tokens, context))  # the explicit softmax path against the fused one
    assert weights.shape == (3, 5, 2, 2, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 5, 2, 2))
    x = dec.pos_embed(dec.token_embed(tokens))
    for i, block in enumerate(dec.blocks):  # each block's own cross-attention, block by block
        x, _, w = block(x, context, return_weights=True)
        torch.testing.assert_close(weights[:, :, i], w.transpose(1, 2))


def test_muon_leaves_the_captioners_output_layer_to_adamw(toy):
    from vitscope.caption.builders import CaptionTaskConfig, build_captioner
    from vitscope.caption.transformer import EncoderSpec

    data = toy_scenes("train", 8)
    config = CaptionTaskConfig(encoder=EncoderSpec("vit_tiny_patch7_28", dict(depth=1, embed_dim=32, num_heads=2)),
                               decoder=dict(dim=32, depth=1, num_heads=2))
    names = set(muon_param_names(build_captioner(config, len(data.build_vocab()), img_size=56, in_chans=1)))
    assert "decoder.head.weight" not in names  # reads out words as a classifier's head reads out classes
    assert "decoder.token_embed.weight" not in names and "decoder.pos_embed.weight" not in names
    assert "decoder.blocks.0.cross_attn.proj.weight" in names and "encoder.blocks.0.attn.qkv.weight" in names


def test_the_lstm_attends_as_additive_attention_with_its_keys_projected_once():
    from vitscope.caption.show_attend_tell import ShowAttendTell, ShowAttendTellConfig
    from vitscope.caption.transformer import EncoderSpec

    torch.manual_seed(0)
    model = ShowAttendTell(ShowAttendTellConfig(9, EncoderSpec("vit_tiny_patch7_28", dict(depth=1, embed_dim=32,
                                                                                          num_heads=2)),
                                                embed_dim=16, hidden_dim=24, attn_dim=8))
    h, memory = torch.randn(3, 24), torch.randn(3, 5, 32)
    keep = torch.tensor([[True] * 5, [True, True, False, False, True], [False] * 5])  # the last: no token at all
    want = model.attention(h, memory, mask=keep)
    got = model._attend(h, memory, model.attention.key_proj(memory), keep)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)
    assert torch.equal(got[1][2], torch.zeros(5))


def test_a_run_without_scenes_is_judged_and_shown_by_cider(monkeypatch, tmp_path, capsys):
    """Captions with no scene behind them have no item accuracy: the run follows CIDEr-D, a number (not a
    percentage), in its lines, its rows, its summary and its curves."""
    from vitscope.training import curves

    def load(name, split, **kw):
        d = toy_scenes(split, 96 if split == "train" else 12)
        return CaptionDataset(d.images, d.captions, "toy_captions", d.mean, d.std, names=d.names)

    monkeypatch.setattr(caption_task, "load_caption_dataset", load)
    figures = []
    save = curves.Figure.save

    def keep(fig, path, **kw):  # keep curves.png's figure to read its axes
        if str(path).endswith("curves.png"):
            figures.append(fig)
        return save(fig, path, **kw)

    monkeypatch.setattr(curves.Figure, "save", keep)
    res = train(tiny_caption_config(epochs=2, explain_images=0), tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert res.metric.name == "CIDEr-D" and res.value == rows[-1]["test_cider"] and "test_acc" not in rows[-1]
    assert res.describe() == f"CIDEr-D {res.value:.3f} (best {max(r['test_cider'] for r in rows):.3f})"
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    assert [line.split("  ")[2] for line in lines] == [f"test CIDEr-D {r['test_cider']:.3f}" for r in rows]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["metric"] == "CIDEr-D" and summary["test_cider"] == summary["test"]["cider"] == res.value
    (fig,) = figures
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "CIDEr-D", "test CIDEr-D"]


def test_overwrite_removes_the_previous_runs_caption_pictures(toy, tmp_path):
    train(tiny_caption_config(epochs=1), tmp_path, progress=False)
    assert (tmp_path / "caption_attention.png").is_file() and (tmp_path / "captions.html").is_file()
    (tmp_path / "notes.txt").write_text("the user's own")
    train(tiny_caption_config(epochs=1), tmp_path, overwrite=True, progress=False, max_steps=1)  # no report yet
    assert not (tmp_path / "caption_attention.png").exists() and not (tmp_path / "captions.html").exists()
    assert (tmp_path / "notes.txt").read_text() == "the user's own"
