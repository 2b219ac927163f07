"""`vitscope eval CHECKPOINT_OR_RUN`: accuracy, per-class accuracy and the confusion matrix on a split; for a
captioning run BLEU-1..4, CIDEr-D and on Fashion-MNIST scenes item accuracy, exact match and attention grounding,
for greedy decoding and beam search; for a translation run exact sentence accuracy, token accuracy, BLEU-4 and
alignment accuracy on its test sentences (cli/translate.py)."""

from __future__ import annotations

import json

from vitscope.cli.common import (
    UsageError,
    add_decoding_options,
    add_kernels_flag,
    add_overwrite_flag,
    at_least,
    check_out_dir,
    decode_options,
    listed,
    nonempty_path,
    open_caption_run,
)

BEAM = 5  # eval's beam size for captioning and translation runs


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="accuracy, per-class accuracy and confusion matrix of a checkpoint",
                       description="Evaluate a run or checkpoint on a dataset split.")
    p.add_argument("checkpoint", help="a run directory, a .safetensors checkpoint (vitscope's or timm's), or a preset "
                                      "with pretrained weights (e.g. vit_small_patch16_224)")
    p.add_argument("--dataset", help="dataset name (default: the one the run trained on)")
    p.add_argument("--data-dir", help="where the dataset's files are (default: where the run read them)")
    p.add_argument("--split", help="the split evaluated (default: the one the run evaluated on, else test)")
    p.add_argument("--batch-size", type=at_least(1), default=500, help="images a forward (default: 500)")
    p.add_argument("--flip", action="store_true",
                   help="test-time augmentation: average the logits of each image and its mirror image "
                        "(runs trained with eval_flip, like the fmnist_best preset, report this accuracy)")
    p.add_argument("--shift", type=at_least(0), default=0, metavar="PX",
                   help="test-time augmentation: also average each image moved PX pixels left, right, up and "
                        "down (with --flip, 10 views; runs trained with final_eval_shift report this accuracy)")
    p.add_argument("--out", type=nonempty_path, help="write confusion.png and eval.json here")
    add_overwrite_flag(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--amp", choices=("fp32", "bf16"), default="fp32",
                   help="fp32, or bf16: under bfloat16 autocast, as the training loop evaluates a run that trains in "
                        "bfloat16 (the default on CPUs with AVX512-BF16 or AMX), which gives its figure; greedy "
                        "captions can differ between the two where two words nearly tie (default: fp32)")
    g = p.add_argument_group("captioning and translation runs (vitscope train --task caption | translate)",
                             "captioning: BLEU-1..4 and CIDEr-D (on Fashion-MNIST scenes also item accuracy, exact "
                             "match and attention grounding); translation: exact match, token accuracy, BLEU-4 and "
                             "alignment; each for greedy decoding and for beam search of size --beam")
    add_decoding_options(g, beam_default=BEAM)
    add_kernels_flag(p)
    p.set_defaults(run=run_eval)


def run_eval(args) -> int:
    import torch

    from vitscope.caption.run import is_caption_checkpoint
    from vitscope.training.loop import evaluate
    from vitscope.translate.run import is_translation_checkpoint
    from vitscope.weights.model_source import load_data, open_model

    # a flag the run's kind reads none of is refused, not ignored in silence
    views = [flag for flag, given in (("--flip", args.flip), ("--shift", args.shift != 0)) if given]
    if is_translation_checkpoint(args.checkpoint):
        from vitscope.cli.translate import run_translation_eval

        unused = views + [flag for flag, given in (("--data-dir", args.data_dir is not None), ("--vocab", args.vocab))
                          if given]
        if unused:
            raise UsageError(f"{', '.join(unused)}: {args.checkpoint} is a translator, evaluated on its own test "
                             f"sentences with its own vocabularies; drop {'it' if len(unused) == 1 else 'them'}")
        return run_translation_eval(args)
    if is_caption_checkpoint(args.checkpoint):
        if views:
            raise UsageError(f"{', '.join(views)}: test-time views, for classifiers; {args.checkpoint} is a "
                             f"captioner, whose captions a mirror or a shift would change: drop "
                             f"{'it' if len(views) == 1 else 'them'}")
        return run_caption_eval(args)
    decoding = [flag for flag, given in (("--beam", args.beam != BEAM), ("--max-len", args.max_len is not None),
                                         ("--length-penalty", args.length_penalty != 0.0),
                                         ("--no-repeat-ngram", args.no_repeat_ngram != 0), ("--vocab", args.vocab))
                if given]
    if decoding:  # else ignored in silence
        raise UsageError(f"{', '.join(decoding)}: decoding options, for captioning and translation runs; "
                         f"{args.checkpoint} is a classifier, evaluated without them")
    out = check_out_dir(args.out, writes=("confusion.png", "eval.json"), overwrite=args.overwrite) if args.out else None
    model, info = open_model(args.checkpoint, kernels=args.kernels)
    name = args.dataset or info.dataset
    if not name:
        raise UsageError("this checkpoint does not say which dataset it was trained on; pass --dataset")
    data, split = load_data(model, info, name, args.split, args.data_dir)
    if model.num_classes != len(data.classes):
        raise UsageError(f"the model has {model.num_classes} outputs but {name} has {len(data.classes)} classes: "
                         f"evaluate it on the data it was trained on (fine-tune it first: vitscope train "
                         f"--pretrained true, or --config)")
    _check_images_fit(model, data.images)
    if info.named_classes and list(info.classes) != list(data.classes):
        raise UsageError(f"the checkpoint's classes ({listed(info.classes)}, from {info.dataset or 'its run'}) "
                         f"are not {name}'s ({listed(data.classes)}): its accuracy there would mean nothing; "
                         f"evaluate on the data it was trained on, with the same class folders")
    res = evaluate(model, data, info.mean, info.std, batch_size=args.batch_size, bf16=args.amp == "bf16",
                   device=torch.device("cpu"), flip=args.flip, shift=args.shift)
    conf = res["confusion"]
    per_class = {c: float(conf[i, i] / max(conf[i].sum(), 1)) for i, c in enumerate(data.classes)}
    summary = {"checkpoint": info.source, "dataset": name, "split": split, "amp": args.amp, "flip": args.flip,
               "shift": args.shift, "n": int(conf.sum()),
               "accuracy": res["acc"], "loss": res["loss"], "per_class_accuracy": per_class,
               "confusion": conf.tolist()}
    if out is not None:
        from vitscope.training.curves import plot_confusion

        out.mkdir(parents=True, exist_ok=True)
        plot_confusion(conf, data.classes, out / "confusion.png", title=f"accuracy {100 * res['acc']:.2f}%")
        (out / "eval.json").write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{name} {split}: {summary['n']} images, accuracy {100 * res['acc']:.2f}%, loss {res['loss']:.4f}")
        width = max(len(c) for c in data.classes)
        for c, acc in per_class.items():
            print(f"  {c:<{width}}  {100 * acc:6.2f}%")
    return 0


def _check_images_fit(model, images) -> None:
    c = images.shape[1]
    if c != model.config.in_chans:
        raise UsageError(f"the model takes {model.config.in_chans}-channel images but the data has {c}")
    h, w = images.shape[-2:]
    p = model.config.patch_size
    if h % p or w % p:
        raise UsageError(f"images of {h}x{w} cannot be cut into {p}x{p} patches; pass --image-size "
                         f"as a multiple of {p}")


# -- captioning runs ------------------------------------------------------------------------------------
COLUMNS = (("bleu1", "BLEU-1"), ("bleu2", "BLEU-2"), ("bleu3", "BLEU-3"), ("bleu4", "BLEU-4"), ("cider", "CIDEr-D"),
           ("item_accuracy", "items"), ("exact_match", "exact"), ("grounding", "grounding"))


def run_caption_eval(args) -> int:
    """`vitscope eval RUN` for a captioning run: greedy and beam decoding on a split, side by side."""
    from vitscope.caption.builders import CAPTION_DATASETS, load_caption_dataset
    from vitscope.caption.evaluate import evaluate_captions
    from vitscope.training.options import nest_task_options

    out_dir = check_out_dir(args.out, writes=("eval.json",), overwrite=args.overwrite) if args.out else None
    options = decode_options(args)
    run = open_caption_run(args.checkpoint, vocab=args.vocab, options=options, kernels=args.kernels)
    name = args.dataset or run.dataset
    if not name:
        raise UsageError("this checkpoint does not say which dataset it was trained on; pass --dataset")
    if name not in CAPTION_DATASETS:
        raise UsageError(f"{name} is not a caption dataset; a captioner is evaluated on one of "
                         f"{', '.join(CAPTION_DATASETS)}")
    cfg = nest_task_options(run.train_config) if name == run.dataset else {}
    caption = cfg.get("caption") if isinstance(cfg.get("caption"), dict) else {}
    image = cfg.get("image") if isinstance(cfg.get("image"), dict) else {}
    split = args.split or cfg.get("eval_split") or "test"
    data = load_caption_dataset(name, split, root=args.data_dir or image.get("data_dir"), image_size=run.image_size[0],
                                channels=run.channels, captions_file=caption.get("captions_file"))
    if tuple(data.images.shape[1:]) != (run.channels, *run.image_size):
        raise UsageError(f"{name} {split} has images of {tuple(data.images.shape[1:])} but the model reads "
                         f"{(run.channels, *run.image_size)}: evaluate it on the data it was trained on")
    rows = {}
    for beam in dict.fromkeys((1, args.beam)):
        result = evaluate_captions(run.model, data, run.vocab, mean=run.mean, std=run.std,
                                   **{**options.kwargs(), "beam": beam}, batch_size=args.batch_size,
                                   bf16=args.amp == "bf16")
        rows["greedy" if beam == 1 else f"beam {beam}"] = result
    summary = {"checkpoint": str(run.source), "dataset": name, "split": split, "amp": args.amp, "images": len(data),
               "decoding": {k: r.metrics for k, r in rows.items()},
               "examples": {k: [" ".join(w) for w in r.captions[:5]] for k, r in rows.items()}}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "eval.json").write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    shown = [(k, label) for k, label in COLUMNS if any(k in r.metrics for r in rows.values())]
    print(f"{name} {split}: {len(data)} images, {sum(map(len, data.captions))} reference captions")
    print(f"{'decoding':<10}" + "".join(f"{label:>10}" for _, label in shown) + f"{'best layer':>12}")
    for key, r in rows.items():
        m = r.metrics
        cells = "".join(f"{100 * m[k]:>9.2f}%" if k in ("item_accuracy", "exact_match", "grounding")
                        else f"{m[k]:>10.4f}" for k, _ in shown)
        layers = m.get("grounding_per_layer") or []
        best = f"{max(layers) * 100:.2f}% (L{layers.index(max(layers))})" if layers else ""
        print(f"{key:<10}{cells}{best:>12}")
    for key, r in rows.items():
        print(f"{key}: {' '.join(r.captions[0])}")
    return 0
