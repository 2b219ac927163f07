"""ViT and attention speed and memory on a CUDA GPU: vitscope against what users pick instead, in one run.

    python benchmarks/bench_gpu.py                       # everything, on the first CUDA device
    python benchmarks/bench_gpu.py --quick --out /tmp/gpu.md

The CPU benchmarks (bench_vit.py, bench_attention.py) run each case in a fresh process and read the
resident set; on a GPU the numbers are CUDA's own: every case runs in this process, timed with
`torch.cuda.synchronize()` around each step, and its memory is `torch.cuda.max_memory_allocated()`
after a reset, above what the case held before it began. bfloat16 autocast throughout (float32
weights), as on the CPU.

1. The ViT training step (forward, cross-entropy, backward, AdamW, zero_grad) and inference forward
   for bench_vit.py's two plain shapes, in images/s: vitscope, transformers' ViT (sdpa and eager),
   vit-pytorch (when installed) and the tutorials' code, built by bench_vit.build_model from the same
   numbers, vitscope's with its kernels applied as on a CPU (vitscope.kernels.apply): on a GPU tensor the
   C kernels stand aside, and what stays is the last block computing the class token's output alone.
   Batches are larger than the CPU's, so that the GPU, not the launch overhead, sets the pace.
   With `--compile`, every training step again under torch.compile (compile time reported apart).
2. Attention at ViT-S head shapes (6 heads of 64), N in {65, 257, 1025, 4097, 16385}, B·N about 65k
   tokens: vitscope's `attend` (vitscope.kernels.attend; on a GPU it hands the call to PyTorch's fused
   kernel: flash or cuDNN), F.scaled_dot_product_attention, the explicit softmax path (where the scores fit), and
   vitscope's MultiHeadAttention against nn.MultiheadAttention; forward and forward+backward, time,
   TFLOP/s and share of the GPU's measured bfloat16 matmul peak, peak memory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import bench_vit  # noqa: E402
from vitscope import kernels  # noqa: E402
from vitscope.attention import MultiHeadAttention  # noqa: E402
from vitscope.training.loop import compile_options  # noqa: E402

SECTION = "## GPU (benchmarks/bench_gpu.py)"
GPU_BATCH = {"fmnist_plain": {"train": 1024, "infer": 4096}, "vit_s16": {"train": 128, "infer": 512}}
LENGTHS = (65, 257, 1025, 4097, 16385)
HEADS, HEAD_DIM, TOKENS = 6, 64, 65536


def header() -> str:
    dev = torch.cuda.get_device_properties(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        commit, dirty = "unknown", ""
    lines = [f"- GPU: {dev.name}, {dev.multi_processor_count} SMs, {dev.total_memory / 2**30:.0f} GiB",
             f"- torch: {torch.__version__} (CUDA {torch.version.cuda}), cuDNN {torch.backends.cudnn.version()}",
             f"- python: {sys.version.split()[0]}",
             f"- vitscope commit: {commit}{' (tracked files changed)' if dirty else ''}",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    try:
        import transformers
        lines.append(f"- transformers: {transformers.__version__}")
    except ImportError:
        pass
    return "\n".join(lines)


def timed(fn, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def mm_peak() -> float:
    """bfloat16 torch.mm TFLOP/s at 8192³, best of 10 after warm-up."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    best = min(timed(lambda: a @ b, 10, 3))
    return 2 * 8192**3 / best / 1e12


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def make_step(model, x, y, train: bool, fused: bool):
    """One training step (AdamW as each library's training code uses it: vitscope's fused) or one
    inference forward, under bfloat16 autocast."""
    if not train:
        def forward():
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
                model(x)
        return forward
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def attention_call(fn, q, k, v, backward: bool):
    """fn(q, k, v) in inference, or with its backward from a fixed random output gradient."""
    if not backward:
        def forward():
            with torch.inference_mode():
                fn(q, k, v)
        return forward
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    g = torch.randn_like(q)
    return lambda: fn(qg, kg, vg).backward(g)


def module_call(mha, x, backward: bool, ours: bool):
    """The attention module on x (B, N, C) under bfloat16 autocast, with a backward when asked."""
    xg = x.detach().requires_grad_(backward)

    def call():
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.set_grad_enabled(backward):
            out = mha(xg) if ours else mha(xg, xg, xg, need_weights=False)[0]
            if backward:
                out.float().sum().backward()
    return call


def vit_rows(shapes: list[str], impls: list[str], steps: int, quick: bool, modes: tuple[str, ...] = ("train", "infer"),
             compile: bool = False, no_coalesce_tiling: bool = False) -> list[str]:
    rows = ["| shape | mode | compile | implementation | batch | images/s | vitscope ÷ this | TFLOP/s of model FLOPs "
            "| step MiB | first step s |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for shape in shapes:
        flops = bench_vit.forward_flops(bench_vit.shape_config(shape))
        cfg = bench_vit.shape_config(shape)
        img = cfg.img_size if isinstance(cfg.img_size, int) else cfg.img_size[0]
        for mode in modes:
            batch = GPU_BATCH[shape][mode] // (8 if quick else 1)
            results, failures = {}, []
            for impl in impls:
                try:
                    torch.manual_seed(0)
                    model = bench_vit.build_model(impl, shape).cuda().train(mode == "train")
                except ModuleNotFoundError as e:
                    print(f"  {shape} {mode} {impl}: skipped ({e})", flush=True)
                    continue
                x = torch.randn(batch, cfg.in_chans, img, img, device="cuda")
                y = torch.randint(0, cfg.num_classes, (batch,), device="cuda")
                if compile:  # a fresh start: no shapes from the case before, so no dynamic-shape recompiles
                    torch._dynamo.reset()
                options = compile_options(torch.device("cuda")) if no_coalesce_tiling else {}
                net = torch.compile(model, options=options) if compile else model
                step = make_step(net, x, y, mode == "train", fused=impl == "vitscope")
                t0 = time.perf_counter()
                try:
                    step()  # compiles, when compiling
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001  (a failure becomes a row saying why)
                    reason = (str(e).strip().splitlines() or [""])[0]
                    failures.append(f"| {shape} | {mode} | {'yes' if compile else 'no'} | {bench_vit.LABELS[impl]} | "
                                    f"{batch} | failed: {type(e).__name__} {reason}"[:200] + " | | | | |")
                    print(f"  {shape} {mode} {impl}: failed ({type(e).__name__})", flush=True)
                    del model, net, x, y, step
                    torch.cuda.empty_cache()
                    continue
                first = time.perf_counter() - t0
                mib = peak_mib(step)
                t = median(timed(step, steps, 3))
                results[impl] = (batch / t, mib, first)
                print(f"  {shape} {mode} {impl}: {batch / t:,.0f} images/s", flush=True)
                del model, x, y
                torch.cuda.empty_cache()
            ours = results.get("vitscope", (None,))[0]
            mult = 3 if mode == "train" else 1
            for impl, (rate, mib, first) in results.items():
                ratio = f"{ours / rate:.2f}" if ours else ""
                rows.append(f"| {shape} | {mode} | {'yes' if compile else 'no'} | {bench_vit.LABELS[impl]} | {batch} | "
                            f"{rate:,.0f} | {ratio} | {rate * flops * mult / 1e12:.1f} | {mib:,.0f} | {first:.1f} |")
            rows += failures
    return rows


def explicit(q, k, v):
    w = torch.softmax((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1, dtype=torch.float32)
    return w.to(q.dtype) @ v


def attention_rows(lengths: tuple[int, ...], peak: float, steps: int) -> list[str]:
    rows = ["| N | B | pass | implementation | median ms | TFLOP/s | % of mm peak | peak MiB |",
            "|---:|---:|---|---|---:|---:|---:|---:|"]
    for n in lengths:
        b = max(1, round(TOKENS / n))
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        x = torch.randn(b, n, HEADS * HEAD_DIM, device="cuda", generator=gen)
        ours_mha = kernels.apply(MultiHeadAttention(HEADS * HEAD_DIM, HEADS)).cuda()
        ref_mha = torch.nn.MultiheadAttention(HEADS * HEAD_DIM, HEADS, batch_first=True).cuda()
        scores_gib = b * HEADS * n * n * 4 / 2**30
        cases = {"attend": lambda q, k, v: kernels.attend(q, k, v), "sdpa": F.scaled_dot_product_attention}
        if scores_gib < 8:
            cases["explicit"] = explicit
        flops = 4 * b * HEADS * n * n * HEAD_DIM
        for backward in (False, True):
            for name, fn in cases.items():
                call = attention_call(fn, q, k, v, backward)
                call()
                mib = peak_mib(call)
                t = median(timed(call, steps, 2))
                f = flops * (3.5 if backward else 1)  # backward: 2.5x the forward's matmuls
                rows.append(f"| {n} | {b} | {'fwd+bwd' if backward else 'fwd'} | {name} | {t * 1e3:.3f} | "
                            f"{f / t / 1e12:.0f} | {100 * f / t / 1e12 / peak:.0f} | {mib:,.0f} |")
            for name, mha in (("vitscope MHA", ours_mha), ("nn.MHA", ref_mha)):
                call = module_call(mha, x, backward, ours=mha is ours_mha)
                call()
                mib = peak_mib(call)
                t = median(timed(call, steps, 2))
                rows.append(f"| {n} | {b} | {'fwd+bwd' if backward else 'fwd'} | {name} ¹ | {t * 1e3:.3f} | "
                            f" |  | {mib:,.0f} |")
        print(f"  attention N = {n} done", flush=True)
        del q, k, v, x
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller batches, N up to 1025, fewer steps")
    ap.add_argument("--out", type=Path, help="also write the markdown to this file")
    ap.add_argument("--impls", nargs="+", default=list(bench_vit.IMPLS), choices=bench_vit.IMPLS)
    ap.add_argument("--compile", action="store_true", help="also every training step under torch.compile")
    ap.add_argument("--compile-only", action="store_true", help="with --compile: only the compiled rows")
    ap.add_argument("--shapes", nargs="+", default=list(GPU_BATCH), choices=list(GPU_BATCH))
    ap.add_argument("--no-coalesce-tiling", action="store_true",
                    help="compile as `vitscope train --compile` does on a GPU "
                         "(vitscope.training.loop.compile_options): "
                         "Inductor's coalesce tiling analysis off, since torch 2.11's asserts in it on ViT-S/16")
    ap.add_argument("--no-attention", action="store_true", help="skip the attention tables")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU; on a CPU run bench_vit.py and bench_attention.py")
    torch.backends.cuda.matmul.allow_tf32 = True
    steps = 5 if args.quick else 20
    peak = mm_peak()
    print(f"bfloat16 mm peak {peak:.0f} TFLOP/s", flush=True)
    vit = [] if args.compile and args.compile_only else vit_rows(args.shapes, args.impls, steps, args.quick)
    if args.compile:
        compiled = vit_rows(args.shapes, args.impls, steps, args.quick, ("train",), compile=True,
                            no_coalesce_tiling=args.no_coalesce_tiling)
        vit = compiled if args.compile_only else vit + compiled[2:]
    att = [] if args.no_attention else attention_rows(LENGTHS[:3] if args.quick else LENGTHS, peak, steps)
    flags = ("quick", "compile", "compile_only", "no_coalesce_tiling", "no_attention")
    cmd = "python benchmarks/bench_gpu.py" + "".join(f" --{f.replace('_', '-')}" for f in flags if getattr(args, f))
    if args.shapes != list(GPU_BATCH):
        cmd += " --shapes " + " ".join(args.shapes)
    if args.impls != list(bench_vit.IMPLS):
        cmd += " --impls " + " ".join(args.impls)
    text = "\n".join([
        SECTION, "", f"Command: `{cmd}`", "", header(), f"- torch.mm peak, bfloat16 (8192³): **{peak:.0f} TFLOP/s**",
        "", "### ViT training step and inference, bfloat16 autocast", "", *vit, "",
        "images/s: batch ÷ median step time (CUDA synchronised). vitscope ÷ this: above 1, vitscope is faster. "
        "TFLOP/s: the model's matmul FLOPs (bench_vit.py's count; ×3 for a training step) per second. step MiB: "
        "peak CUDA memory allocated during one step above what was held before it. first step s: the first "
        "step alone (for compiled rows, the compile), kept out of images/s.", "",
        f"### Attention, bfloat16, {HEADS} heads of {HEAD_DIM}", "", *att, "",
        "FLOPs: 4·B·H·N²·D forward, ×3.5 for forward+backward. ¹ the module with its projections, input "
        "(B, N, 384) in float32 under bfloat16 autocast (no FLOP share given). explicit: softmax(q kᵀ) v with "
        "the scores in float32, skipped where they would pass 8 GiB.", ""])
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
