"""Masked patch prediction, then labels: a small ViT whose heads do become local.

    python benchmarks/locality_mim.py                 # the run tutorial 2 loads (30-40 minutes on one core)
    python benchmarks/locality_mim.py --mim-steps 0   # labels alone, for comparison
    python benchmarks/locality_mim.py --out DIR --pos-embed learn
    python benchmarks/locality_mim.py --out DIR --noise 2.0  # every patch noisy too: denoise them all

Trained on labels alone, tutorial 2's ViT keeps every head near the mean distance of uniform attention
(`locality_study.py`: six changes, none made a head local). Here the same kind of model first learns a task in
which neighbours are the evidence: the ViT paper's own self-supervision (Dosovitskiy et al. 2021, section 4.6,
"masked patch prediction"), in SimMIM's form (Xie et al. 2022). A random share of the patches is hidden (their
embeddings replaced by one learned mask token, their positions kept) and a linear layer on the last block's
tokens paints the hidden patches' pixels back (L1 loss on the hidden ones, pixels normalised as training
normalises them). Then the whole ViT is fine-tuned on the labels for a few epochs with a new head.

It writes to --out (default runs/locality_mim):
- `mim.safetensors`: the ViT after masked patch prediction (its classification head untrained);
- `finetuned.safetensors`: the same after fine-tuning on labels. Tutorial 2 loads both:
  `cp runs/locality_mim/mim.safetensors docs/tutorials/checkpoints/vit_fmnist_mim.safetensors`,
  `cp runs/locality_mim/finetuned.safetensors docs/tutorials/checkpoints/vit_fmnist_mim_ft.safetensors` and
  `cp runs/locality_mim/history.json docs/tutorials/checkpoints/locality_mim.json` (its noise section: the run
  `--noise 2.0 --out runs/locality_denoise`, copied to the same names with `denoise` for `mim`);
- `history.json`: every head's mean attention distance (vitscope.inspect.stats.mean_distance, on 256 test
  images) every --every steps of both stages, the losses, the test accuracy, and this command.

With `--noise S` every pixel of the input also gets Gaussian noise of standard deviation S (in normalised units)
and the loss covers every patch: the hidden ones painted back, the visible ones denoised (the two L1 means
added). A noisy patch is best cleaned with its neighbours' help, and every token is such a patch, the first
layer's included, where hiding alone asks only the hidden tokens to look around.

Each stage uses AdamW (weight decay 0.05) with a warm-up and a cosine decay, batch 128, one thread.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from vitscope import VisionTransformer
from vitscope.data import eval_transform, load_dataset
from vitscope.inspect import capture_attention
from vitscope.inspect.stats import entropy, mean_distance
from vitscope.weights import save_model


def masked_tokens(model: VisionTransformer, x: torch.Tensor, hidden: torch.Tensor, mask_token: torch.Tensor):
    """The ViT's tokens (B, 1 + N, D) with the `hidden` patches' (B, N) embeddings replaced by the mask token,
    positions added to all: `VisionTransformer.embed` with one substitution."""
    gh, gw = model.patch_embed.check(x)
    t = model.patch_embed(x)  # (B, N, D)
    t = torch.where(hidden[..., None], mask_token.expand_as(t), t)
    t = torch.cat([model.cls_token.expand(t.shape[0], -1, -1), t], dim=1)
    return t + model._pos_for_grid(gh, gw, t)


def head_distances(model: VisionTransformer, images: torch.Tensor) -> tuple[list, list]:
    """(layers, heads) mean attention distance in pixels and entropy in nats on `images`, as lists."""
    cap = capture_attention(model, images)
    return ([[round(float(d), 2) for d in mean_distance(w, cap.layout)] for w in cap.layers()],
            [[round(float(e), 3) for e in entropy(w)] for w in cap.layers()])


def schedule(step: int, steps: int, lr: float, warmup: int) -> float:
    return lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))


def accuracy(model: VisionTransformer, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.inference_mode():
        right = sum(int((model(x[i:i + 1000]).argmax(-1) == y[i:i + 1000]).sum()) for i in range(0, len(x), 1000))
    model.train()
    return right / len(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/locality_mim"))
    ap.add_argument("--patch", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--pos-embed", default="sincos2d", choices=["sincos2d", "learn"])
    ap.add_argument("--mask-ratio", type=float, default=0.3, help="share of the patches hidden (default 0.3)")
    ap.add_argument("--mim-steps", type=int, default=4000)
    ap.add_argument("--finetune-steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--every", type=int, default=500, help="steps between readings of the heads' distances")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.0,
                    help="standard deviation of Gaussian noise added to every input pixel; the loss then also "
                         "covers the visible patches (default 0: hiding only)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    train, test = load_dataset("fashion_mnist", "train"), load_dataset("fashion_mnist", "test")
    x_train = eval_transform(train.images, train.mean, train.std)  # (60000, 1, 28, 28) float
    x_test = eval_transform(test.images, train.mean, train.std)
    probe = x_test[:256]
    model = VisionTransformer(img_size=28, patch_size=args.patch, in_chans=1, num_classes=10, embed_dim=args.width,
                              depth=args.depth, num_heads=args.heads, mlp_ratio=2, pos_embed=args.pos_embed)
    gh, gw = model.patch_embed.grid_size
    n, p = gh * gw, args.patch
    history = {"command": "python " + shlex.join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()},
               "readings": []}

    def read(stage: str, step: int, loss: float) -> None:
        distance, ent = head_distances(model, probe)
        history["readings"].append({"stage": stage, "step": step, "loss": round(loss, 4), "distance": distance,
                                    "entropy": ent})
        print(f"{stage} {step:5d}  loss {loss:.4f}  distance per layer (mean of heads) "
              + ", ".join(f"{sum(d) / len(d):.1f}" for d in distance), flush=True)

    # Stage 1: paint the hidden patches back. The mask token and the pixel head exist only here.
    mask_token = nn.Parameter(torch.zeros(1, 1, args.width))
    nn.init.trunc_normal_(mask_token, std=0.02)
    pixels = nn.Linear(args.width, p * p)
    params = [*model.parameters(), mask_token, *pixels.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.05)
    start = time.perf_counter()
    loss = float("nan")
    read("mim", 0, loss)
    for step in range(args.mim_steps):
        for g in opt.param_groups:
            g["lr"] = schedule(step, args.mim_steps, args.lr, 200)
        x = x_train[torch.randint(0, len(x_train), (args.batch,))]
        hidden = torch.rand(args.batch, n) < args.mask_ratio  # (B, N)
        noisy = x + args.noise * torch.randn_like(x) if args.noise > 0 else x
        tokens = model.norm(model.run_blocks(masked_tokens(model, noisy, hidden, mask_token)))[:, 1:]  # (B, N, D)
        target = rearrange(x, "b c (h p) (w q) -> b (h w) (c p q)", p=p, q=p)  # (B, N, p·p)
        per_patch = F.l1_loss(pixels(tokens), target, reduction="none").mean(-1)  # (B, N)
        loss_t = (per_patch * hidden).sum() / hidden.sum().clamp_min(1)
        if args.noise > 0:  # the visible patches, denoised
            loss_t = loss_t + (per_patch * ~hidden).sum() / (~hidden).sum().clamp_min(1)
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        opt.step()
        loss = float(loss_t.detach())
        if (step + 1) % args.every == 0:
            read("mim", step + 1, loss)
    save_model(model, args.out / "mim.safetensors", metadata={"stage": "masked patch prediction",
                                                               "command": history["command"]})
    history["mim_seconds"] = round(time.perf_counter() - start, 1)

    # Stage 2: labels, a new head, every weight trained.
    model.reset_classifier(10)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    start = time.perf_counter()
    for step in range(args.finetune_steps):
        for g in opt.param_groups:
            g["lr"] = schedule(step, args.finetune_steps, args.lr, 100)
        idx = torch.randint(0, len(x_train), (args.batch,))
        loss_t = F.cross_entropy(model(x_train[idx]), train.labels[idx])
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        opt.step()
        if (step + 1) % args.every == 0 or step + 1 == args.finetune_steps:
            read("finetune", step + 1, float(loss_t.detach()))
    history["finetune_seconds"] = round(time.perf_counter() - start, 1)
    history["test_acc"] = accuracy(model, x_test, test.labels)
    print(f"test accuracy after fine-tuning: {history['test_acc']:.2%}")
    save_model(model, args.out / "finetuned.safetensors",
               metadata={"stage": "fine-tuned on labels after masked patch prediction", "command": history["command"],
                         "test_acc": history["test_acc"]})
    (args.out / "history.json").write_text(json.dumps(history, indent=1))


if __name__ == "__main__":
    main()
