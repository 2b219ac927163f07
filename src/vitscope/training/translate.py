"""Translation: a translator (`cfg.translate.translator`: rnn, with or without attention, or transformer) on the
synthetic language pair (vitscope.translate), drawn from `cfg.seed`. Its loss is the teacher-forced cross-entropy; its
metric the exact sentence accuracy of greedy (or `cfg.translate.eval_beam`) translations of the test sentences.

An epoch reads every training sentence once in the loop's order. Under DDP each rank's loss is the mean over its
own target words and DDP averages the ranks' gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor, nn

from vitscope.errors import ConfigError
from vitscope.sequence.evaluation import evaluating
from vitscope.sequence.loss import trim_padding
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
    run_facts,
    write_summary,
)
from vitscope.translate.builders import ParallelData, build_translator, describe
from vitscope.translate.evaluate import evaluate_translations, teacher_forced
from vitscope.translate.language import make_pair
from vitscope.translate.run import pick_sentence, translation_metadata, write_translation_report

EXACT_MATCH = Metric("exact match", "test_exact_match")
ROW_METRICS = ("token_accuracy", "bleu4", "alignment", "alignment_best_head")
SPLITS = ("train", "test")  # what make_pair draws


@dataclass
class TranslateTask:
    cfg: TrainConfig
    data: object  # vitscope.translate.builders.ParallelData
    model: nn.Module
    kind = "translate"
    unit = "sentences"
    metric = EXACT_MATCH
    final_reevaluates = False

    @classmethod
    def build(cls, cfg: TrainConfig, *, resume: bool) -> TranslateTask:
        opts = cfg.translate
        if cfg.eval_split not in SPLITS:
            raise ConfigError(f"--eval-split {cfg.eval_split}: the synthetic language pair's splits are "
                              f"{' and '.join(SPLITS)}")
        pair = make_pair(cfg.seed, train_size=opts.train_sentences, test_size=opts.test_sentences,
                         max_words=opts.max_words)
        data = ParallelData.build(pair)
        check_batch(cfg, len(data.train), "sentences")
        torch.manual_seed(cfg.seed)
        model = build_translator(opts.translator, data, dict(opts.decoder_args), label_smoothing=cfg.label_smoothing)
        return cls(cfg, data, model)

    @property
    def label(self) -> str:
        return describe(self.model)

    @property
    def eval_data(self):
        """The split each evaluation translates (`--eval-split`: the test sentences, or the training ones to see
        how well the model fits what it trains on)."""
        return getattr(self.data, self.cfg.eval_split)

    @property
    def train_module(self) -> nn.Module:
        return Losses(self.model)

    @property
    def train_size(self) -> int:
        return len(self.data.train)

    def batch(self, idx: Tensor, gen: torch.Generator) -> tuple:
        return self.data.train.src[idx], self.data.train.tgt[idx]

    def loss(self, net, batch, rows, device, bf16):
        src, tgt = trim_padding(batch[0][rows]), trim_padding(batch[1][rows])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            terms = net(src.to(device), tgt.to(device))
        targets = int(terms["targets"])
        return terms["loss"], StepStats(float(terms["xent"].item()) * targets, int(terms["correct"]), targets,
                                        len(src))

    def evaluate(self, model, *, device, bf16, info, final=False) -> Evaluation:
        """Every rank translates the whole evaluated split (it is small)."""
        result = evaluate_translations(model, self.eval_data, self.data.tgt_vocab, beam=self.cfg.translate.eval_beam,
                                       batch_size=min(self.cfg.eval_batch_size, 500), device=device, bf16=bf16)
        m = result.metrics
        row = {f"test_{k}": m[k] for k in ROW_METRICS if m.get(k) is not None}
        return Evaluation(m["loss"], m["exact_match"], row=row,
                          detail={"metrics": m, "translations": result.translations, "by_length": result.by_length})

    # -- probes: attention over training (vitscope.inspect.probes) ---------------------------------------------
    @cached_property
    def probe_rows(self) -> list[int]:
        """The probed test sentences: the report's (long, with reordering), then the first others."""
        first = pick_sentence(self.data)
        return [first, *[i for i in range(len(self.data.test)) if i != first][: PROBES - 1]]

    def probe_header(self) -> tuple[dict, None] | None:
        """None for the RNN without attention: it has none to watch."""
        if not self.model.has_attention:
            return None
        examples = [self.data.test.examples[i] for i in self.probe_rows]
        return {"kind": "translate", "inputs": [{"source": list(e.source), "target": list(e.target)}
                                                for e in examples]}, None

    def probe(self, model, *, device, bf16) -> dict[str, Tensor]:
        """Teacher-forced on each probed sentence's reference: the RNN's attention (K, T, N) or every decoder
        block's cross-attention (K, T, L, H, N), row t for the step that writes target word t."""
        rows = self.probe_rows
        src, tgt = trim_padding(self.data.test.src[rows]), trim_padding(self.data.test.tgt[rows])
        with evaluating(model), torch.no_grad():
            _, attention = teacher_forced(model, src.to(device), tgt.to(device))
        return {"attention": attention.float()}

    def metadata(self) -> dict[str, str]:
        return translation_metadata(self.model, self.data)

    def report(self, run_dir: Path, model: nn.Module, result: TrainResult, final: Evaluation) -> None:
        """curves.png, summary.json, alignment.png (the lecture's heatmap) and translations.html."""
        cfg, name = self.cfg, describe(model)
        plot_curves(read_metrics(run_dir / "metrics.jsonl"), run_dir / "curves.png", self.metric,
                    title=f"{name} on the synthetic language pair")
        examples = self.eval_data.examples
        write_summary(run_dir, {
            "task": "translate", "translator": cfg.translate.translator,
            "decoder_args": dict(cfg.translate.decoder_args),
            "description": name, "dataset": cfg.dataset, "metric": self.metric.name,
            self.metric.key: result.value, f"best_{self.metric.key}": result.best,
            "test": dict(final.detail["metrics"]),
            "exact_match_by_source_length": {str(n): v for n, v in final.detail["by_length"].items()},
            "examples": [{"source": " ".join(e.source), "reference": " ".join(e.target), "translation": " ".join(t)}
                         for e, t in zip(examples[:8], final.detail["translations"][:8])],
            "vocabulary": {"source": len(self.data.src_vocab), "target": len(self.data.tgt_vocab)},
            **run_facts(cfg, model, result),
        })
        write_translation_report(run_dir, model.eval(), self.data, sentences=max(cfg.explain_images, 1),
                                 title=f"{name} on the synthetic language pair")
