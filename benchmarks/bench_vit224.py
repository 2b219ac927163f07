"""ViT-S/16 and ViT-B/16 at 224, batch 32: vitscope against transformers' ViT and against this CPU's matmul peak.

For each shape (224×224×3, patch 16, depth 12, MLP 4×, 1000 classes; ViT-S/16 width 384 with 6 heads, ViT-B/16
width 768 with 12), each mode (a training step: forward, cross-entropy, backward, AdamW step, zero_grad; inference:
a forward in `torch.inference_mode`) and each dtype the CPU multiplies natively (float32 always; bfloat16 autocast
where vitscope.kernels.bf16 says oneDNN runs it), five implementations of the same model:

  vitscope                      create_model(preset, kernels=True): vitscope's kernels swapped in, as `vitscope
                                train` and `vitscope eval` run it (fused AdamW, as vitscope.training does)
  vitscope plain                create_model(preset, kernels=False): the same model in PyTorch's ops alone
  transformers eager            ViTForImageClassification, attn_implementation="eager" (torch's default AdamW)
  transformers sdpa             the same with "sdpa"
  transformers sdpa, compiled   the sdpa model under torch.compile (default mode)

Every measurement is a process of its own. Round r measures the matmul peak (a 4096² torch.mm in each dtype, at
the same thread count), then runs every implementation once, in turn (in reverse order on odd rounds), so a
neighbour's load falls on all alike. A row is the median over rounds of its images/s (in each round, batch ÷ the
median step time); the peak is the best of the rounds. Warm-up steps come first and are never timed: the first
one is the compile in the compiled row ("first step s" is round 1's, with a cold Inductor cache; later rounds
reuse the run's cache).

    python benchmarks/bench_vit224.py                       # everything, 1 round: ~20 min on 2 Zen 3 cores
    python benchmarks/bench_vit224.py --rounds 3 --out benchmarks/RESULTS.md      # ~50 min there
    python benchmarks/bench_vit224.py --shapes vit_s16 --modes infer --rounds 1 --steps 2 --threads 1
    python benchmarks/bench_vit224.py --quick               # smoke run: depth 2 at 64×64, batch 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_header, machine_info, rate_text  # noqa: E402
from _workers import run_worker  # noqa: E402
from bench_attention import (  # noqa: E402  (shared helpers of the benchmark scripts)
    _background_cores,
    _kernel_used,
    apply_malloc,
    default_dtypes,
    run_peak,
    write_section,
)
from bench_vit import _make_step, hf_vit  # noqa: E402

SHAPES = {
    "vit_s16": ("vit_small_patch16_224", "ViT-S/16 (224×224×3, patch 16, width 384, depth 12, 6 heads, MLP 1536)"),
    "vit_b16": ("vit_base_patch16_224", "ViT-B/16 (224×224×3, patch 16, width 768, depth 12, 12 heads, MLP 3072)"),
}
QUICK = {"depth": 2, "img_size": 64}  # --quick: the same widths and heads, 2 blocks, 16 patches
IMPLS = ("vitscope", "vitscope-plain", "hf-eager", "hf-sdpa", "hf-sdpa-compile")
LABELS = {"vitscope": "vitscope", "vitscope-plain": "vitscope plain (kernels off)",
          "hf-eager": "transformers eager", "hf-sdpa": "transformers sdpa",
          "hf-sdpa-compile": "transformers sdpa, compiled"}
OTHERS = ("hf-eager", "hf-sdpa", "hf-sdpa-compile")  # the references each row is divided by
MODES = ("train", "infer")
DTYPES = ("float32", "bfloat16")
PATHS = {"vitscope kernel": "vitscope kernel", "fused": "sdpa", "explicit": "explicit"}
STEP_TARGET_S = 8.0  # --steps 0: time enough steps to fill this (1 to 5): one for every ViT-B/16 step on 2 cores


def forward_flops(cfg) -> int:
    """Matmul FLOPs of one image's forward pass, 2 per multiply-add; a training step counts 3× (the backward
    computes two products for each of the forward's). With P = (img / p)² patches, N = P + 1 tokens, width d,
    MLP width m, C channels, K classes and L blocks:

        patch embedding   2·P·(C·p²)·d
        each block        qkv 2·N·d·3d + QKᵀ 2·N·N·d + AV 2·N·N·d + proj 2·N·d·d + MLP 2·N·d·m + 2·N·m·d
        head              2·d·K (the class token)

    LayerNorm, GELU, softmax and the adds are left out (about 1% at these sizes). It is the model's count, the
    same for every implementation; vitscope's last block does less (the class token's output alone)."""
    p, d, n_patches = cfg.patch_size, cfg.embed_dim, (cfg.img_size // cfg.patch_size) ** 2
    n, m = n_patches + 1, int(cfg.embed_dim * cfg.mlp_ratio)
    block = 2 * n * d * 3 * d + 2 * 2 * n * n * d + 2 * n * d * d + 2 * 2 * n * d * m
    return 2 * n_patches * cfg.in_chans * p * p * d + cfg.depth * block + 2 * d * cfg.num_classes


# ----------------------------------------------------------------------------------------------
# Worker: one measurement in a fresh process.


def build(impl: str, preset: str, overrides: dict):
    """The float32 model `impl` builds for the preset's shape."""
    from vitscope.models import create_model, get_config

    if impl in ("vitscope", "vitscope-plain"):
        return create_model(preset, kernels=impl == "vitscope", **overrides)
    return hf_vit(get_config(preset, **overrides), "eager" if impl == "hf-eager" else "sdpa")


def run_case(spec: dict) -> dict:
    import torch

    from vitscope.models import get_config

    torch.set_num_threads(spec["threads"])
    train, bf16 = spec["mode"] == "train", spec["dtype"] == "bfloat16"
    torch.manual_seed(0)
    cfg = get_config(spec["preset"], **spec["overrides"])
    model = build(spec["impl"], spec["preset"], spec["overrides"]).train(train)
    x = torch.randn(spec["batch"], cfg.in_chans, cfg.img_size, cfg.img_size)
    y = torch.randint(0, cfg.num_classes, (spec["batch"],))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=spec["impl"].startswith("vitscope")) if train else None

    def tiny_forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(x[:2])

    base = {**spec, "params": sum(p.numel() for p in model.parameters()),
            "path": PATHS[_kernel_used(tiny_forward, train)]}  # observed, before compiling
    step = _make_step(torch.compile(model) if spec["impl"] == "hf-sdpa-compile" else model, opt, x, y, train, bf16)
    t0 = time.perf_counter()
    try:
        step()  # compiles, in the compiled row
    except Exception as e:  # noqa: BLE001  (a failure becomes a row saying why)
        return {**base, "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:160]}
    first = time.perf_counter() - t0
    for _ in range(spec["warmup"] - 1):
        step()
    gc.collect()
    times: list[float] = []

    def timed():
        for _ in range(spec["steps"] or 5):
            t1 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t1)
            if not spec["steps"] and len(times) * times[0] >= STEP_TARGET_S:
                break

    _, background = _background_cores(timed)
    return {**base, "first_s": first, "times_s": times, "background_cores": background}


def worker(spec: dict) -> None:
    apply_malloc(spec)  # every implementation alike: freed memory stays in the process, as `vitscope eval` keeps it
    result = run_peak(spec) if spec["kind"] == "peak" else run_case(spec)
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------
# Driver: the rounds, the rows, the tables.


def spawn(spec: dict, env: dict, timeout_s: float = 2400) -> dict:
    return run_worker(__file__, spec, timeout_s=timeout_s, env=env)


def row(runs: list[dict]) -> dict:
    """An implementation's row from its rounds: the median over rounds of images/s; any failed round makes the row
    that round's error."""
    failed = next((r for r in runs if "error" in r), None)
    if failed is not None:
        return {"impl": failed["impl"], "error": failed["error"]}
    per_round = [r["batch"] / statistics.median(r["times_s"]) for r in runs]
    return {"impl": runs[0]["impl"], "path": runs[0]["path"], "images_per_s": statistics.median(per_round),
            "per_round": per_round, "first_s": runs[0]["first_s"],
            "background_cores": max(r["background_cores"] for r in runs), "params": runs[0]["params"]}


def fastest_other(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if r["impl"] in OTHERS and "images_per_s" in r]
    return max(ok, key=lambda r: r["images_per_s"]) if ok else None


def with_ratios(rows: list[dict], gflop_per_image: float, peak_gflops: float) -> list[dict]:
    """Each row's images/s over the fastest transformers row's, its GFLOP/s and its fraction of the peak."""
    best = fastest_other(rows)
    out = []
    for r in rows:
        if "images_per_s" in r:
            gflops = gflop_per_image * r["images_per_s"]
            r = {**r, "ratio": r["images_per_s"] / best["images_per_s"] if best else None, "gflops": gflops,
                 "peak_fraction": gflops / peak_gflops}
        out.append(r)
    return out


def group_table(groups: dict[tuple[str, str], list[dict]]) -> str:
    lines = ["| mode | dtype | implementation | attention | images/s | in each round | ÷ fastest transformers "
             "| GFLOP/s | % of mm peak | first step s | bg cores |",
             "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for (mode, dtype), rows in groups.items():
        for r in rows:
            head = f"| {mode} | {dtype}{' autocast' if dtype == 'bfloat16' else ''} | {LABELS[r['impl']]} "
            if "images_per_s" not in r:
                lines.append(head + f"| | {r['error']} | | | | | | |")
                continue
            rounds = " ".join(rate_text(v) for v in r["per_round"])
            ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else ""
            lines.append(head + f"| {r['path']} | {rate_text(r['images_per_s'])} | {rounds} | {ratio} "
                         f"| {r['gflops']:.0f} | {100 * r['peak_fraction']:.0f} | {r['first_s']:.1f} "
                         f"| {r['background_cores']:.1f} |")
    return "\n".join(lines)


def targets(dtype: str, native_bf16: bool) -> tuple[float | None, dict[str, float]]:
    """Issue 63's targets: vitscope's ratio to the fastest transformers row, and its fraction of the peak by mode.
    bfloat16 (AMX or AVX512-BF16): 1.5×, 65% in inference, 45% in training. float32 on a CPU without native bfloat16
    (Zen 3, AVX2): no slower than the fastest other."""
    if dtype == "bfloat16":
        return 1.5, {"infer": 0.65, "train": 0.45}
    return (1.0, {}) if not native_bf16 else (None, {})


def targets_table(tables: dict[str, dict[tuple[str, str], list[dict]]], native_bf16: bool) -> str:
    lines = ["| shape | mode | dtype | vitscope ÷ fastest transformers | target | vitscope % of mm peak | target "
             "| met |", "|---|---|---|---:|---:|---:|---:|---|"]
    for shape, groups in tables.items():
        for (mode, dtype), rows in groups.items():
            ours = next((r for r in rows if r["impl"] == "vitscope" and r.get("ratio") is not None), None)
            if ours is None:
                continue
            ratio_target, fractions = targets(dtype, native_bf16)
            fraction = fractions.get(mode)
            checks = ([ours["ratio"] >= ratio_target] if ratio_target else []) + (
                [ours["peak_fraction"] >= fraction] if fraction else [])
            met = ("yes" if all(checks) else "**no**") if checks else ""
            lines.append(f"| {shape} | {mode} | {dtype} | {ours['ratio']:.2f} "
                         f"| {f'≥ {ratio_target}' if ratio_target else ''} | {100 * ours['peak_fraction']:.0f} "
                         f"| {f'≥ {100 * fraction:.0f}' if fraction else ''} | {met} |")
    return "\n".join(lines)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, as vitscope's commands answer bad input
        self.exit(2, f"{self.prog}: {message}\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog="bench_vit224.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None,
                        help="default: float32, and bfloat16 where the CPU multiplies it natively")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first, the compile among them (default 1)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"timed steps per process (default: enough to fill {STEP_TARGET_S:.0f} s, 1 to 5; "
                             "2 with --quick)")
    parser.add_argument("--batch", type=int, default=None, help="images per step (default 32; 4 with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--quick", action="store_true", help="smoke run: depth 2 at 64×64, batch 4, a 512² peak")
    parser.add_argument("--out", type=Path, help="also write the section into this markdown file (its own only)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("rounds", "warmup", "batch", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.steps is not None and args.steps < 0:
        parser.error(f"--steps must be 0 (fill {STEP_TARGET_S:.0f} s) or more, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    import torch
    import transformers

    from vitscope.kernels import bf16
    from vitscope.models import get_config

    threads = args.threads or torch.get_num_threads()
    rounds, batch = args.rounds or 1, args.batch or (4 if args.quick else 32)
    steps = args.steps if args.steps is not None else (2 if args.quick else 0)
    dtypes = args.dtypes or default_dtypes()
    overrides = QUICK if args.quick else {}
    command = "python benchmarks/bench_vit224.py " + " ".join(argv if argv is not None else sys.argv[1:])
    section = (f"## ViT-S/16 and ViT-B/16 at 224 against transformers, {machine_info()['cpu']} "
               "(benchmarks/bench_vit224.py)")
    out = [section, "", f"Command: `{command.strip()}`", "",
           machine_header({"torch_threads": threads, "transformers": transformers.__version__}), ""]
    print("\n".join(out), flush=True)

    peak_spec = {"kind": "peak", "threads": threads, "sizes": [512] if args.quick else [4096], "repeats": 3,
                 "malloc": "kept"}
    case = {"kind": "case", "threads": threads, "batch": batch, "warmup": args.warmup, "steps": steps,
            "overrides": overrides, "malloc": "kept"}
    groups = [(shape, mode, dtype) for shape in args.shapes for mode in args.modes for dtype in dtypes]
    peaks: dict[str, list[float]] = {d: [] for d in dtypes}
    runs: dict[tuple, list[dict]] = {}
    cache = tempfile.mkdtemp(prefix="bench_vit224_inductor_")  # cold in round 1, reused by later rounds
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    start = time.monotonic()
    try:
        for n in range(rounds):
            for dtype in dtypes:
                r = spawn({**peak_spec, "dtype": dtype}, env)
                if "error" in r:
                    sys.exit(f"bench_vit224.py: measuring the {dtype} matmul peak failed: {r['error']}")
                peaks[dtype].append(r["gflops"])
            for shape, mode, dtype in groups:
                for impl in args.impls if n % 2 == 0 else args.impls[::-1]:
                    r = spawn({**case, "impl": impl, "preset": SHAPES[shape][0], "mode": mode, "dtype": dtype}, env)
                    runs.setdefault((shape, mode, dtype, impl), []).append(r)
                    took = (f"{rate_text(r['batch'] / statistics.median(r['times_s']))} images/s, "
                            f"first step {r['first_s']:.1f} s" if "times_s" in r else r["error"])
                    print(f"  [round {n + 1}/{rounds}, {time.monotonic() - start:.0f} s] {shape} {mode} {dtype} "
                          f"{LABELS[impl]}: {took}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    peak = {d: max(v) for d, v in peaks.items()}
    tables: dict[str, dict[tuple[str, str], list[dict]]] = {}
    block = [f"- torch.mm peak, {d}: **{peak[d]:.0f} GFLOP/s** ({peak_spec['sizes'][0]}², {threads} threads; "
             f"best call of each round: {', '.join(f'{g:.0f}' for g in peaks[d])})" for d in dtypes]
    block += [f"- rounds: {rounds}; batch {batch}; warm-up steps {args.warmup} (untimed, the compile among them); "
              f"timed steps per process: {steps or f'enough for {STEP_TARGET_S:.0f} s, 1 to 5'}",
              f"- wall time: {(time.monotonic() - start) / 60:.1f} min; load average (1, 5, 15 min) at the end: "
              + " ".join(f"{x:.2f}" for x in os.getloadavg()), ""]
    for shape in args.shapes:
        cfg = get_config(SHAPES[shape][0], **overrides)
        gflop = forward_flops(cfg) / 1e9
        tables[shape] = {}
        for mode in args.modes:
            for dtype in dtypes:
                rows = [row(runs[(shape, mode, dtype, impl)]) for impl in args.impls]
                tables[shape][(mode, dtype)] = with_ratios(rows, gflop * (3 if mode == "train" else 1), peak[dtype])
        size = f"; quick: depth {cfg.depth}, {cfg.img_size}×{cfg.img_size}" if args.quick else ""
        counts = {LABELS[r["impl"]]: r["params"] for rows in tables[shape].values() for r in rows if "params" in r}
        params = (f"{next(iter(counts.values())):,} parameters in every implementation" if len(set(counts.values()))
                  == 1 else "parameters differ: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
        block += [f"### {SHAPES[shape][1]}{size}, batch {batch}", "",
                  f"{gflop:.2f} GFLOP a forward per image; {params}.", "", group_table(tables[shape]), ""]
    block += ["### Against the targets (issue 63)", "", targets_table(tables, bf16.native_matmul()), "", NOTES, ""]
    print("\n".join(block), flush=True)
    if args.out:
        write_section(args.out, "\n".join(out + block))
        print(f"wrote {args.out}", file=sys.stderr)


NOTES = (
    "images/s: batch ÷ the median step time of a process, median over the rounds (each round's in the next column). "
    "÷ fastest transformers: this row's images/s over the fastest of transformers' rows (eager, sdpa, compiled) in "
    "the same shape, mode and dtype. GFLOP/s: the model's matmul FLOPs (`forward_flops` in the script: patch "
    "embedding, qkv, QKᵀ, AV, proj, MLP, head; 2 per multiply-add; a training step 3× the forward) per second; "
    "% of mm peak: over the best torch.mm call of the rounds, measured in its own process at the same threads "
    "and dtype. A training step is forward, cross-entropy, backward, `AdamW.step()` and `zero_grad`: vitscope "
    "with `fused=True` (as vitscope.training does, kernels on or off), transformers with torch's default. bfloat16 "
    "rows run under `torch.autocast('cpu', dtype=torch.bfloat16)` with float32 weights. attention: the kernel "
    "observed on a tiny forward before any compile. first step s: round 1's first step, untimed (the cold compile "
    "in the compiled row). bg cores: the most CPU cores other processes kept busy during a row's timed steps "
    "(above ~0.3 the row was disturbed)."
)


if __name__ == "__main__":
    main()
