"""`vitscope train`: a preset or a config file, every TrainConfig field as a flag, then the one training loop.

`--task caption` trains a captioner (vitscope.caption) whose encoder is `--model`; its decoder's fields go
through `--decoder-set FIELD=VALUE`, and without --preset or --config it starts from caption_quick.
`--task translate` trains a translator (vitscope.translate) on the synthetic language pair; without --preset
or --config it starts from translate_rnn.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from vitscope.cli.common import (
    UsageError,
    add_dataclass_flags,
    given_value,
    inline_options,
    nonempty_path,
    parse_model_sets,
)


def add_train_parser(sub) -> None:
    from vitscope.data.transforms import TrainTransform
    from vitscope.training.loop import TrainConfig
    from vitscope.training.recipes import get_recipe, list_recipes

    p = sub.add_parser("train", help="train a ViT, a captioner or a translator (a preset or a config file; flags "
                                     "override any field)",
                       description="Train a ViT (or with --task caption a captioner). Start from --preset or "
                                   "--config, then override any field with its flag. Prints the run directory.")
    p.add_argument("--preset", choices=list_recipes(),
                   help="a named recipe (default fmnist_quick; with --task caption, caption_quick)")
    p.add_argument("--config", type=Path, help="a JSON config file (e.g. a run's config.json)")
    p.add_argument("--out", type=nonempty_path, help="run directory (default runs/<preset>-<time>)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue the run in RUN_DIR exactly")
    p.add_argument("--weights-only", action="store_true",
                   help="with --resume: continue from the run's weights alone where its checkpoint is not whole "
                        "(optimizer and random state start afresh, so the result differs from an unbroken run)")
    p.add_argument("--config-changes", action="store_true",
                   help="with --resume: continue although RUN_DIR/config.json was edited since its checkpoint "
                        "(without it such a resume is refused, naming the changed fields)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run that --out holds (without it, a folder holding a run is refused)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a model field, e.g. --set depth=8 --set drop_path_rate=0.1")
    p.add_argument("--decoder-set", dest="decoder_args", action="append", default=None, metavar="FIELD=VALUE",
                   help="--task caption / translate: override a field of the captioner's or translator's decoder "
                        "(decoder_args), e.g. --decoder-set depth=3 (default: {})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    quick = get_recipe("fmnist_quick")
    g = p.add_argument_group("training fields (TrainConfig)",
                             "Each overrides the preset's or config's value; the defaults shown are the "
                             "fmnist_quick preset's, which trains when no --preset or --config is given.")
    add_dataclass_flags(g, TrainConfig, defaults=quick)
    a = p.add_argument_group("augmentation fields (TrainTransform)")
    add_dataclass_flags(a, TrainTransform, prefix="aug-", dest_prefix="aug_", defaults=quick.image.augment)
    p.set_defaults(run=run_train)


def parse_decoder_sets(items: list[str]) -> dict:
    """`--decoder-set FIELD=VALUE` items as JSON values (strings staying strings); TrainConfig checks the fields."""
    out = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--decoder-set takes FIELD=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _read_config_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise UsageError(f"{what}: {path} does not exist" if path.exists() is False else f"{what}: {path} is a folder")
    try:
        base = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{what}: {path} is not valid JSON: {e}") from e
    if not isinstance(base, dict):
        raise UsageError(f"{what}: {path} holds {json.dumps(base)[:40]}, not a JSON object of training fields "
                         f"(like a run's config.json)")
    return base


def preset_weights(preset: str) -> str:
    """The weights `vitscope train --preset PRESET --out runs/PRESET` leaves (`make run` trains fmnist_quick so)."""
    return f"runs/{preset}/best.safetensors"


def _check_start_weights(cfg, preset: str | None) -> None:
    """A preset that starts from another preset's run names that run's command when its weights are missing."""
    from vitscope.training.recipes import STARTS_FROM

    start = STARTS_FROM.get(preset or ("caption_quick" if cfg.task == "caption" else ""))
    weights = cfg.image.init_weights if cfg.image is not None else None
    if start and weights == preset_weights(start) and not Path(weights).is_file():
        raise UsageError(f"init_weights: no file {weights}; this preset's encoder starts from the {start} "
                         f"preset's run: run `make run` (vitscope train --preset {start} --out runs/{start}) first, "
                         f"or train from scratch with --init-weights none")


# The preset a task trains from when no --preset or --config is given.
DEFAULT_PRESETS = {"caption": "caption_quick", "translate": "translate_rnn"}


# The option fields a flag adds to rather than replaces (--set, --decoder-set, --aug-*), and what they hold.
_MERGED = {"model_args": "model fields", "decoder_args": "decoder fields", "augment": "augmentation fields"}


def _set_options(base: dict, name: str, value, owners: list[str]) -> None:
    """Put an option's flag into the options it belongs to (the image options, a task's): the run's task's where
    that task has such a field, else the first that has (where check_unused refuses it, naming the flag)."""
    key = base.get("task", "classify") if base.get("task") in owners else owners[0]
    options = base.get(key)
    if options is not None and not isinstance(options, dict):
        what = "image" if key == "image" else f"--task {key}"
        raise UsageError(f"{key} must be an object of {what} fields, got {options!r}")
    base[key] = options = dict(options or {})
    if name in _MERGED:
        if not isinstance(options.setdefault(name, {}), dict):
            raise UsageError(f"{name} must be an object of {_MERGED[name]}, got {options[name]!r}")
        options[name] = {**options[name], **value}
    else:
        options[name] = value


def build_train_config(args):
    from vitscope.training.loop import TrainConfig
    from vitscope.training.options import nest_task_options
    from vitscope.training.recipes import STARTS_FROM, get_recipe

    if args.resume:
        base = _read_config_json(args.resume / "config.json", "cannot resume")
    elif args.config:
        base = _read_config_json(args.config, "config file")
    else:
        preset = args.preset or DEFAULT_PRESETS.get(args.task, "fmnist_quick")
        base = get_recipe(preset).to_dict()
        if preset in STARTS_FROM:
            base["image"]["init_weights"] = preset_weights(STARTS_FROM[preset])
    base = nest_task_options(base)  # a config.json from before the options had their own dataclasses
    inline = inline_options(TrainConfig)  # the image's and the tasks' options: their fields' flags are TrainConfig's
    owners = {}  # an option's name -> the options that have it
    for key, cls in inline.items():
        for name in cls.__dataclass_fields__:
            owners.setdefault(name, []).append(key)
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - inline.keys()
    given = {k: given_value(v) for k, v in vars(args).items() if k in fields and v is not None}
    options = {k: given_value(v) for k, v in vars(args).items()
               if k in owners and v is not None and k != "decoder_args"}
    aug = {k[4:]: given_value(v) for k, v in vars(args).items() if k.startswith("aug_") and v is not None}
    image = base.get("image")
    if isinstance(image, dict) and image.get("init_weights") and "model" in options \
            and options["model"] != image.get("model") and "init_weights" not in options:
        base["image"] = {**image, "init_weights": None}  # the preset's starting weights are its own model's
    caption = base.get("caption")
    if isinstance(caption, dict) and caption.get("decoder_args") and "captioner" in options \
            and options["captioner"] != caption.get("captioner"):
        # the preset's decoder fields are its own captioner's; --decoder-set still applies
        base["caption"] = {**caption, "decoder_args": {}}
    if args.resume and (given or options or aug or args.set or args.decoder_args or args.out or args.overwrite):
        raise UsageError("--resume continues the saved config exactly; drop the other training flags")
    if (args.weights_only or args.config_changes) and not args.resume:
        raise UsageError(f"{'--weights-only' if args.weights_only else '--config-changes'} goes with --resume RUN_DIR")
    base.update(given)
    if aug:
        _set_options(base, "augment", aug, owners["augment"])
    if args.set:
        _set_options(base, "model_args", parse_model_sets(args.set), owners["model_args"])
    for name, value in options.items():
        _set_options(base, name, value, owners[name])
    if args.decoder_args:
        _set_options(base, "decoder_args", parse_decoder_sets(args.decoder_args), owners["decoder_args"])
    try:
        return TrainConfig.from_dict(base)
    except TypeError as e:  # a field missing or of a kind the dataclass cannot even take
        raise UsageError(f"the training config does not fit TrainConfig: {e}") from e


def run_train(args) -> int:
    from vitscope.training.loop import train

    cfg = build_train_config(args)
    if args.resume:
        run_dir = args.resume
    else:
        if not args.config:
            _check_start_weights(cfg, args.preset)
        name = args.preset or (cfg.image.model if cfg.image else cfg.task)
        run_dir = args.out or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"run directory: {run_dir}", flush=True)
    result = train(cfg, run_dir, resume=bool(args.resume), overwrite=args.overwrite, weights_only=args.weights_only,
                   progress=not args.no_progress, config_changes=args.config_changes)
    if result.stopped == "signal":  # the loop said so, and how to continue, in its one line
        return 130
    print(f"{cfg.eval_split} {result.describe()}, training {result.train_time_s / 60:.1f} min, "
          f"{result.items_per_s:.0f} {result.unit}/s")
    files = {"classify": "curves.png, confusion.png, explorer.html, summary.json",
             "caption": "curves.png, caption_attention.png, captions.html, summary.json; vitscope eval / caption RUN",
             "translate": "curves.png, alignment.png, translations.html, summary.json; vitscope eval / translate RUN",
             }[cfg.task]
    if cfg.task == "translate" and not (run_dir / "alignment.png").exists():  # a translator without attention
        files = files.replace("alignment.png, ", "")
    print(f"run directory: {run_dir}  ({files})")
    return 0
