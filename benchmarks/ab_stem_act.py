"""A/B: the conv stem with ReLU against GELU (ViTConfig.stem_act), the training step's speed.

    python benchmarks/ab_stem_act.py [--model vit_fmnist_quick] [--rounds 8] [--steps 8]

Both models live in one process and their timed rounds alternate (benchmarks/_ab.py); the table
gives each round's images/s and the median of the per-round ratios.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from vitscope.models import create_model, get_config  # noqa: E402


def make_steps(model: str, batch: int) -> dict:
    if not get_config(model).stem:
        raise SystemExit(f"{model} has no conv stem; pick a model with one, e.g. vit_fmnist_quick")
    steps = {}
    for act in ("relu", "gelu"):
        torch.manual_seed(0)
        steps[act] = ab.training_step(create_model(model, stem_act=act), batch)
    return steps


def main(argv: list[str] | None = None) -> None:
    ab.main(__doc__, "stem activation", make_steps, argv)


if __name__ == "__main__":
    main()
