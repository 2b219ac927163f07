"""Does a change keep what vitscope computes? Train a recipe for a few steps with whichever vitscope is
importable, then compare two such runs' weights bit for bit: `fmnist_quick` (`make run`'s, classification) by
default, `--preset caption_quick` or `translate_rnn` / `translate_transformer` for the sequence tasks.

    cd /tmp/before && PYTHONPATH=$PWD/src python /work/main/benchmarks/same_weights.py train /tmp/w_before
    cd /work/main && .venv/bin/python benchmarks/same_weights.py train /tmp/w_after
    .venv/bin/python benchmarks/same_weights.py compare /tmp/w_before /tmp/w_after

Bit-identical weights after 120 steps mean the same full run (the loop is deterministic for a seed).
caption_quick starts from a trained encoder's file; here it starts from scratch (`init_weights` none), the same
on both sides.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def train(out: Path, steps: int, preset: str = "fmnist_quick") -> None:
    try:  # the package layout since the kernels/ refactor
        from vitscope.training.loop import train as run
        from vitscope.training.recipes import get_recipe
    except ImportError:  # before it
        from vitscope.recipes import get_recipe
        from vitscope.train import train as run
    cfg = get_recipe(preset)
    cfg.explain_images = 0
    if getattr(cfg, "image", None) is not None:  # the image options' own dataclass (issue 62)
        cfg.image.init_weights = None
    elif hasattr(cfg, "init_weights"):  # before it, or a translation (no image options)
        cfg.init_weights = None
    t = time.time()
    run(cfg, out, progress=False, max_steps=steps)
    print(f"{steps} steps into {out} in {time.time() - t:.1f} s")


def compare(a: Path, b: Path) -> bool:
    wa, wb = load_file(str(a / "last.safetensors")), load_file(str(b / "last.safetensors"))
    same = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    diff = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa) if wa.keys() == wb.keys() else None
    print(f"bit-identical: {same}; max abs diff: {diff}")
    return same


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("out", type=Path)
    t.add_argument("--steps", type=int, default=120)
    t.add_argument("--preset", default="fmnist_quick", help="a training recipe (vitscope train --preset)")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args()
    if args.cmd == "train":
        train(args.out, args.steps, args.preset)
    else:
        raise SystemExit(0 if compare(args.a, args.b) else 1)
