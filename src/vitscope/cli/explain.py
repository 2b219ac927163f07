"""`vitscope explain CHECKPOINT_OR_RUN [IMAGE ...] --out DIR`: pictures and the explorer for a model.

The main CLI adds the sub-command with `add_explain_parser(subparsers)` and runs it with
`run_explain(args)`, which returns the exit code (0 done, 2 a user error, explained in one line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from vitscope.cli.common import (
    add_kernels_flag,
    add_overwrite_flag,
    at_least,
    check_out_dir,
    nonempty_path,
    os_error_line,
)
from vitscope.errors import VitscopeError

# What explain writes into --out: the explorer, and write_report's pictures and numbers.
EXPLAIN_FILES = ("explorer.html", "overlays.png", "heads_last_layer.png", "heads_all_layers.png", "distance.png",
                 "regions.png", "importance.png", "pruning.png", "stats.json")


class ExplainError(VitscopeError):
    """A problem the user can fix; printed as one line."""


def add_explain_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "explain",
        help="attention pictures and an interactive HTML explorer for a trained model",
        description="Look inside a model: CLS attention and rollout overlays, every head of a layer,\n"
                    "mean attention distance, the four attention regions, head importance and pruning\n"
                    "curves (PNG), and explorer.html: one self-contained page to explore attention by\n"
                    "hovering over patches (no network needed).",
        epilog="examples:\n  vitscope explain runs/quick shoe.png shirt.jpg --out explain/\n"
               "  vitscope explain runs/quick --dataset fashion_mnist --num 8 --out explain/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="CHECKPOINT_OR_RUN",
                   help="a run directory (best.safetensors, else last), a .safetensors checkpoint (vitscope's or "
                        "timm's), or a preset with pretrained weights, e.g. vit_small_patch16_224")
    p.add_argument("images", metavar="IMAGE", nargs="*", help="image files (PNG, JPEG, ...)")
    p.add_argument("--out", required=True, type=nonempty_path, help="folder for the pictures and explorer.html")
    add_overwrite_flag(p)
    p.add_argument("--dataset", help="also show images of this dataset (e.g. fashion_mnist); with labels it "
                                     "also measures head importance")
    p.add_argument("--split", default="test", help="dataset split (default: test)")
    p.add_argument("--data-dir", type=Path, help="where the dataset's files are (default: where the run read "
                                                 "them, else the dataset's usual places)")
    p.add_argument("--num", type=at_least(1), default=8, help="how many dataset images to show (default: 8)")
    p.add_argument("--importance-samples", type=at_least(0), default=512,
                   help="labelled dataset images used for head importance and pruning (default: 512; "
                        "0 skips them)")
    p.add_argument("--no-report", action="store_true", help="write only explorer.html, no PNG pictures")
    add_kernels_flag(p)
    p.set_defaults(run=run_explain)
    return p


def _load(path: Path, kernels: bool):
    from vitscope.weights.model_source import open_model

    try:
        return open_model(path, kernels=kernels)
    except VitscopeError as e:
        raise ExplainError(f"cannot load {path}: {e}") from e


def _dataset_sample(args, model, info, n: int):
    from vitscope.weights.model_source import load_data

    try:
        ds, _ = load_data(model, info, args.dataset, args.split, args.data_dir)
    except (VitscopeError, OSError) as e:  # the data layer explains missing or damaged files in its message
        raise ExplainError(f"cannot load dataset {args.dataset!r} ({args.split}): {e}") from e
    if tuple(ds.images.shape[1:]) != (model.config.in_chans, *model.patch_embed.img_size):
        raise ExplainError(f"{args.dataset} images are {tuple(ds.images.shape[1:])} but the model takes "
                           f"({model.config.in_chans}, {model.patch_embed.img_size[0]}, "
                           f"{model.patch_embed.img_size[1]})")
    n = min(n, len(ds))
    return ds, ds.images[:n], ds.labels[:n], list(ds.classes)


def run_explain(args: argparse.Namespace) -> int:
    """Run `vitscope explain`; prints the files written. A user error is one line and exit code 2
    (with `args.debug`, the traceback instead)."""
    try:
        paths = explain(args)
    except (VitscopeError, OSError) as e:  # a user's input or path; anything else is a bug and keeps its traceback
        if getattr(args, "debug", False):
            raise
        msg = os_error_line(e) if isinstance(e, OSError) and e.errno is not None else str(e)
        msg = "; ".join(line.strip() for line in msg.splitlines() if line.strip())
        print(f"vitscope explain: error: {msg}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


def explain(args: argparse.Namespace) -> list[Path]:
    from vitscope.data.image_files import load_image_files
    from vitscope.inspect.explorer import write_explorer
    from vitscope.inspect.images import model_inputs
    from vitscope.inspect.importance import ablation_importance, gradient_importance
    from vitscope.inspect.plots import write_report
    from vitscope.inspect.probes import run_probes

    if not args.images and not args.dataset:
        raise ExplainError("give image files, or --dataset NAME (e.g. --dataset fashion_mnist --num 8)")
    out = check_out_dir(Path(args.out), writes=EXPLAIN_FILES, overwrite=args.overwrite)
    model, info = _load(Path(args.model), kernels=args.kernels)
    known = info.normalisation_known
    mean, std = (list(info.mean), list(info.std)) if known else (None, None)
    classes = info.classes if info.named_classes else None
    h, w = model.patch_embed.img_size
    images, labels, names = [], None, []
    if args.images:
        images.append(load_image_files(args.images, channels=model.config.in_chans, size=(h, w)))
        names += [Path(p).name for p in args.images]
    ds = None
    if args.dataset:
        ds, ds_images, ds_labels, ds_classes = _dataset_sample(args, model, info, args.num)
        classes = classes or ds_classes
        mean, std = mean or list(ds.mean), std or list(ds.std)
        images.append(ds_images)
        names += [f"{args.dataset} #{i}" for i in range(len(ds_images))]
        labels = [None] * len(args.images) + ds_labels.tolist()
    images = torch.cat(images)
    if mean is None or std is None:  # as predict and eval read such a checkpoint: timm's ViT weights' scale
        mean, std = list(info.mean), list(info.std)
        print("vitscope explain: warning: the checkpoint records no mean/std; assuming 0.5 and 0.5 (timm's ViT "
              "weights'), as predict and eval do", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)

    importance, data = None, None
    if ds is not None and args.importance_samples > 0:
        m = min(args.importance_samples, len(ds))
        data = (model_inputs(ds.images[:m], mean, std)[0], ds.labels[:m])
        importance = {"ablation": ablation_importance(model, data),
                      "gradient": gradient_importance(model, data)}
    explorer = write_explorer(model, images, out / "explorer.html", labels=labels, class_names=classes,
                              importance=importance, image_names=names, mean=mean, std=std,
                              title=f"vitscope explorer — {Path(args.model).name}",
                              probes=run_probes(args.model) if Path(args.model).is_dir() else None)
    paths = [explorer]
    if not args.no_report:
        paths += write_report(model, images, out, labels=labels, class_names=classes, dataset=data,
                              importance=importance, mean=mean, std=std)
    return paths
