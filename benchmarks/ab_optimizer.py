"""A/B: the training step with Muon (vitscope.optim, `--optimizer muon`) against fused AdamW.

    python benchmarks/ab_optimizer.py [--model vit_fmnist_quick] [--rounds 8] [--steps 8]

Muon adds five Newton-Schulz iterations per hidden matrix to every step; this measures what that
costs in images/s. Both models start from the same weights, live in one process and their timed
rounds alternate (benchmarks/_ab.py); the table gives each round's images/s and the median of the
per-round ratios, Muon first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from vitscope.models import create_model  # noqa: E402


def make_steps(model: str, batch: int) -> dict:
    steps = {}
    for name in ("muon", "adamw"):
        torch.manual_seed(0)
        steps[name] = ab.training_step(create_model(model), batch, optimizer=name)
    return steps


if __name__ == "__main__":
    ab.main(__doc__, "optimizer", make_steps)
