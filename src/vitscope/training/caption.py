"""Captioning: a captioner (`cfg.caption.captioner`: transformer or lstm) with a `cfg.image.model` ViT encoder, on a
caption dataset (vitscope.caption). Its loss is the captioner's own (teacher-forced cross-entropy, and the LSTM's
attention regulariser); its metric is the item accuracy on Fashion-MNIST scenes, CIDEr-D elsewhere.

An epoch reads every training image once, with one of its reference captions drawn from the loop's generator,
so a resumed run draws the same ones. Under DDP each rank's loss is the mean over its own target tokens and DDP
averages the ranks' gradients, so N processes match one process to within the ranks' differing token counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor, nn

from vitscope.caption import builders as captioning
from vitscope.caption.builders import captioner_to_dict, vocab_metadata
from vitscope.caption.evaluate import evaluate_captions
from vitscope.caption.run import CAPTIONER_KEY, write_caption_report
from vitscope.caption.transformer import EncoderSpec
from vitscope.data import normalize
from vitscope.sequence.evaluation import evaluating
from vitscope.sequence.loss import trim_padding
from vitscope.sequence.vocab import detokenize
from vitscope.training.config import TrainConfig
from vitscope.training.curves import plot_curves, read_metrics
from vitscope.training.probes import PROBES
from vitscope.training.task import (
    Evaluation,
    Losses,
    Metric,
    StepStats,
    TrainResult,
    check_batch,
    check_channels,
    run_facts,
    start_weights,
    write_summary,
)

ITEM_ACCURACY = Metric("item accuracy", "test_item_accuracy")  # Fashion-MNIST scenes: items named in their cells
CIDER = Metric("CIDEr-D", "test_cider", percent=False)  # any other caption dataset
ROW_METRICS = ("bleu1", "bleu4", "cider", "item_accuracy", "exact_match", "grounding", "grounding_per_layer")


@dataclass
class CaptionTask:
    cfg: TrainConfig
    train_set: object  # CaptionDataset
    eval_set: object
    transform: object  # TrainTransform (crops and policies; never a flip or mix: they would move the words' places)
    vocab: object  # Vocabulary, from the training split's captions
    model: nn.Module
    first_row: Tensor = field(repr=False)  # (N,) each image's first row in `tokens`
    counts: Tensor = field(repr=False)  # (N,) its reference captions
    tokens: Tensor = field(repr=False)  # (P, T) every reference, <bos> ... <eos> <pad>
    kind = "caption"
    unit = "images"
    final_reevaluates = False

    @classmethod
    def build(cls, cfg: TrainConfig, *, resume: bool) -> CaptionTask:
        check_channels(cfg, captioning.CAPTION_CHANNELS)
        channels = cfg.image.model_args.get("in_chans", 3)
        kw = dict(root=cfg.image.data_dir, image_size=cfg.image.image_size or 224, channels=channels,
                  captions_file=cfg.caption.captions_file)
        train_set = captioning.load_caption_dataset(cfg.dataset, "train", **kw)
        eval_set = captioning.load_caption_dataset(cfg.dataset, cfg.eval_split, **kw)
        check_batch(cfg, len(train_set), "images")
        vocab = train_set.build_vocab(min_count=cfg.caption.vocab_min_count)
        c, h, w = train_set.image_shape
        decoder = {**cfg.caption.decoder_args, "label_smoothing": cfg.label_smoothing}
        config = captioning.CaptionTaskConfig(
            kind=cfg.caption.captioner, decoder=decoder, max_len=cfg.caption.max_len,
            encoder=EncoderSpec(cfg.image.model, dict(cfg.image.model_args), start_weights(cfg, resume)))
        torch.manual_seed(cfg.seed)
        model = captioning.build_captioner(config, len(vocab), in_chans=c, img_size=(h, w) if h != w else h)
        model.config.encoder.pretrained = False  # a checkpoint rebuilds it from its own weights
        index, tokens = train_set.pairs(vocab, max_len=cfg.caption.max_len)  # every reference caption once
        counts = torch.bincount(index, minlength=len(train_set))
        first_row = torch.cumsum(counts, 0) - counts
        return cls(cfg, train_set, eval_set, cfg.image.augment.for_dataset(train_set), vocab, model, first_row, counts,
                   tokens)

    @property
    def label(self) -> str:
        return f"{self.cfg.caption.captioner} captioner"

    @property
    def train_module(self) -> nn.Module:
        return Losses(self.model)

    @property
    def train_size(self) -> int:
        return len(self.train_set)

    @property
    def metric(self) -> Metric:
        return ITEM_ACCURACY if self.train_set.scenes is not None else CIDER

    def batch(self, idx: Tensor, gen: torch.Generator) -> tuple:
        x = self.transform(self.train_set.images[idx], gen)  # (B, C, H, W) float, whole global batch
        pick = (torch.rand(len(idx), generator=gen) * self.counts[idx]).long()  # one reference per image
        return x, self.tokens[self.first_row[idx] + pick]  # (B, T)

    def loss(self, net, batch, rows, device, bf16):
        x, tokens = batch[0][rows].to(device), trim_padding(batch[1][rows]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            terms = net(x, tokens)
        loss, targets = terms["loss"], int(terms["targets"])
        return loss, StepStats(float(terms["xent"].item()) * targets, int(terms["correct"]), targets, len(x))

    def evaluate(self, model, *, device, bf16, info, final=False) -> Evaluation:
        """Every rank decodes the whole split (the figures need every caption; the split is small)."""
        result = evaluate_captions(model, self.eval_set, self.vocab, mean=self.transform.mean,
                                   std=self.transform.std, beam=self.cfg.caption.eval_beam,
                                   batch_size=min(self.cfg.eval_batch_size, 256), device=device, bf16=bf16)
        m = result.metrics
        value = m["item_accuracy"] if self.metric is ITEM_ACCURACY else m["cider"]
        return Evaluation(m["loss"], value, row={f"test_{k}": m[k] for k in ROW_METRICS if k in m},
                          detail={"metrics": m, "captions": result.captions})

    # -- probes: attention over training (vitscope.inspect.probes) ---------------------------------------------
    @cached_property
    def probe_rows(self) -> list[int]:
        """The probed test images: on scenes the busiest of the first 50 (more words looking at more places)."""
        n = min(len(self.eval_set), 50)
        if self.eval_set.scenes is None:
            return list(range(min(n, PROBES // 2)))
        return sorted(range(n), key=lambda i: (-len(self.eval_set.scenes[i].items), i))[: PROBES // 2]

    @cached_property
    def probe_tokens(self) -> Tensor:
        """Each probed image's first reference caption, (K, T) `<bos>` ... `<eos>` `<pad>`."""
        return self.vocab.encode_batch([self.eval_set.captions[i][0] for i in self.probe_rows],
                                       max_len=self.model.max_len)

    def probe_header(self) -> tuple[dict, Tensor]:
        rows = self.probe_rows
        words = [self.vocab.decode_words(t) for t in self.probe_tokens]
        header = {"kind": "caption", "inputs": [{"words": w} for w in words], "grid": list(self.model.grid),
                  "num_prefix_tokens": self.model.num_prefix_tokens}
        return header, self.eval_set.images[rows]

    def probe(self, model, *, device, bf16) -> dict[str, Tensor]:
        """Teacher-forced on each probed image's reference: the transformer's cross-attention (K, T, L, H, N) or
        the LSTM's alignment (K, T, N), row t for the step that predicts word t + 1."""
        x = normalize(self.eval_set.images[self.probe_rows].to(device), self.transform.mean, self.transform.std)
        tokens = self.probe_tokens.to(device)
        with evaluating(model), torch.no_grad():
            memory = model.encode(x)
            if model.kind == "transformer":
                _, attention = model.decoder(tokens[:, :-1], memory, return_weights=True)
            else:
                _, attention = model.teacher_forced(memory, tokens)
        return {"attention": attention.float()}

    def metadata(self) -> dict[str, str]:
        return {CAPTIONER_KEY: json.dumps(captioner_to_dict(self.model)), **vocab_metadata(self.vocab),
                "mean": json.dumps(list(self.transform.mean)), "std": json.dumps(list(self.transform.std)),
                "dataset": self.cfg.dataset}

    def report(self, run_dir: Path, model: nn.Module, result: TrainResult, final: Evaluation) -> None:
        """curves.png, summary.json, caption_attention.png (the per-word figure) and captions.html."""
        cfg, metric = self.cfg, self.metric
        plot_curves(read_metrics(run_dir / "metrics.jsonl"), run_dir / "curves.png", metric,
                    title=f"{cfg.caption.captioner} captioner ({cfg.image.model} encoder) on {cfg.dataset}")
        write_summary(run_dir, {
            "task": "caption", "captioner": cfg.caption.captioner, "model": cfg.image.model, "dataset": cfg.dataset,
            "metric": metric.name, metric.key: result.value, f"best_{metric.key}": result.best,
            "test": dict(final.detail["metrics"]), "examples": [detokenize(w) for w in final.detail["captions"][:8]],
            "vocabulary": len(self.vocab), **run_facts(cfg, model, result),
        })
        write_caption_report(run_dir, model.eval(), self.vocab, self.eval_set,
                             mean=self.transform.mean, std=self.transform.std, beam=max(cfg.caption.eval_beam, 3),
                             images=cfg.explain_images, title=f"{cfg.caption.captioner} captioner on {cfg.dataset}")
