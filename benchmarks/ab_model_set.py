"""A/B: a model preset with --set FIELD=VALUE overrides (repeatable) against the preset, training step speed.

    python benchmarks/ab_model_set.py --set 'stem=[[32,1],[64,2],[64,1],[128,2],[128,1],[128,1]]'
        [--model vit_fmnist_quick] [--rounds 8] [--steps 8]

`--set FIELD=VALUE` takes what `vitscope train --set` takes (JSON values; repeat it for more
fields), so a variant's cost per step can be read before a long run spends it. Both models live in
one process and their timed rounds alternate (benchmarks/_ab.py); the table gives each round's
images/s and the median of the per-round ratios, the overridden model first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from vitscope.models import create_model, get_config  # noqa: E402


def parse_sets(items: list[str]) -> dict:
    """['depth=3', 'stem=[[32,1]]'] -> {'depth': 3, 'stem': [[32, 1]]}; plain strings stay strings."""
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--set takes FIELD=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def main(argv: list[str] | None = None) -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    known, rest = pre.parse_known_args(argv)
    overrides = parse_sets(known.set)
    if not overrides and not {"-h", "--help"} & set(rest):
        raise SystemExit("give at least one --set FIELD=VALUE, e.g. --set depth=3")
    label = " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in overrides.items())

    def make_steps(model: str, batch: int) -> dict:
        steps = {}
        for name, kw in ((label, overrides), ("preset", {})):
            torch.manual_seed(0)
            steps[name] = ab.training_step(create_model(model, **kw), batch, get_config(model).num_classes)
        return steps

    ab.main(__doc__, "model", make_steps, rest)


if __name__ == "__main__":
    main()
