"""Whole-ViT speed and memory on this machine: vitscope against the ViTs users pick instead.

Training steps (forward, cross-entropy, backward, AdamW step, zero_grad) and inference forwards
(in `torch.inference_mode`), in images/s, for the same model shape in several implementations:

  vitscope             vitscope.models.create_model(..., kernels=True): the preset, plus overrides for the
                       shape, with vitscope's CPU kernels swapped in (vitscope.kernels.apply), as
                       `vitscope train` and `vitscope eval` run it
  transformers sdpa    transformers' ViTForImageClassification, attn_implementation="sdpa"
  transformers eager   the same with attn_implementation="eager"
  vit-pytorch          lucidrains' vit_pytorch.vit.ViT (optional, see VIT_PYTORCH_INSTALL)
  tutorial             the tutorials' ViT as they wrote it (benchmarks/_tutorial_vit.py)

Shapes: `fmnist_plain` (28x28x1, patch 4, width 128, depth 6, heads 4, MLP 512, batch 256) and
`vit_s16` (ViT-S/16, 224x224x3, batch 32 training / 64 inference) in every implementation, and
vitscope's Fashion-MNIST preset model `vit_fmnist_quick` (conv stem; vitscope only; both recipes train it).
Each in float32 and in bfloat16 autocast, eager and under torch.compile. Every case runs in a
fresh Python process, so its peak memory is its own; each process keeps its freed memory, as
`vitscope eval` does (vitscope/kernels/allocator.py; `--malloc default` for glibc's own behaviour).

    .venv/bin/python benchmarks/bench_vit.py                          # full run, ~20-25 min on 2 cores
    .venv/bin/python benchmarks/bench_vit.py --passes 3               # every case 3 times, median pass (~40 min)
    .venv/bin/python benchmarks/bench_vit.py --no-compile             # skip the torch.compile rows
    .venv/bin/python benchmarks/bench_vit.py --quick                  # smoke run: small batches, few steps
    .venv/bin/python benchmarks/bench_vit.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import rate_text  # noqa: E402
from _workers import run_worker  # noqa: E402
from bench_attention import (  # noqa: E402  (shared helpers of the benchmark scripts)
    MALLOC,
    _background_cores,
    _kernel_used,
    _release_free_memory,
    _reset_peak_rss,
    _rss_bytes,
    add_malloc_flag,
    apply_malloc,
    default_dtypes,
    run_peak,
    wait_for_quiet,
    write_section,
)

SECTION = "## ViT training and inference (benchmarks/bench_vit.py)"
IMPLS = ("vitscope", "hf-sdpa", "hf-eager", "vit-pytorch", "tutorial")
LABELS = {"vitscope": "vitscope", "hf-sdpa": "transformers (sdpa)", "hf-eager": "transformers (eager)",
          "vit-pytorch": "vit-pytorch", "tutorial": "tutorial"}
DTYPES = ("float32", "bfloat16")
MODES = ("train", "infer")

# --no-deps: vit-pytorch declares torchvision, which pip would fetch built for another torch (it fails to load
# against this CPU build); its vit.py needs only torch and einops. The version is pinned in constraints.txt.
VIT_PYTORCH_INSTALL = ".venv/bin/pip install --no-deps -c constraints.txt vit-pytorch"

# Each shape is a vitscope preset plus overrides; `plain` shapes (CLS token, learned positions, qkv
# bias, Linear patch embedding) are built in every implementation from the same numbers.
SHAPES: dict[str, dict] = {
    "fmnist_plain": dict(preset="vit_tiny_patch4_28", overrides={"mlp_ratio": 4.0}, plain=True,
                         batch={"train": 256, "infer": 256}, quick_batch={"train": 32, "infer": 64},
                         title="Fashion-MNIST plain ViT (28×28×1, patch 4, width 128, depth 6, heads 4, MLP 512)"),
    "vit_s16": dict(preset="vit_small_patch16_224", overrides={}, plain=True,
                    batch={"train": 32, "infer": 64}, quick_batch={"train": 2, "infer": 4},
                    title="ViT-S/16 (224×224×3, patch 16, width 384, depth 12, heads 6, MLP 1536, 1000 classes)"),
    "fmnist_quick": dict(preset="vit_fmnist_quick", overrides={}, plain=False,
                         batch={"train": 128, "infer": 128}, quick_batch={"train": 32, "infer": 32},
                         title="vitscope preset `vit_fmnist_quick` "
                               "(five-conv stem to 7×7 tokens, width 128, depth 2)"),
}
# torch.compile takes 15-40 s per case on 2 cores: by default only the baseline shape's training gets it.
COMPILE_SHAPES = ("fmnist_plain",)
COMPILE_MODES = ("train",)


def shape_config(name: str):
    from vitscope.models import get_config

    s = SHAPES[name]
    return get_config(s["preset"], **s["overrides"])


def forward_flops(cfg, executed: bool = False) -> int:
    """Matmul and conv FLOPs of one image's forward pass (2 per multiply-add); training is 3x this.

    These are the model's FLOPs, the same for every implementation. `executed=True` counts what
    vitscope runs instead: with token pooling its last block computes the class token's output alone
    (keys and values for every token, one query, one token through proj and the MLP)."""
    img = cfg.img_size if isinstance(cfg.img_size, int) else cfg.img_size[0]
    flops, size, chans = 0, img, cfg.in_chans
    for out, stride in cfg.stem:  # 3x3 convs, padding 1
        size //= stride
        flops += 2 * size * size * out * chans * 9
        chans = out
    grid = img // cfg.patch_size
    k = cfg.patch_size * size // img  # the patch conv's kernel on the stem's map
    d, t, hidden = cfg.embed_dim, grid * grid + (1 if cfg.class_token else 0), int(cfg.embed_dim * cfg.mlp_ratio)
    flops += 2 * grid * grid * d * chans * k * k
    def block(queries: int) -> int:
        return 2 * t * d * 3 * d + 2 * 2 * queries * t * d + 2 * queries * d * d + 2 * 2 * queries * d * hidden

    if executed and cfg.global_pool == "token" and cfg.depth:
        return flops + (cfg.depth - 1) * block(t) + block(1) + 2 * d * cfg.num_classes
    return flops + cfg.depth * block(t) + 2 * d * cfg.num_classes


# ----------------------------------------------------------------------------------------------
# Worker: one case in a fresh process.


def load_vit_pytorch():
    """vit_pytorch.vit.ViT, loaded from its file: the package's __init__ imports torchvision (via
    its DINO module), which this project does not install; vit.py itself needs only torch and einops."""
    spec = importlib.util.find_spec("vit_pytorch")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"vit-pytorch is not installed: {VIT_PYTORCH_INSTALL}")
    path = Path(spec.submodule_search_locations[0]) / "vit.py"
    module_spec = importlib.util.spec_from_file_location("_vit_pytorch_vit", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.ViT


def hf_vit(cfg, attention: str):
    """transformers' ViTForImageClassification with `cfg`'s shape (vitscope's ViTConfig: CLS token, learned
    positions, qkv bias, Linear patch embedding), dropout 0 and `attention` ("sdpa" or "eager"), called as the
    others are: images -> logits. Shared with bench_vit224.py."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    hf_cfg = ViTConfig(hidden_size=cfg.embed_dim, num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads,
                       intermediate_size=int(cfg.embed_dim * cfg.mlp_ratio), image_size=cfg.img_size,
                       patch_size=cfg.patch_size, num_channels=cfg.in_chans, num_labels=cfg.num_classes,
                       layer_norm_eps=cfg.norm_eps, qkv_bias=cfg.qkv_bias, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    model = ViTForImageClassification._from_config(hf_cfg, attn_implementation=attention)
    if model.config._attn_implementation != attention:
        raise RuntimeError(f"transformers chose attention {model.config._attn_implementation!r}")

    class Logits(torch.nn.Module):
        def __init__(self, hf):
            super().__init__()
            self.hf = hf

        def forward(self, x):
            return self.hf(pixel_values=x).logits

    return Logits(model)


def build_model(impl: str, shape: str, *, kernels: bool = True):
    """The model for (impl, shape) in float32, with the same width, depth, heads and MLP width; vitscope's
    with its kernels swapped in (vitscope.kernels.apply) unless `kernels` is False (a plain vitscope model
    is PyTorch alone, which is not what `vitscope train` runs on a CPU)."""
    cfg = shape_config(shape)
    if impl == "vitscope":
        from vitscope.models import create_model

        s = SHAPES[shape]
        return create_model(s["preset"], kernels=kernels, **s["overrides"])
    img, p, c, d = cfg.img_size, cfg.patch_size, cfg.in_chans, cfg.embed_dim
    hidden = int(d * cfg.mlp_ratio)
    if impl in ("hf-sdpa", "hf-eager"):
        return hf_vit(cfg, impl.removeprefix("hf-"))
    if impl == "vit-pytorch":
        ViT = load_vit_pytorch()
        return ViT(image_size=img, patch_size=p, num_classes=cfg.num_classes, dim=d, depth=cfg.depth,
                   heads=cfg.num_heads, mlp_dim=hidden, channels=c, dim_head=d // cfg.num_heads,
                   dropout=0.0, emb_dropout=0.0)
    if impl == "tutorial":
        import _tutorial_vit

        return _tutorial_vit.VisionTransformer(
            embed_dim=d, hidden_dim=hidden, num_channels=c, num_heads=cfg.num_heads, num_layers=cfg.depth,
            num_classes=cfg.num_classes, patch_size=p, num_patches=(img // p) ** 2, dropout=0.0)
    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")


def _make_step(net, opt, x, y, train: bool, bf16: bool):
    import torch
    import torch.nn.functional as F

    if train:
        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        def step():
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                net(x)
    return step


def run_case(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    train, bf16 = spec["mode"] == "train", spec["dtype"] == "bfloat16"
    torch.manual_seed(0)
    model = build_model(spec["impl"], spec["shape"])
    params = sum(p.numel() for p in model.parameters())
    cfg = shape_config(spec["shape"])
    img = cfg.img_size if isinstance(cfg.img_size, int) else cfg.img_size[0]
    x = torch.randn(spec["batch"], cfg.in_chans, img, img)
    y = torch.randint(0, cfg.num_classes, (spec["batch"],))
    model.train(train)
    # Each implementation with the optimizer its own training code uses: vitscope.training.loop uses the fused
    # AdamW kernel; the others are shown with torch's default AdamW, as their examples use it.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=spec["impl"] == "vitscope") if train else None

    def tiny_forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(x[:2])

    path = {"fused": "sdpa", "explicit": "explicit", "vitscope kernel": "vitscope kernel"}[
        _kernel_used(tiny_forward, train)]  # observed
    net = torch.compile(model) if spec["compile"] else model
    step = _make_step(net, opt, x, y, train, bf16)
    base = {**spec, "params": params, "path": path}

    t0 = time.perf_counter()
    try:
        step()  # compiles, when compiling
    except Exception as e:  # noqa: BLE001  (any failure becomes a row saying why)
        what = "compile failed" if spec["compile"] else "failed"
        reason = (str(e).strip().splitlines() or [""])[0]
        return {**base, "error": f"{what}: {type(e).__name__}: {reason}"[:160]}
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(spec["warmup"]):  # stop early once warm-up has taken warmup_s (ViT-S steps take seconds)
        if i and spec["warmup_s"] and time.perf_counter() - t0 > spec["warmup_s"]:
            break
        step()

    gc.collect()
    _release_free_memory()
    rss_before = _rss_bytes("VmRSS")
    reset = _reset_peak_rss()
    times: list[float] = []

    def timed():
        t1 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t1)
        repeats = spec["steps"] or max(3, min(15, round(spec["target_s"] / max(times[0], 1e-6))))
        for _ in range(repeats - 1):
            t1 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t1)

    _, background = _background_cores(timed)
    if reset:
        step_peak = _rss_bytes("VmHWM") - rss_before
    else:  # cannot reset the high-water mark: whole-process peak, an upper bound
        step_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {**base, "first_s": first, "times_s": times, "background_cores": background,
            "step_peak_bytes": max(step_peak, 0), "process_peak_bytes": process_peak}


def worker(spec: dict) -> None:
    # Guard the shared machine: a case that outgrows its budget fails here instead of waking the
    # kernel's OOM killer, which might pick someone else's process.
    limit = int(spec.get("address_space_gb", 0) * 2**30)
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    apply_malloc(spec)
    result = run_peak(spec) if spec["kind"] == "peak" else run_case(spec)
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------
# Driver: spawn the cases, collect, print the tables.


def spawn(spec: dict, timeout_s: float = 1200, quiet_wait_s: float = 0.0) -> dict:
    if quiet_wait_s:
        wait_for_quiet(quiet_wait_s)
    env = dict(os.environ)
    cache = None
    if spec.get("compile"):  # a cold compile, as a user's first run sees it: no inductor cache from earlier cases
        cache = tempfile.mkdtemp(prefix="bench_vit_inductor_")
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        return run_worker(__file__, spec, timeout_s=timeout_s, env=env)
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)


def images_per_s(r: dict) -> float | None:
    return r["batch"] / statistics.median(r["times_s"]) if "times_s" in r else None


def median_pass(passes: list[dict]) -> dict:
    """The pass whose images/s is the median (the lower middle for an even count), whole, so every column
    of a row comes from one process; a case that failed in any pass is reported by its first failure."""
    failed = [r for r in passes if images_per_s(r) is None]
    if failed:
        return failed[0]
    ranked = sorted(passes, key=images_per_s)
    return {**ranked[(len(ranked) - 1) // 2], "passes_images_per_s": [images_per_s(r) for r in passes]}


def setting(r: dict) -> str:
    return ("bf16" if r["dtype"] == "bfloat16" else "fp32") + (", compiled" if r["compile"] else "")


def shape_table(rows: list[dict], peaks: dict[str, float]) -> str:
    """One shape's rows, grouped by mode, dtype and compile; vitscope first in each group."""
    lines = [
        "| mode | dtype | compile | implementation | attention | batch | images/s | vitscope ÷ this | IQR % "
        "| bg cores | GFLOP/s | % of mm peak | first step s | step MiB | process MiB | params |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {impl: i for i, impl in enumerate(IMPLS)}
    rows = sorted(rows, key=lambda r: (MODES.index(r["mode"]), DTYPES.index(r["dtype"]), r["compile"],
                                       order[r["impl"]]))
    for r in rows:
        head = (f"| {r['mode']} | {r['dtype']}{' autocast' if r['dtype'] == 'bfloat16' else ''} "
                f"| {'yes' if r['compile'] else 'no'} | {LABELS[r['impl']]} ")
        if "times_s" not in r:
            params = f"{r['params']:,}" if "params" in r else ""
            lines.append(head + f"| | {r['batch']} | {r.get('error', 'skipped')} | | | | | | | | | {params} |")
            continue
        ips = images_per_s(r)
        ref = next((v for v in rows if v["impl"] == "vitscope" and "times_s" in v
                    and all(v[k] == r[k] for k in ("mode", "dtype", "compile"))), None)
        ratio = f"{images_per_s(ref) / ips:.2f}" if ref is not None else ""
        t = statistics.median(r["times_s"])
        q1, _, q3 = statistics.quantiles(r["times_s"], n=4) if len(r["times_s"]) > 1 else (t, t, t)
        gflops = r["flops_per_image"] * (3 if r["mode"] == "train" else 1) * ips / 1e9
        peak = peaks.get(r["dtype"])
        lines.append(
            head + f"| {r['path']} | {r['batch']} | {rate_text(ips)} | {ratio} | {100 * (q3 - q1) / t:.0f} "
            f"| {r['background_cores']:.1f} | {gflops:.0f} | {f'{100 * gflops / peak:.0f}' if peak else ''} "
            f"| {r['first_s']:.1f} | {r['step_peak_bytes'] / 2**20:.0f} | {r['process_peak_bytes'] / 2**20:.0f} "
            f"| {r['params']:,} |"
        )
    return "\n".join(lines)


def _best(rows: list[dict], impls: tuple[str, ...], mode: str, dtype: str, compiled: bool) -> dict | None:
    """The fastest row of these implementations in this mode and dtype."""
    ok = [r for r in rows if r["impl"] in impls and r["mode"] == mode and r["dtype"] == dtype
          and r["compile"] == compiled and "times_s" in r]
    return max(ok, key=images_per_s) if ok else None


# vitscope's images/s over the best of the others (transformers' ViT with either attention, vit-pytorch and the
# tutorials' ViT), each in the same dtype and mode: the targets are for bfloat16 on CPUs that multiply it
# natively; float32 rows are shown without one.
TARGETS = {("train", "bfloat16"): 1.4, ("infer", "bfloat16"): 1.5}
OTHERS = ("hf-sdpa", "hf-eager", "vit-pytorch", "tutorial")


def targets_table(results: list[dict]) -> str:
    lines = ["| shape | mode | dtype | compile | vitscope images/s | best of the others | their images/s | ratio "
             "| ratio in each pass | target | met |", "|---|---|---|---|---:|---|---:|---:|---|---:|---|"]
    for shape in SHAPES:
        rows = [r for r in results if r["shape"] == shape]
        for compiled in (False, True):
            for mode in MODES:
                for dtype in DTYPES:
                    ours = _best(rows, ("vitscope",), mode, dtype, compiled)
                    theirs = _best(rows, OTHERS, mode, dtype, compiled)
                    if ours is None or theirs is None:
                        continue
                    ratio = images_per_s(ours) / images_per_s(theirs)
                    per_pass = " ".join(f"{a / b:.2f}" for a, b in zip(ours.get("passes_images_per_s", []),
                                                                        theirs.get("passes_images_per_s", [])))
                    target = TARGETS.get((mode, dtype))
                    met = "" if target is None else ("yes" if ratio >= target else "**no**")
                    lines.append(
                        f"| {shape} | {mode} | {dtype} | {'yes' if compiled else 'no'} "
                        f"| {rate_text(images_per_s(ours))} | {LABELS[theirs['impl']]} "
                        f"| {rate_text(images_per_s(theirs))} | {ratio:.2f} | {per_pass} "
                        f"| {'' if target is None else f'≥ {target}'} | {met} |")
    return "\n".join(lines)


def check_parameter_counts(shapes: list[str], impls: list[str]) -> None:
    """vitscope and transformers must build exactly the same model for a plain shape, or the comparison is
    unfair: count both (on the meta device, so nothing is allocated) before spending minutes on timing."""
    import torch

    for shape in shapes:
        if not SHAPES[shape]["plain"] or "vitscope" not in impls:
            continue
        counts = {}
        for impl in [i for i in impls if i == "vitscope" or i.startswith("hf-")]:
            with torch.device("meta"):
                counts[impl] = sum(p.numel() for p in build_model(impl, shape, kernels=False).parameters())
        for impl, n in counts.items():
            if n != counts["vitscope"]:
                sys.exit(f"{shape}: vitscope has {counts['vitscope']:,} parameters but {LABELS[impl]} has {n:,}; "
                         "the models differ, so the comparison would be unfair. Fix build_model in bench_vit.py.")


def _batches(values: list[str] | None, mode: str, quick: bool) -> dict[str, int]:
    """Per-shape batch sizes: the defaults, then `N` (every shape) or `shape=N` from the command line."""
    found = {name: s["quick_batch" if quick else "batch"][mode] for name, s in SHAPES.items()}
    for v in values or []:
        name, _, n = v.rpartition("=")
        if name and name not in SHAPES:
            sys.exit(f"--{mode}-batch {v}: unknown shape {name!r}; shapes are {', '.join(SHAPES)}")
        if not n.isdigit() or int(n) < 1:
            sys.exit(f"--{mode}-batch {v}: expected a positive integer, as N or SHAPE=N")
        for key in [name] if name else found:
            found[key] = int(n)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small batches, 1 warm-up and 3 timed steps, no compile unless --compile")
    parser.add_argument("--out", type=Path,
                        help="also write the markdown to this file (replacing only this script's section)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--cases", nargs="+", choices=list(SHAPES), default=list(SHAPES), metavar="SHAPE",
                        help=f"shapes to run (default all: {', '.join(SHAPES)})")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS), metavar="IMPL",
                        help=f"implementations (default all: {', '.join(IMPLS)}); presets run vitscope only")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None,
                        help="dtypes to run (default: both; float32 alone where bfloat16 matmuls are only emulated, "
                             "as on AVX2 CPUs, whose bfloat16 steps take minutes in every implementation)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also run every case under torch.compile (default: on, off with --quick)")
    parser.add_argument("--compile-cases", nargs="+", choices=list(SHAPES), default=list(COMPILE_SHAPES),
                        metavar="SHAPE", help=f"shapes that get compile rows (default: {', '.join(COMPILE_SHAPES)})")
    parser.add_argument("--compile-modes", nargs="+", choices=MODES, default=list(COMPILE_MODES),
                        help=f"modes that get compile rows (default: {', '.join(COMPILE_MODES)})")
    parser.add_argument("--train-batch", nargs="+", metavar="[SHAPE=]N",
                        help="training batch: N for every shape, or SHAPE=N (default: 256 fmnist_plain, "
                             "32 vit_s16, 128 presets)")
    parser.add_argument("--infer-batch", nargs="+", metavar="[SHAPE=]N",
                        help="inference batch, the same way (default: 256 fmnist_plain, 64 vit_s16, 128 presets)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up steps after the first (default: 2, or 1 when a step takes over 3 s; "
                             "1 with --quick)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps (default: enough to fill ~4 s, 3 to 15; 3 with --quick)")
    parser.add_argument("--quiet-wait", type=float, default=None,
                        help="before each case wait up to this many seconds for other load to drop "
                             "(default 3; 0 with --quick)")
    parser.add_argument("--max-gb", type=float, default=20.0,
                        help="address-space limit of each case's process in GiB (default 20)")
    parser.add_argument("--passes", type=int, default=1,
                        help="run every case this many times, pass after pass, and report each case's median "
                             "pass (the host's speed drifts by 10-20%% over minutes; 3 evens it out)")
    add_malloc_flag(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return

    import torch

    from _machine import machine_header

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    compile_on = (not args.quick) if args.compile is None else args.compile
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    warmup_s = 3.0 if args.warmup is None else 0.0  # 0: exactly --warmup steps
    steps = args.steps if args.steps is not None else (3 if args.quick else 0)  # 0: fill target_s
    quiet = args.quiet_wait if args.quiet_wait is not None else (0.0 if args.quick else 3.0)
    batches = {mode: _batches(getattr(args, f"{mode}_batch"), mode, args.quick) for mode in MODES}
    args.dtypes = args.dtypes or default_dtypes()
    impls = list(args.impls)
    if "vit-pytorch" in impls and importlib.util.find_spec("vit_pytorch") is None:
        print(f"note: vit-pytorch is not installed, so its rows are skipped; to add them: {VIT_PYTORCH_INSTALL}",
              file=sys.stderr)
        impls.remove("vit-pytorch")

    command = "python benchmarks/bench_vit.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = machine_header({"torch_threads": threads, "malloc": MALLOC[args.malloc]})
    out = [SECTION, "", f"Command: `{command.strip()}`", "", header, ""]
    print("\n".join(out), flush=True)

    check_parameter_counts(args.cases, impls)
    peak_spec = {"kind": "peak", "threads": threads, "sizes": [1024] if args.quick else [2048, 4096],
                 "repeats": 3 if args.quick else 6}

    def measure_peaks() -> dict[str, dict]:
        found = {}
        for dtype in args.dtypes:
            r = spawn({**peak_spec, "dtype": dtype})
            if "error" in r:
                sys.exit(f"measuring the {dtype} matmul peak failed: {r['error']}")
            found[dtype] = r
        return found

    # Measured before and after the cases (--quick: before only); the better counts, as background load
    # only lowers it.
    peaks_before = measure_peaks()

    specs = []
    for shape in args.cases:
        cfg = shape_config(shape)
        for mode in args.modes:
            for dtype in args.dtypes:
                with_compile = compile_on and shape in args.compile_cases and mode in args.compile_modes
                for compiled in (False, True) if with_compile else (False,):
                    for impl in impls if SHAPES[shape]["plain"] else ["vitscope"]:
                        if impl not in impls:
                            continue
                        specs.append({"kind": "case", "shape": shape, "impl": impl, "mode": mode, "dtype": dtype,
                                      "compile": compiled, "batch": batches[mode][shape], "threads": threads,
                                      "warmup": warmup, "warmup_s": warmup_s, "steps": steps, "target_s": 4.0,
                                      "flops_per_image": forward_flops(cfg), "address_space_gb": args.max_gb,
                                      "malloc": args.malloc})
    if args.passes < 1:
        sys.exit("--passes must be at least 1")
    runs: list[list[dict]] = [[] for _ in specs]  # each case's result in every pass
    start = time.monotonic()
    for n in range(args.passes):
        for i, spec in enumerate(specs):
            r = spawn(spec, quiet_wait_s=quiet)
            runs[i].append(r)
            ips = images_per_s(r)
            took = f"{rate_text(ips)} images/s (first step {r['first_s']:.1f} s)" if ips else r["error"]
            done = f"pass {n + 1}/{args.passes}, " if args.passes > 1 else ""
            print(f"  [{done}{i + 1}/{len(specs)} {time.monotonic() - start:.0f} s] {spec['shape']} {spec['mode']} "
                  f"{spec['dtype']} {'compiled ' if spec['compile'] else ''}{spec['impl']}: {took}",
                  file=sys.stderr, flush=True)
    results = [median_pass(r) for r in runs]

    peaks_after = peaks_before if args.quick else measure_peaks()
    peaks = {d: max(peaks_before[d]["gflops"], peaks_after[d]["gflops"]) for d in args.dtypes}

    block = []
    for dtype in args.dtypes:
        per_size = "; ".join(
            f"{when}: " + ", ".join(f"{s}² {g:.0f}" for s, g in r["per_size"].items())
            for when, r in (("before", peaks_before[dtype]), ("after", peaks_after[dtype]))[:1 if args.quick else 2])
        block.append(f"- torch.mm peak, {dtype}: **{peaks[dtype]:.0f} GFLOP/s** (best call per size, {per_size})")
    block.append("- load average (1, 5, 15 min) at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    block.append(f"- wall time of the cases: {(time.monotonic() - start) / 60:.1f} min")
    if args.passes > 1:
        block.append(f"- passes: {args.passes}, one after another; each row is its case's median pass, whole")
    block.append("")
    for shape in args.cases:
        rows = [r for r in results if r["shape"] == shape]
        if not rows:
            continue
        ran = [m for m in MODES if any(r["mode"] == m for r in rows)]
        batch = ", ".join(f"batch {batches[m][shape]} {'training' if m == 'train' else 'inference'}" for m in ran)
        block += [f"### {SHAPES[shape]['title']}, {batch}", "", shape_table(rows, peaks), ""]
    block += ["### Against the references", "",
              "vitscope's images/s over the fastest of transformers' ViT (sdpa and eager attention), vit-pytorch "
              "and the tutorials' ViT, in the same mode and dtype; eager and compiled compared separately.", "",
              targets_table(results), ""]
    ours = [r for r in results if r["impl"] == "vitscope" and r["shape"] == "fmnist_plain" and r["mode"] == "train"
            and "times_s" in r]
    executed = forward_flops(shape_config("fmnist_plain"), executed=True)
    for r in ours:
        gflops = r["flops_per_image"] * 3 * images_per_s(r) / 1e9
        ran = executed * 3 * images_per_s(r) / 1e9
        block.append(f"- vitscope training step, fmnist_plain, {setting(r)}: {gflops:.0f} GFLOP/s of model FLOPs, "
                     f"{100 * gflops / peaks[r['dtype']]:.0f}% of this machine's {r['dtype']} torch.mm peak "
                     f"({ran:.0f} GFLOP/s, {100 * ran / peaks[r['dtype']]:.0f}%, of the FLOPs vitscope executes, "
                     f"{100 * executed / r['flops_per_image']:.0f}% of the model's)")
    block += ["", NOTES, ""]
    print("\n".join(block), flush=True)
    out += block
    if args.out:
        write_section(args.out, "\n".join(out))
        print(f"wrote {args.out}", file=sys.stderr)


NOTES = (
    "images/s: batch ÷ median step time. vitscope ÷ this: vitscope's images/s over this row's, same mode, dtype "
    "and compile (above 1: vitscope is faster). A training step is forward, cross-entropy, backward, "
    "`AdamW.step()` and `zero_grad(set_to_none=True)`, with the AdamW each library's training code uses "
    "(vitscope: `fused=True`, as `vitscope.training.loop` does; the others: torch's default); "
    "inference is a forward in "
    "`torch.inference_mode()`. "
    "bfloat16 rows run under `torch.autocast('cpu', dtype=torch.bfloat16)` with float32 weights. Dropout is 0.0 "
    "everywhere (the tutorial's included) so all implementations compute the same function; vitscope's model "
    "runs with its kernels swapped in (`create_model(..., kernels=True)`, i.e. `vitscope.kernels.apply`), whose last "
    "block computes the class token's output alone where the head reads nothing else (token pooling), which the "
    "others compute for every token and then drop; in bfloat16 vitscope's linear layers and patch embedding run "
    "oneDNN's fused linear (the bias, and in inference fc1's GELU, inside the matmul; in training under an "
    "autograd function with addmm's backward; vitscope/kernels/fused_linear.py); on AVX-512 CPUs vitscope's C kernels "
    "(vitscope/kernels/native/) run the attention (float32 with AVX-512, at most 256 keys; bfloat16 with AMX or "
    "AVX512-BF16, any length) and, with AVX512-BF16, the bfloat16 training MLP's GELU with its derivative, the "
    "blocks' LayerNorms and residual adds, the linear layers' weight gradients, and without AMX the linear "
    "layers' forward and input-gradient products (vitscope/kernels/linear_bf16.py) and the conv stem's weight "
    "gradients; on AMD CPUs with AVX2 and without AVX-512, in float32, the attention (AVX2 build), the linear "
    "layers' three products with the MLP's GELU inside them (vitscope/kernels/linear_f32.py), every GELU, and the conv "
    "stem's weight gradients and BatchNorm + GELU; on AMD CPUs with AVX-512, in float32, the linear layers' products "
    "in oneDNN's matmul instead of MKL's (vitscope/kernels/fused_linear.py); compiled, the attention and the "
    "training MLP (bfloat16, or "
    "float32 on those CPUs, where the linear layers run as a custom op too) run as custom "
    "ops the graph keeps, the rest as Inductor lowers it. "
    "With `--passes P` every case runs P times, pass after pass, each row is its case's median pass, and the "
    "targets table gives vitscope's over the other's images/s in each pass as well. attention: the kernel "
    "observed on a tiny forward (`vitscope kernel` when vitscope's C attention kernel ran, `sdpa` when "
    "F.scaled_dot_product_attention was called, else `explicit`). GFLOP/s: model FLOPs (matmuls and convs, "
    "2 per multiply-add; ×3 for a training step; the same count for every implementation) per second; "
    "% of mm peak against this machine's torch.mm peak in the row's dtype. first step s: the first step alone; "
    "for compiled rows that is the (cold-cache) compile "
    "time, kept out of images/s. step MiB: growth of the resident set during the timed steps above what stays "
    "allocated between steps (model, optimizer state); process MiB: the worker's peak resident set, torch and "
    "compilation included. IQR %: interquartile range of the step times over their median; bg cores: CPU cores "
    "other processes kept busy meanwhile (above ~0.3 the row was disturbed). vit-pytorch builds the same width, "
    "depth, heads and MLP but adds LayerNorms on the patches and has no qkv bias, so its parameter count differs."
)


if __name__ == "__main__":
    main()
