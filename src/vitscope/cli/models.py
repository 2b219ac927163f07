"""`vitscope models [PATTERN]`: the model presets with their parameter counts and pretrained weights."""

from __future__ import annotations

from vitscope.cli.common import UsageError


def add_models_parser(sub) -> None:
    p = sub.add_parser("models", help="the model presets with their parameter counts and pretrained weights")
    p.add_argument("pattern", nargs="?", default="*", help="glob over names, e.g. 'vit_*28'")
    p.set_defaults(run=run_models)


def run_models(args) -> int:
    import torch

    from vitscope.models import create_model, get_config, list_models
    from vitscope.weights.pretrained import TIMM_WEIGHTS

    names = list_models(args.pattern)
    if not names:
        raise UsageError(f"no preset matches {args.pattern!r}")
    print(f"{'name':<26} {'params':>12}  {'image':>9}  {'patch':>5}  {'width':>5}  {'depth':>5}  {'heads':>5}  "
          f"pretrained")
    for n in names:
        cfg = get_config(n)
        with torch.device("meta"):
            params = create_model(n).num_params()
        size = cfg.img_size if isinstance(cfg.img_size, int) else "x".join(map(str, cfg.img_size))
        weights = TIMM_WEIGHTS.get(n, "")  # `create_model(name, pretrained=True)`, `train --pretrained true`
        print(f"{n:<26} {params:>12,}  {size!s:>9}  {cfg.patch_size:>5}  {cfg.embed_dim:>5}  {cfg.depth:>5}  "
              f"{cfg.num_heads:>5}  {'timm ' + weights.split('.', 1)[1] if weights else ''}".rstrip())
    return 0
