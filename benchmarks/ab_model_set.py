"""A/B: a model preset with model fields overridden against the preset, the training step's speed.

    python benchmarks/ab_model_set.py --set 'stem=[[32,1],[64,2],[64,1],[128,2],[128,1],[128,1]]'
        [--model vit_fmnist_quick] [--rounds 8] [--steps 8]

`--set FIELD=VALUE` takes what `vitscope train --set` takes (JSON values; repeat it for more
fields), so a variant's cost per step can be read before a long run spends it. Both models live in
one process and their timed rounds alternate (benchmarks/_ab.py); the table gives each round's
images/s and the median of the per-round ratios, the overridden model first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from vitscope.models import create_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = ab.parser(__doc__)
    ab.add_model_sets(ap)
    args = ap.parse_args(argv)
    if not args.set:
        ap.error("give at least one --set FIELD=VALUE, e.g. --set depth=3")
    overrides = ab.model_overrides(ap, args)
    label = " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in overrides.items())

    def make_steps(model: str, batch: int) -> dict:
        steps = {}
        for name, kw in ((label, overrides), ("preset", {})):
            torch.manual_seed(0)
            steps[name] = ab.training_step(create_model(model, **kw), batch)
        return steps

    ab.main(__doc__, "model", make_steps, args=args)


if __name__ == "__main__":
    main()
