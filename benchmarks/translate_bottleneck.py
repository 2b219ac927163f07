"""The lecture's bottleneck: the RNN translator with additive attention against the same RNN without it (one
context vector for the whole sentence), trained for the same time, their exact sentence accuracy against the
source sentence's length in one PNG, with a markdown table and the machine beside it.

    .venv/bin/python benchmarks/translate_bottleneck.py                       # train both presets, then plot
    .venv/bin/python benchmarks/translate_bottleneck.py --runs RUN_ATT RUN_NOATT  # finished runs, plot only
    .venv/bin/python benchmarks/translate_bottleneck.py --minutes 3 --png benchmarks/translate_bottleneck.png

Training: the presets translate_rnn and translate_rnn_noattn, on one thread each, one after the other, each
stopped after --minutes of training (the loop's own clock, evaluations left out) or at its preset's end.
Evaluation: greedy decoding of the 1,000 test sentences (drawn with the runs' seed, none of them in training);
lengths with fewer than 5 test sentences are left out of the plot.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_header  # noqa: E402

HERE = Path(__file__).resolve().parent


def train_for(preset: str, minutes: float, out: Path) -> Path:
    """Train `preset` into `out` for at most `minutes` of training time (its steps at the measured rate)."""
    from vitscope.training.loop import train
    from vitscope.training.recipes import get_recipe

    cfg = get_recipe(preset)
    cfg.threads = 1
    probe = train(cfg, out / "probe", overwrite=True, progress=False, max_steps=30)  # the step rate, warm
    steps = int(30 * minutes * 60 / max(probe.train_time_s, 1e-9))
    print(f"{preset}: {probe.train_time_s / 30 * 1000:.0f} ms a step -> {steps} steps in {minutes:g} minutes",
          flush=True)
    steps_per_epoch = cfg.translate.train_sentences // cfg.batch_size
    cfg.epochs = max(1, -(-steps // steps_per_epoch))
    cfg.eval_every_steps = max(50, steps // 8)
    train(cfg, out / preset, overwrite=True, progress=False, max_steps=steps)
    return out / preset


def by_length(run: Path) -> tuple[str, dict, dict, float]:
    import json

    from vitscope.training.config import TrainConfig
    from vitscope.translate.builders import ParallelData
    from vitscope.translate.evaluate import evaluate_translations
    from vitscope.translate.language import make_pair
    from vitscope.translate.run import open_translator

    translator = open_translator(run)
    cfg = TrainConfig.from_dict(translator.train_config)  # a run's config.json from before its options nested too
    data = ParallelData.build(make_pair(cfg.seed, train_size=cfg.translate.train_sentences,
                                        test_size=cfg.translate.test_sentences, max_words=cfg.translate.max_words))
    result = evaluate_translations(translator.model, data.test, data.tgt_vocab)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return translator.description, result.by_length, result.metrics, rows[-1]["train_time_s"]


def band(lengths: dict, lo: int, hi: int) -> str:
    """Exact accuracy over the test sentences of lo to hi source words."""
    hits = sum(a * n for k, (a, n) in lengths.items() if lo <= k <= hi)
    count = sum(n for k, (_, n) in lengths.items() if lo <= k <= hi)
    return f"{100 * hits / max(count, 1):.1f}%"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", type=Path, help="finished translation runs to plot (default: train both)")
    p.add_argument("--minutes", type=float, default=3.0, help="training minutes for each model (default: 3)")
    p.add_argument("--work", type=Path, default=Path("runs/bottleneck"), help="where the runs are trained")
    p.add_argument("--png", type=Path, default=HERE / "translate_bottleneck.png")
    args = p.parse_args()
    torch.set_num_threads(1)
    runs = args.runs or [train_for(preset, args.minutes, args.work)
                         for preset in ("translate_rnn", "translate_rnn_noattn")]
    from vitscope.translate.plots import accuracy_by_length_figure

    curves, table = {}, []
    for run in runs:
        name, lengths, metrics, seconds = by_length(run)
        curves[f"{name} ({seconds / 60:.1f} min)"] = lengths
        table.append((name, seconds, metrics, lengths))
    accuracy_by_length_figure(curves, title="Exact sentence accuracy against source length (greedy, 1,000 test "
                                            "sentences)", path=args.png)
    print(machine_header())
    print(f"\n_{time.strftime('%Y-%m-%d')}; figure: {args.png}_\n")
    print("| model | training | exact | tokens | BLEU-4 | alignment | exact, 3-8 words | exact, 15-20 words |")
    print("|---|---|---|---|---|---|---|---|")
    for name, seconds, m, lengths in table:
        align = "n/a" if m["alignment"] is None else f"{100 * m['alignment']:.1f}%"
        print(f"| {name} | {seconds / 60:.1f} min | {100 * m['exact_match']:.1f}% | {100 * m['token_accuracy']:.1f}% "
              f"| {m['bleu4']:.3f} | {align} | {band(lengths, 3, 8)} | {band(lengths, 15, 20)} |")


if __name__ == "__main__":
    main()
