"""The host's share of an eager forward: Python and dispatch time where compute is negligible.

    python benchmarks/host_overhead.py

1. A 12-block ViT so small (width 64, 32×32 images, patch 16, batch 2, one thread) that its forward on the
   CPU is almost all Python and dispatch: vitscope against transformers' ViT (sdpa) and vit-pytorch, in
   inference and with a backward, best of 5 × 50 calls. This is the CPU path (vitscope's kernel checks and
   kernels included).
2. The path a GPU takes, without a GPU: vitscope's ViT-S/16 forward on the meta device (no data; every CPU
   kernel check answers no, as on a GPU), counted with cProfile: Python calls inside vitscope per forward.
   Each is host time a GPU's launches wait on when its kernels are short.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import _machine  # noqa: E402
import bench_vit  # noqa: E402
from vitscope.models import create_model  # noqa: E402


def tiny_models() -> dict[str, torch.nn.Module]:
    from transformers import ViTConfig, ViTForImageClassification

    d, depth, heads, img, p = 64, 12, 4, 32, 16
    hf = ViTForImageClassification._from_config(
        ViTConfig(hidden_size=d, num_hidden_layers=depth, num_attention_heads=heads, intermediate_size=4 * d,
                  image_size=img, patch_size=p, num_labels=10), attn_implementation="sdpa")
    models = {"vitscope": create_model("vit_small_patch16_224", img_size=img, embed_dim=d, depth=depth,
                                       num_heads=heads, num_classes=10),
              "transformers (sdpa)": hf}
    try:
        models["vit-pytorch"] = bench_vit.load_vit_pytorch()(
            image_size=img, patch_size=p, num_classes=10, dim=d, depth=depth, heads=heads, mlp_dim=4 * d,
            dim_head=d // heads)
    except ModuleNotFoundError as e:
        print(f"vit-pytorch skipped: {e}")
    return models


def per_call_ms(name: str, model: torch.nn.Module, train: bool) -> float:
    x = torch.randn(2, 3, 32, 32)
    model.train(train)
    forward = (lambda: model(pixel_values=x).logits) if name.startswith("transformers") else (lambda: model(x))

    def call():
        if train:
            forward().sum().backward()
        else:
            with torch.inference_mode():
                forward()

    for _ in range(20):
        call()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(50):
            call()
        best = min(best, (time.perf_counter() - t0) / 50)
    return best * 1e3


def vitscope_calls_on_meta(train: bool, reps: int = 10) -> int:
    with torch.device("meta"):
        model = create_model("vit_small_patch16_224", num_classes=10).train(train)
        x = torch.randn(128, 3, 224, 224)

    def forward():
        if train:
            model(x).float().sum().backward()
        else:
            with torch.inference_mode():
                model(x)

    forward()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        forward()
    prof.disable()
    stats = pstats.Stats(prof).stats
    return round(sum(v[1] for k, v in stats.items() if "/vitscope/" in k[0]) / reps)


def main() -> None:
    torch.set_num_threads(1)
    print(_machine.machine_header())
    print("\n| tiny 12-block ViT on the CPU | inference ms | forward + backward ms |\n|---|---:|---:|")
    for name, model in tiny_models().items():
        print(f"| {name} | {per_call_ms(name, model, False):.2f} | {per_call_ms(name, model, True):.2f} |")
    print("\n| vitscope ViT-S/16 on the meta device (a GPU's path) | Python calls in vitscope per forward |")
    print("|---|---:|")
    for train in (False, True):
        print(f"| {'training (forward and backward)' if train else 'inference'} | {vitscope_calls_on_meta(train):,} |")


if __name__ == "__main__":
    main()
