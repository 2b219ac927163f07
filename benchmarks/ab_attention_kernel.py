"""A/B: bfloat16 training with the explicit attention path against PyTorch's fused kernel, whole step.

    python benchmarks/ab_attention_kernel.py [--model vit_fmnist_quick] [--set depth=6 ...] [--rounds 8]

`attend` takes the explicit path for bfloat16 training on CPU up to `EXPLICIT_HALF_MAX_KEYS` keys
(vitscope/attention.py), a constant that bench_attention.py's crossover table set on one machine.
This checks the choice on another machine for a whole model: both variants start from the same
weights in one process, and each variant's steps run with the constant set for it (the explicit
path as shipped, or 0 keys, which sends every call to the fused kernel). The table gives each
round's images/s and the median of the per-round ratios, explicit first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from vitscope import attention  # noqa: E402
from vitscope.models import create_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = ab.parser(__doc__)
    ab.add_model_sets(ap)
    args = ap.parse_args(argv)
    overrides = ab.model_overrides(ap, args)

    def make_steps(model: str, batch: int) -> dict:
        steps = {}
        for name, max_keys in (("explicit", attention.EXPLICIT_HALF_MAX_KEYS), ("fused", 0)):
            torch.manual_seed(0)
            net = create_model(model, **overrides)
            steps[name] = ab.with_attribute(ab.training_step(net, batch), attention, "EXPLICIT_HALF_MAX_KEYS", max_keys)
        return steps

    ab.main(__doc__, "attention in bf16 training", make_steps, args=args)


if __name__ == "__main__":
    main()
