"""`vitscope caption RUN IMAGE_OR_FOLDER... [--beam 5] [--json]`: captions for image files, and the caption
side of `vitscope eval RUN` (BLEU-1..4, CIDEr-D and on Fashion-MNIST scenes item accuracy, exact match and
attention grounding, for greedy decoding and beam search).

The main CLI adds the sub-command with `add_caption_parser(subparsers)`; `run_caption(args)` and
`run_caption_eval(args)` return the exit code (0 done; a user error raises, printed as one line, code 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vitscope.cli.main import UsageError, add_kernels_flag, at_least, check_out_dir
from vitscope.cli.predict import _image_files, _readable_images


def add_caption_options(p: argparse.ArgumentParser, *, beam_default: int) -> None:
    """The decoding options `caption` and `eval` share."""
    p.add_argument("--beam", type=at_least(1), default=beam_default,
                   help=f"beam size; 1 decodes greedily (default: {beam_default})")
    p.add_argument("--max-len", type=at_least(2), default=None, metavar="N",
                   help="the longest caption in tokens, <bos> and <eos> included (default: the decoder's positions)")
    p.add_argument("--length-penalty", type=float, default=0.0,
                   help="rank beams by log-probability / length ** this (default: 0, the summed log-probability)")
    p.add_argument("--no-repeat-ngram", type=at_least(0), default=0, metavar="N",
                   help="never repeat an n-gram of this size (default: 0, off)")
    p.add_argument("--vocab", type=Path, metavar="FILE",
                   help="a vocabulary JSON file to use instead of the checkpoint's own (it must be the same)")


def add_caption_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "caption", help="caption image files or folders with a trained captioner",
        description="Caption image files (PNG, JPEG, ...) or every image in a folder with a captioning run "
                    "(vitscope train --task caption).",
        epilog="examples:\n  vitscope caption runs/caption_quick scene.png --beam 5\n"
               "  vitscope caption runs/caption_quick photos/ --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="RUN", help="a caption run directory (best.safetensors, else last) or its "
                                                ".safetensors checkpoint")
    p.add_argument("images", metavar="IMAGE_OR_FOLDER", nargs="+", type=Path, help="image files or folders")
    add_caption_options(p, beam_default=5)
    p.add_argument("--batch-size", type=at_least(1), default=64, help="images decoded together (default: 64)")
    p.add_argument("--json", action="store_true", help="print JSON (file, caption, words, score) instead of lines")
    add_kernels_flag(p)
    p.set_defaults(run=run_caption)
    return p


def open_run(args):
    from vitscope.caption.run import check_max_len, is_caption_checkpoint, open_captioner

    if not is_caption_checkpoint(args.model):
        if not Path(args.model).exists():
            raise UsageError(f"no run directory or checkpoint at {args.model}")
        raise UsageError(f"{args.model} is not a captioning run; train one with vitscope train --task caption "
                         f"(for a classifier use vitscope predict)")
    run = open_captioner(args.model, vocab_file=args.vocab, kernels=not args.no_kernels)
    check_max_len(run.model, args.max_len)
    return run


def run_caption(args) -> int:
    import torch

    from vitscope.caption.decoding import decode
    from vitscope.data import normalize

    run = open_run(args)
    files = _image_files(args.images)
    named = {p for p in args.images if p.is_file()}
    results = []
    for s in range(0, len(files), args.batch_size):
        x, chunk = _readable_images(files[s : s + args.batch_size], named, channels=run.channels,
                                    size=run.image_size, prog="vitscope caption")
        if not chunk:
            continue
        with torch.no_grad():
            out = decode(run.model, normalize(x, run.mean, run.std), beam=args.beam, max_len=args.max_len,
                         length_penalty=args.length_penalty, no_repeat_ngram_size=args.no_repeat_ngram)
        for f, words, caption, score in zip(chunk, out.words(run.vocab), out.captions(run.vocab), out.score.tolist()):
            results.append({"file": str(f), "caption": caption, "words": words, "score": round(score, 4)})
    if not results:
        raise UsageError(f"no image could be read from the {len(files)} files found (each is named above)")
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        width = max(len(r["file"]) for r in results)
        for r in results:
            print(f"{r['file']:<{width}}  {r['caption']}")
    return 0


# -- eval ----------------------------------------------------------------------------------------------
COLUMNS = (("bleu1", "BLEU-1"), ("bleu2", "BLEU-2"), ("bleu3", "BLEU-3"), ("bleu4", "BLEU-4"), ("cider", "CIDEr-D"),
           ("item_accuracy", "items"), ("exact_match", "exact"), ("grounding", "grounding"))


def run_caption_eval(args) -> int:
    """`vitscope eval RUN` for a captioning run: greedy and beam decoding on a split, side by side."""
    from vitscope.caption.evaluate import evaluate_captions
    from vitscope.caption.task import CAPTION_DATASETS, load_caption_dataset

    out_dir = check_out_dir(args.out) if args.out else None
    run = open_run(args)
    name = args.dataset or run.dataset
    if not name:
        raise UsageError("this checkpoint does not say which dataset it was trained on; pass --dataset")
    if name not in CAPTION_DATASETS:
        raise UsageError(f"{name} is not a caption dataset; a captioner is evaluated on one of "
                         f"{', '.join(CAPTION_DATASETS)}")
    cfg = run.train_config if name == run.dataset else {}
    split = args.split or cfg.get("eval_split") or "test"
    data = load_caption_dataset(name, split, root=args.data_dir or cfg.get("data_dir"), image_size=run.image_size[0],
                                channels=run.channels, captions_file=cfg.get("captions_file"))
    if tuple(data.images.shape[1:]) != (run.channels, *run.image_size):
        raise UsageError(f"{name} {split} has images of {tuple(data.images.shape[1:])} but the model reads "
                         f"{(run.channels, *run.image_size)}: evaluate it on the data it was trained on")
    rows = {}
    for beam in dict.fromkeys((1, args.beam)):
        result = evaluate_captions(run.model, data, run.vocab, mean=run.mean, std=run.std, beam=beam,
                                   batch_size=args.batch_size, max_len=args.max_len, length_penalty=args.length_penalty,
                                   no_repeat_ngram_size=args.no_repeat_ngram)
        rows["greedy" if beam == 1 else f"beam {beam}"] = result
    summary = {"checkpoint": str(run.source), "dataset": name, "split": split, "images": len(data),
               "decoding": {k: r.metrics for k, r in rows.items()},
               "examples": {k: [" ".join(w) for w in r.captions[:5]] for k, r in rows.items()}}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "eval.json").write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    shown = [(k, label) for k, label in COLUMNS if any(k in r.metrics for r in rows.values())]
    print(f"{name} {split}: {len(data)} images, {sum(map(len, data.captions))} reference captions")
    print(f"{'decoding':<10}" + "".join(f"{label:>10}" for _, label in shown) + f"{'best layer':>12}")
    for key, r in rows.items():
        m = r.metrics
        cells = "".join(f"{100 * m[k]:>9.2f}%" if k in ("item_accuracy", "exact_match", "grounding")
                        else f"{m[k]:>10.4f}" for k, _ in shown)
        layers = m.get("grounding_per_layer") or []
        best = f"{max(layers) * 100:.2f}% (L{layers.index(max(layers))})" if layers else ""
        print(f"{key:<10}{cells}{best:>12}")
    for key, r in rows.items():
        print(f"{key}: {' '.join(r.captions[0])}", file=sys.stdout)
    return 0
