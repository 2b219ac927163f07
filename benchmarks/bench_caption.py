"""Caption decoding speed: the KV cache against re-running the prefix, and batched beam search
against a Python loop over images. Prints markdown tables with the machine beside them.

    .venv/bin/python benchmarks/bench_caption.py                 # scenes-sized transformer captioner
    .venv/bin/python benchmarks/bench_caption.py --lengths 20 32 --batch 32 --beam 5 --repeats 5
    .venv/bin/python benchmarks/bench_caption.py --curves RUN_DIR... --png benchmarks/caption_curves.png

`--curves` instead reads finished caption runs (`vitscope train --task caption`) and draws their test
metric (item accuracy on Fashion-MNIST scenes) against training wall time, all runs in one PNG, with a
table of each run's epochs.

The captioner has random weights with <eos> made impossible, so every caption runs to its full
length (what the comparison needs: the cache's gain grows with length). Each row also checks that
both ways give identical captions. Times are medians over --repeats runs after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vitscope.caption.decoding import beam_search, decode  # noqa: E402
from vitscope.caption.transformer import EncoderSpec, TransformerCaptioner, TransformerCaptionerConfig  # noqa: E402
from vitscope.caption.vocab import EOS  # noqa: E402


def _header() -> str:
    try:
        from _machine import machine_header

        return machine_header()
    except Exception:  # the shared helper is optional here: fall back to the essentials
        import platform

        cpu = platform.processor() or platform.machine()
        return f"- {cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def _median_time(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up (and the result to compare)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def build(max_len: int, vocab: int, dim: int, depth: int) -> TransformerCaptioner:
    torch.manual_seed(0)
    enc = EncoderSpec("vit_tiny_patch7_28", dict(img_size=56, depth=3, embed_dim=128, num_heads=4))
    model = TransformerCaptioner(TransformerCaptionerConfig(vocab_size=vocab, encoder=enc, dim=dim, depth=depth,
                                                            num_heads=4, max_len=max_len, drop=0.0)).eval()
    with torch.no_grad():
        model.decoder.head.bias[EOS] = -1e9  # captions run to max_len
    return model


def curves(run_dirs: list[Path], png: Path | None) -> None:
    """Each caption run's evaluations against its training time: a markdown table, and one PNG of all."""
    import json

    runs = []
    for d in run_dirs:
        cfg = json.loads((d / "config.json").read_text())
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
        init = cfg.get("init_weights")
        start = f"encoder from {Path(init).parent.name}" if init else "from scratch"
        label = f"{cfg.get('captioner', '?')}, {start}, seed {cfg.get('seed')}"
        runs.append((label, rows))
    print(_header() + "\n")
    print("| run | epoch | train min | item accuracy % | exact match % | BLEU-4 | CIDEr-D | grounding % |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, rows in runs:
        for r in rows:
            print(f"| {label} | {r['epoch']:.2f} | {r['train_time_s'] / 60:.1f} | "
                  f"{100 * r['test_item_accuracy']:.2f} | "
                  f"{100 * r.get('test_exact_match', float('nan')):.2f} | {r.get('test_bleu4', float('nan')):.4f} | "
                  f"{r.get('test_cider', float('nan')):.3f} | {100 * r.get('test_grounding', float('nan')):.1f} |")
    if png is None:
        return
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    ax = fig.subplots()
    for label, rows in runs:
        ax.plot([0] + [r["train_time_s"] / 60 for r in rows],
                [0] + [100 * r["test_item_accuracy"] for r in rows], "o-",
                label=label)
    ax.set(xlabel="training wall time (min)", ylabel="test item accuracy (%), greedy",
           title="Fashion-MNIST scenes: transformer vs LSTM-with-attention captioner")
    cpu = next((line[7:] for line in _header().splitlines() if line.startswith("- CPU: ")), "")
    fig.text(0.01, 0.005, f"{cpu}; item accuracy as the loop evaluates it (greedy)", fontsize=7, color="0.4")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    print(f"\nwrote {png}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--curves", type=Path, nargs="+", metavar="RUN_DIR",
                    help="instead of timing decoding: plot these caption runs' test metric against training time")
    ap.add_argument("--png", type=Path, help="with --curves: the figure's path")
    ap.add_argument("--lengths", type=int, nargs="+", default=[20, 32])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=40)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.curves:
        curves(args.curves, args.png)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    print(_header())
    print(f"\ndecoder dim {args.dim}, depth {args.depth}, vocabulary {args.vocab}; 56x56 images, 64 image tokens "
          f"+ CLS; batch {args.batch}; median of {args.repeats}\n")
    images = torch.randn(args.batch, 1, 56, 56)

    print("| decoding | length | with KV cache (s) | without (s) | speed-up | same captions |")
    print("|---|---:|---:|---:|---:|---|")
    for length in args.lengths:
        model = build(length, args.vocab, args.dim, args.depth)
        memory = model.encode(images).detach()
        for name, beam in (("greedy", 1), (f"beam {args.beam}", args.beam)):
            def run(cache, model=model, memory=memory, beam=beam):
                return decode(model, memory=memory, beam=beam, use_cache=cache)

            t_cache, a = _median_time(lambda: run(True), args.repeats)  # noqa: B023 (called at once)
            t_plain, b = _median_time(lambda: run(False), args.repeats)  # noqa: B023
            same = torch.equal(a.tokens, b.tokens)
            print(f"| {name} | {length} | {t_cache:.3f} | {t_plain:.3f} | {t_plain / t_cache:.2f}x | {same} |")

    length = args.lengths[0]
    model = build(length, args.vocab, args.dim, args.depth)
    memory = model.encode(images).detach()
    print(f"\n| beam {args.beam}, length {length} | time (s) | speed-up | same captions |")
    print("|---|---:|---:|---|")
    t_batch, a = _median_time(lambda: beam_search(model, memory=memory, beam=args.beam), args.repeats)
    t_loop, rows = _median_time(lambda: [beam_search(model, memory=memory[i:i + 1], beam=args.beam)
                                         for i in range(args.batch)], args.repeats)
    same = all(torch.equal(a.tokens[i], r.tokens[0]) for i, r in enumerate(rows))
    print(f"| one batched call, {args.batch} images x {args.beam} beams | {t_batch:.3f} | "
          f"{t_loop / t_batch:.2f}x | {same} |")
    print(f"| Python loop over the {args.batch} images | {t_loop:.3f} | 1.00x | |")


if __name__ == "__main__":
    main()
