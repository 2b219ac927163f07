"""Where a training step's time goes, by taking parts away: the step with each part removed, timed in alternation.

    python benchmarks/ablate_step.py --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256

torch.profiler's self times attribute cache misses and waits to whichever operator pays them, so a
memory-bound operator can look two or three times as costly inside a step as on its own. This
measures instead: the same model is built once whole and once with each part removed from every
block, and their training steps (benchmarks/_ab.py: bfloat16 autocast, forward, cross-entropy,
backward, the optimizer) alternate in rounds in one process. A part's cost is the whole step's time
minus the time without it. The variants compute different functions; they are timing probes only.

Parts: `gelu` (the MLP's activation becomes the identity), `layernorm` (both norms of each block),
`attention_core` (q kᵀ, softmax and the mix with v: the block's attention returns its v
projection through `proj`), `mlp` (the whole MLP).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from _machine import machine_header  # noqa: E402
from vitscope.models import create_model  # noqa: E402

PARTS = ("gelu", "layernorm", "attention_core", "mlp")


class ValueOnly(nn.Module):
    """An attention block's projections without the attention: x -> proj(v)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.qkv, self.proj = attn.qkv, attn.proj
        self.capture = None  # read by the ViT's class-token-only check

    def forward(self, x: Tensor, *args, queries: int | None = None, **kwargs) -> Tensor:
        v = self.qkv(x).chunk(3, dim=-1)[2]  # (B, N, dim)
        return self.proj(v if queries is None else v[:, :queries])


def without(model: nn.Module, part: str | None) -> nn.Module:
    for block in model.blocks:
        if part == "gelu":
            block.mlp.act = nn.Identity()
        elif part == "layernorm":
            block.norm1, block.norm2 = nn.Identity(), nn.Identity()
        elif part == "attention_core":
            block.attn = ValueOnly(block.attn)
        elif part == "mlp":
            block.mlp = nn.Identity()
    return model


def main(argv: list[str] | None = None) -> None:
    ap = ab.parser(__doc__)
    ab.add_model_sets(ap)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    args = ap.parse_args(argv)
    overrides = ab.model_overrides(ap, args)
    steps: dict[str, Callable[[], None]] = {}
    for part in [None, *args.parts]:
        torch.manual_seed(0)
        model = without(create_model(args.model, **overrides), part)
        name = "whole step" if part is None else f"without {part}"
        steps[name] = ab.training_step(model, args.batch, dtype=args.dtype)
    rates = ab.alternate(steps, batch=args.batch, rounds=args.rounds, steps_per_round=args.steps)
    ms = {name: 1e3 * args.batch / statistics.median(r) for name, r in rates.items()}
    whole = ms["whole step"]
    print(machine_header())
    sets = "".join(f" {s}" for s in args.set)
    print(f"\n{args.model}{sets}, batch {args.batch}, {ab.step_label(args)} training step, {args.rounds} "
          f"alternating rounds of {args.steps} steps\n")
    print("| variant | images/s per round | ms a step (median) | the part's cost, ms | share of the step |")
    print("|---|---|---:|---:|---:|")
    for name, r in rates.items():
        cost = "" if name == "whole step" else f"{whole - ms[name]:.1f}"
        share = "" if name == "whole step" else f"{(whole - ms[name]) / whole:.0%}"
        print(f"| {name} | {' '.join(f'{v:.0f}' for v in r)} | {ms[name]:.1f} | {cost} | {share} |")


if __name__ == "__main__":
    main()
