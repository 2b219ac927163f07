"""A/B: the training step with Muon (vitscope.training.optim, `--optimizer muon`) against fused AdamW.

    python benchmarks/ab_optimizer.py [--model vit_fmnist_quick] [--rounds 8] [--steps 8]
    python benchmarks/ab_optimizer.py --batched [--model vit_fmnist_quick]

Muon adds five Newton-Schulz iterations per hidden matrix to every step; this measures what that
costs in images/s. With `--batched`, both variants train with Muon: vitscope's (vitscope.training.muon, the
same-shaped matrices iterated together) against torch.optim.Muon's own step, one matrix at a time;
it also prints whether their parameters came out bit for bit equal after the timed steps.
Both models start from the same weights, live in one process and their timed rounds alternate
(benchmarks/_ab.py); the table gives each round's images/s and the median of the per-round ratios,
the first variant first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from vitscope.models import create_model  # noqa: E402
from vitscope.training import muon  # noqa: E402


def make_steps(model: str, batch: int) -> dict:
    steps = {}
    for name in ("muon", "adamw"):
        torch.manual_seed(0)
        steps[name] = ab.training_step(create_model(model), batch, optimizer=name)
    return steps


def make_muon_steps(model: str, batch: int, models: list) -> dict:
    """vitscope's batched Muon step against torch.optim.Muon's step on the same optimizer state layout."""
    steps = {}
    for name in ("batched", "torch"):
        torch.manual_seed(0)
        models.append(create_model(model))
        step = ab.training_step(models[-1], batch, optimizer="muon")
        steps[name] = step if name == "batched" else ab.with_attribute(step, muon.Muon, "step",
                                                                       torch.optim.Muon.step)
    return steps


if __name__ == "__main__":
    ap = ab.parser(__doc__)
    ap.add_argument("--batched", action="store_true",
                    help="vitscope's Muon against torch.optim.Muon's step, instead of Muon against AdamW")
    args = ap.parse_args()
    if not args.batched:
        ab.main(__doc__, "optimizer", make_steps, args=args)
    else:
        trained: list = []
        ab.main(__doc__, "Muon step", lambda m, b: make_muon_steps(m, b, trained), args=args)
        same = all(torch.equal(p, q) for p, q in zip(trained[0].parameters(), trained[1].parameters()))
        print(f"\nparameters after the same steps bit for bit equal: {same}")
