"""`vitscope caption RUN IMAGE_OR_FOLDER... [--beam 5] [--json]`: captions for image files.

The main CLI adds the sub-command with `add_caption_parser(subparsers)`; `run_caption(args)` returns the exit
code (0 done; a user error raises, printed as one line, code 2). `vitscope eval RUN` scores a captioner.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vitscope.cli.common import (
    UsageError,
    add_decoding_options,
    add_kernels_flag,
    at_least,
    decode_options,
    open_caption_run,
)

EMPTY_CAPTION = "(empty caption)"  # text mode's word for a caption of no words (JSON keeps "")


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
    add_decoding_options(p, beam_default=5)
    p.add_argument("--batch-size", type=at_least(1), default=64, help="images decoded together (default: 64)")
    p.add_argument("--json", action="store_true", help="print JSON (file, caption, words, score) instead of lines")
    add_kernels_flag(p)
    p.set_defaults(run=run_caption)
    return p


def run_caption(args) -> int:
    import torch

    from vitscope.data import normalize
    from vitscope.data.image_files import find_image_files, read_image_files
    from vitscope.sequence.decoding import decode

    options = decode_options(args)
    run = open_caption_run(args.model, vocab=args.vocab, options=options, kernels=args.kernels)
    files = find_image_files(args.images)
    named = {p for p in args.images if p.is_file()}
    results = []
    for s in range(0, len(files), args.batch_size):
        x, chunk, skipped = read_image_files(files[s : s + args.batch_size], named=named, channels=run.channels,
                                             size=run.image_size)
        for why in skipped:
            print(f"vitscope caption: skipped: {why}", file=sys.stderr)
        if not chunk:
            continue
        with torch.no_grad():
            out = decode(run.model, normalize(x, run.mean, run.std), **options.kwargs())
        for f, words, caption, score in zip(chunk, out.words(run.vocab), out.captions(run.vocab), out.score.tolist()):
            results.append({"file": str(f), "caption": caption, "words": words, "score": round(score, 4)})
    if not results:
        raise UsageError(f"no image could be read from the {len(files)} files found (each is named above)")
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        width = max(len(r["file"]) for r in results)
        for r in results:  # an empty caption (<eos> first) said as one, not a blank that reads as a crash
            print(f"{r['file']:<{width}}  {r['caption'] or EMPTY_CAPTION}")
    return 0
