"""A/B: the conv stem in channels-last memory (what vitscope does) against the default layout.

    python benchmarks/ab_stem_layout.py [--model vit_fmnist_quick] [--rounds 8] [--steps 8]

Both models live in one process and their timed rounds alternate, so a drift of the host's speed
(about 20% here, over minutes) falls on both alike; the table gives each round's images/s and the
median of the per-round ratios. A step is the bfloat16-autocast training step of vitscope.train:
forward, cross-entropy, backward, fused AdamW, zero_grad.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from einops import rearrange

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_header  # noqa: E402
from vitscope.models import create_model, get_config  # noqa: E402
from vitscope.vit import PatchEmbed  # noqa: E402


def _default_layout_forward(self: PatchEmbed, x: torch.Tensor) -> torch.Tensor:
    """PatchEmbed.forward without the channels-last input (the layout before this change)."""
    self.check(x)
    if self.stem is not None:
        x = self.stem(x)
    return rearrange(self.proj(x), "b d h w -> b (h w) d")


def make_step(model_name: str, channels_last: bool, batch: int):
    torch.manual_seed(0)
    model = create_model(model_name)
    if not channels_last:
        model.patch_embed.to(memory_format=torch.contiguous_format)
    pe = model.patch_embed
    x = torch.randn(batch, pe.in_chans, *pe.img_size)
    y = torch.randint(0, get_config(model_name).num_classes, (batch,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if not channels_last:  # this model's patch embedding only
        model.patch_embed.forward = _default_layout_forward.__get__(model.patch_embed)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_fmnist_quick")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round and layout")
    args = ap.parse_args(argv)
    steps = {"channels-last": make_step(args.model, True, args.batch),
             "default": make_step(args.model, False, args.batch)}
    for step in steps.values():
        for _ in range(3):
            step()
    rates: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            rates[name].append(args.batch * args.steps / (time.perf_counter() - t0))
    ratios = [a / b for a, b in zip(rates["channels-last"], rates["default"])]
    print(machine_header())
    print(f"\n{args.model}, batch {args.batch}, bfloat16 autocast training step, {args.rounds} alternating "
          f"rounds of {args.steps} steps\n")
    print("| stem layout | images/s per round | median |")
    print("|---|---|---:|")
    for name, r in rates.items():
        print(f"| {name} | {' '.join(f'{v:.0f}' for v in r)} | {statistics.median(r):.0f} |")
    print(f"\nchannels-last ÷ default, per round: {' '.join(f'{v:.2f}' for v in ratios)}; "
          f"median **{statistics.median(ratios):.2f}**")


if __name__ == "__main__":
    main()
