"""`vitscope predict CHECKPOINT_OR_RUN IMAGE_OR_FOLDER ...`: the top-k labels of image files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vitscope.cli.common import UsageError, add_kernels_flag, at_least


def add_predict_parser(sub) -> None:
    p = sub.add_parser("predict", help="top-k labels for image files or a folder",
                       description="Predict labels for image files (PNG, JPEG, ...) or every image in a folder.")
    p.add_argument("checkpoint", help="a run directory, a .safetensors checkpoint (vitscope's or timm's), or a preset "
                                      "with pretrained weights (e.g. vit_small_patch16_224)")
    p.add_argument("images", nargs="+", type=Path, help="image files or folders")
    p.add_argument("--top-k", type=at_least(1), default=3,
                   help="labels shown per image, most likely first (default: 3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_kernels_flag(p)
    p.set_defaults(run=run_predict)


def run_predict(args) -> int:
    import torch

    from vitscope.data.image_files import find_image_files, read_image_files
    from vitscope.data.transforms import eval_transform
    from vitscope.weights.model_source import open_model

    model, info = open_model(args.checkpoint, kernels=args.kernels)
    files = find_image_files(args.images)
    named = {p for p in args.images if p.is_file()}
    size = model.config.img_size
    size = (size, size) if isinstance(size, int) else tuple(size)
    k = max(1, min(args.top_k, len(info.classes)))
    results = []
    for s in range(0, len(files), 256):
        x, chunk, skipped = read_image_files(files[s : s + 256], named=named, channels=model.config.in_chans,
                                             size=size)
        for why in skipped:
            print(f"vitscope predict: skipped: {why}", file=sys.stderr)
        if not chunk:
            continue
        with torch.no_grad():
            probs = model(eval_transform(x, info.mean, info.std)).softmax(-1)
        top = probs.topk(k, dim=-1)
        for f, pv, iv in zip(chunk, top.values.tolist(), top.indices.tolist()):
            results.append({"file": str(f), "top": [{"label": info.classes[i], "prob": round(p, 4)}
                                                    for p, i in zip(pv, iv)]})
    if not results:
        raise UsageError(f"no image could be read from the {len(files)} files found (each is named above)")
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        width = max(len(r["file"]) for r in results)
        for r in results:
            cells = "  ".join(f"{t['label']} {100 * t['prob']:5.1f}%" for t in r["top"])
            print(f"{r['file']:<{width}}  {cells}")
    return 0
