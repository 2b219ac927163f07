"""Why tutorial 4's Show, Attend and Tell did not attend: its LSTM run, one setting changed at a time.

    python benchmarks/tutorial4_lstm.py classifier            # the tutorial's encoder start, 2 epochs (~84%)
    python benchmarks/tutorial4_lstm.py classifier --epochs 5 --out runs/t4/classifier5
    python benchmarks/tutorial4_lstm.py classifier --quick    # the README's encoder, fmnist_quick for 1 epoch
    python benchmarks/tutorial4_lstm.py lstm --name base                        # the tutorial's old setting
    python benchmarks/tutorial4_lstm.py lstm --name new --widths 128,256,128 --epochs 2 --lr 2e-3

`lstm` trains the tutorial's captioner through vitscope's loop on the first --train training scenes (all 20,000
by default; the loop evaluates each epoch on the first 300 test scenes) and prints greedy and beam-5 item
accuracy and grounding on those 300, as the tutorial scores them. One thread. Every number comes from this run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from vitscope.caption import builders as captioning
from vitscope.caption import evaluate_captions, load_scenes
from vitscope.caption.run import open_captioner
from vitscope.data.transforms import TrainTransform
from vitscope.training.loop import TrainConfig, train
from vitscope.training.options import CaptionOptions, ImageOptions
from vitscope.training.recipes import get_recipe

TUTORIAL_ENCODER = dict(embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0, pos_embed="sincos2d", class_token=False,
                        global_pool="avg")


def classifier(args) -> None:
    if args.quick:
        quick = get_recipe("fmnist_quick")
        cfg = dataclasses.replace(quick, epochs=args.epochs, image=dataclasses.replace(quick.image, eval_flip=False))
    else:
        image = ImageOptions(model="vit_tiny_patch7_28", model_args=TUTORIAL_ENCODER,
                             augment=TrainTransform(crop="none", flip=True))
        cfg = TrainConfig(image=image, epochs=args.epochs, batch_size=128, lr=2e-3, warmup_epochs=0.2)
    torch.manual_seed(0)
    r = train(dataclasses.replace(cfg, explain_images=0, threads=1), Path(args.out), progress=False)
    print(f"{args.out}: {r.value:.2%} test accuracy")


def lstm(args) -> None:
    load = captioning.load_caption_dataset

    def first(name, split, **kw):  # the loop reads its scenes through this
        return load(name, split, **kw).subset(range(args.train if split == "train" else args.test))

    captioning.load_caption_dataset = first
    model, model_args = ("vit_fmnist_quick", {}) if args.quick else ("vit_tiny_patch7_28", TUTORIAL_ENCODER)
    embed, hidden, attn = map(int, args.widths.split(","))
    out = Path(args.runs) / args.name
    start = time.perf_counter()
    image = ImageOptions(model=model, model_args=model_args, init_weights=args.encoder,
                         augment=TrainTransform(crop="none", flip=False))
    train(TrainConfig(task="caption", dataset="fmnist_scenes", image=image, batch_size=args.batch, optimizer="adamw",
                      weight_decay=0.05, warmup_epochs=args.warmup, label_smoothing=0.1, eval_batch_size=500,
                      explain_images=0, epochs=args.epochs, lr=args.lr, seed=args.seed, threads=1,
                      caption=CaptionOptions(
                          captioner="lstm", max_len=40,
                          decoder_args=dict(embed_dim=embed, hidden_dim=hidden, attn_dim=attn, drop=0.1,
                                            attention_reg=args.reg, memory_pos=True, memory=args.memory))),
          out, progress=False)
    row = {"name": args.name, "wall_s": round(time.perf_counter() - start)}
    run = open_captioner(out)
    test = load_scenes("test").subset(range(300))
    for beam in (1, 5):
        m = evaluate_captions(run.model, test, run.vocab, mean=run.mean, std=run.std, beam=beam).metrics
        row.update({f"beam{beam}_{k}": round(m[k], 3) for k in ("item_accuracy", "grounding", "bleu1")})
    print(json.dumps(row))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("classifier")
    c.add_argument("--epochs", type=int, default=None, help="2 (tutorial) or 1 (--quick)")
    c.add_argument("--quick", action="store_true")
    c.add_argument("--out", default=None)
    t = sub.add_parser("lstm")
    t.add_argument("--name", required=True)
    t.add_argument("--encoder", default="runs/t4/classifier/best.safetensors")
    t.add_argument("--quick", action="store_true", help="the encoder is vit_fmnist_quick (give its --encoder)")
    t.add_argument("--runs", default="runs/t4")
    t.add_argument("--train", type=int, default=20_000)
    t.add_argument("--test", type=int, default=300)
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=float, default=0.1)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--widths", default="64,128,64", help="embed, hidden, attn")
    t.add_argument("--reg", type=float, default=1.0)
    t.add_argument("--memory", choices=("tokens", "stem"), default="tokens")
    t.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "classifier":
        args.epochs = args.epochs or (1 if args.quick else 2)
        args.out = args.out or ("runs/t4/quick" if args.quick else "runs/t4/classifier")
        classifier(args)
    else:
        lstm(args)


if __name__ == "__main__":
    main()
