"""Attention speed and memory on this machine: vitscope's `attend` against what users pick instead.

Cases use ViT-S heads (H=6, D=64) and about 4,096 tokens per batch (B = round(4096 / N), at
least 1), N in {65, 257, 1025, 4097, 16385}, float32 and bfloat16, forward (inference mode) and
forward+backward. Each case runs in a fresh Python process: one call measures peak memory, then
warm-up, then the median of several timed repeats. Each worker keeps its freed memory
(vitscope/kernels/allocator.py; `--malloc default` for glibc's own thresholds), so a path that allocates a
large fresh output, such as the explicit path's (B, H, N, N) weights, does not also pay page faults.

Implementations, attention cores on q, k, v (B, H, N, D):
  attend            vitscope.kernels.attend: vitscope's C attention kernels where they run on this CPU,
                    else vitscope.attention.attend's own choice of fused or explicit
  fused             F.scaled_dot_product_attention called directly
  explicit          attend's explicit path as it runs when no weights are returned (bfloat16 training
                    at N <= EXPLICIT_HALF_MAX_KEYS): q @ kᵀ · scale, softmax computed in float32 and
                    kept in the input dtype, then @ v
  tutorial          the tutorials' code as written: q @ kᵀ / sqrt(d), softmax, @ v (input dtype)
and modules on x (B, N, E=H*D), which include the q/k/v and output projections:
  vitscope MHA      vitscope.attention.MultiHeadAttention with the kernels swapped in (vitscope.kernels.apply)
  nn.MHA            torch.nn.MultiheadAttention(batch_first=True), called with need_weights=False
  nn.MHA weights    the same module called as tutorials do, with the default need_weights=True

A second table sweeps N for the forward+backward crossover between fused and explicit, which is
what `EXPLICIT_HALF_MAX_KEYS` in vitscope.attention encodes.

    .venv/bin/python benchmarks/bench_attention.py                 # full run, several minutes
    .venv/bin/python benchmarks/bench_attention.py --quick         # fewer N, fewer repeats
    .venv/bin/python benchmarks/bench_attention.py --out results.md
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

HEADS, HEAD_DIM = 6, 64  # ViT-S
EMBED = HEADS * HEAD_DIM
TOKENS_PER_BATCH = 4096
FULL_N = (65, 257, 1025, 4097, 16385)
QUICK_N = (65, 257, 1025)
SWEEP_N = (65, 129, 197, 257, 385, 513, 769, 1025)
QUICK_SWEEP_N = (65, 257, 513)
DTYPES = ("float32", "bfloat16")
MALLOC = {"kept": "freed memory kept in each worker process, every implementation alike (vitscope.kernels.allocator)",
          "default": "glibc's default thresholds"}
MODES = ("fwd", "fwd+bwd")
CORES = ("attend", "fused", "explicit", "tutorial")
MODULES = ("vitscope MHA", "nn.MHA", "nn.MHA weights")
# Implementations that hold the full (B, H, N, N) score matrix, and so are skipped when it won't fit.
MATERIALISING = ("explicit", "tutorial", "nn.MHA weights")


def batch_for(n: int, tokens: int = TOKENS_PER_BATCH) -> int:
    return max(1, round(tokens / n))


def attention_flops(b: int, n: int, mode: str, with_projections: bool) -> float:
    """Two matmuls of 2·B·H·N²·D each forward; backward costs twice the forward."""
    flops = 4 * b * HEADS * n * n * HEAD_DIM
    if with_projections:
        flops += 2 * b * n * EMBED * 4 * EMBED  # qkv (E -> 3E) and output (E -> E) linears
    return flops * (3 if mode == "fwd+bwd" else 1)


def explicit_bytes(b: int, n: int, mode: str) -> int:
    """Rough peak of a path that materialises the scores: float32 (B, H, N, N) matrices alive at once."""
    return b * HEADS * n * n * 4 * (3 if mode == "fwd" else 6)


# ----------------------------------------------------------------------------------------------
# Worker: one case in a fresh process.


def _rss_bytes(field: str) -> int:
    """VmRSS (current) or VmHWM (peak since last reset) of this process, from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc), so reusing it shows up as RSS growth again."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _busy_jiffies() -> int:
    """Non-idle CPU time of the whole machine so far, in clock ticks (from /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # minus idle and iowait


def _background_cores(step) -> tuple[float, float]:
    """Run step(); return (seconds, cores that other processes kept busy meanwhile)."""
    hz = os.sysconf("SC_CLK_TCK")
    busy0, own0, t0 = _busy_jiffies(), os.times(), time.perf_counter()
    step()
    busy1, own1, t1 = _busy_jiffies(), os.times(), time.perf_counter()
    own = (own1.user + own1.system) - (own0.user + own0.system)
    return t1 - t0, max(0.0, ((busy1 - busy0) / hz - own) / (t1 - t0))


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def tutorial_attention(q, k, v):
    """Scaled dot-product attention as the tutorials wrote it: no fusion, softmax in the input dtype."""
    import torch
    import torch.nn.functional as F

    d = q.size(-1)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)  # (B, H, N, N)
    weights = F.softmax(scores, dim=-1)
    return torch.matmul(weights, v)  # (B, H, N, D)


def _kernel_used(fn, train: bool) -> str:
    """'vitscope kernel' if fn() runs vitscope's C attention kernel (vitscope/kernels/short_attention.py), 'fused'
    if it calls F.scaled_dot_product_attention, else 'explicit' (observed, not assumed)."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from vitscope.kernels import short_attention

    class Spy(TorchFunctionMode):
        fused = False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                Spy.fused = True
            return func(*args, **(kwargs or {}))

    ran = []
    real = short_attention._forward
    short_attention._forward = lambda *a: ran.append(1) or real(*a)
    try:
        with Spy(), torch.set_grad_enabled(train):
            fn()
    finally:
        short_attention._forward = real
    return "vitscope kernel" if ran else "fused" if Spy.fused else "explicit"


def _build(impl: str, b: int, n: int, dtype, train: bool):
    """Return (step, path): step() runs one forward (and backward when `train`)."""
    import torch
    import torch.nn.functional as F

    from vitscope import attention, kernels

    gen = torch.Generator().manual_seed(0)
    if impl in CORES:
        q, k, v = (torch.randn(b, HEADS, n, HEAD_DIM, generator=gen).to(dtype) for _ in range(3))
        for t in (q, k, v):
            t.requires_grad_(train)
        grad = torch.randn(b, HEADS, n, HEAD_DIM, generator=gen).to(dtype)
        fn = {
            "attend": lambda: kernels.attend(q, k, v),
            "fused": lambda: F.scaled_dot_product_attention(q, k, v),
            "explicit": lambda: attention.attention_weights(q, k, dtype=v.dtype) @ v,  # attend's explicit branch
            "tutorial": lambda: tutorial_attention(q, k, v),
        }[impl]
        path = _kernel_used(fn, train) if impl == "attend" else impl
        leaves: tuple = (q, k, v)
    else:
        x = torch.randn(b, n, EMBED, generator=gen).to(dtype).requires_grad_(train)
        grad = torch.randn(b, n, EMBED, generator=gen).to(dtype)
        if impl == "vitscope MHA":
            module = kernels.apply(attention.MultiHeadAttention(EMBED, HEADS))
            fn = lambda: module(x)
            path = "attend"
        else:
            module = torch.nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
            need = impl == "nn.MHA weights"
            fn = lambda: module(x, x, x, need_weights=need)[0]
            path = "explicit+avg" if need else "sdpa"
        module.to(dtype).train(train)
        if impl == "vitscope MHA":
            path = "attend: " + _kernel_used(fn, train)
        leaves = (x,)

    if not train:
        def step():
            with torch.inference_mode():
                fn()
    else:
        def step():
            fn().backward(grad)
            for t in leaves:
                t.grad = None
            if impl in MODULES:
                module.zero_grad(set_to_none=True)
    return step, path


def _time(step, min_repeats: int, max_repeats: int, target_s: float) -> list[float]:
    times: list[float] = []
    t0 = time.perf_counter()
    step()  # warm-up beyond the memory call: more calls until 0.5 s or 3 calls, whichever is later
    first = time.perf_counter() - t0
    spent, calls = first, 1
    while first < 1.0 and (spent < 0.5 or calls < 3):
        t0 = time.perf_counter()
        step()
        spent += time.perf_counter() - t0
        calls += 1
    estimate = spent / calls
    repeats = max(min_repeats, min(max_repeats, math.ceil(target_s / max(estimate, 1e-6))))
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def run_case(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    train = spec["mode"] == "fwd+bwd"

    # Initialise libraries (thread pool, oneDNN, kernels) on a tiny case: the memory below is the case's own.
    tiny, _ = _build(spec["impl"], 1, 8, dtype, train)
    tiny()
    del tiny
    step, path = _build(spec["impl"], spec["b"], spec["n"], dtype, train)
    gc.collect()
    _release_free_memory()
    base = _rss_bytes("VmRSS")
    if _reset_peak_rss():
        step()
        peak = _rss_bytes("VmHWM") - base
        method = "VmHWM"
    else:  # the high-water mark cannot be reset: ru_maxrss over the whole process (an upper bound)
        step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        method = "ru_maxrss"
    times: list[float] = []
    _, background = _background_cores(
        lambda: times.extend(_time(step, spec["min_repeats"], spec["max_repeats"], spec["target_s"]))
    )
    return {**spec, "path": path, "times_s": times, "peak_bytes": max(peak, 0), "mem_method": method,
            "background_cores": background}


def run_pair(spec: dict) -> dict:
    """Time two implementations on one case, alternating calls, so both see the same background load."""
    import torch

    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    train = spec["mode"] == "fwd+bwd"
    steps = [_build(impl, spec["b"], spec["n"], dtype, train)[0] for impl in spec["impls"]]
    estimates = [_time(step, 1, 1, 0.0)[0] for step in steps]  # warm-up each, then one timed call
    rounds = max(spec["min_repeats"], min(spec["max_repeats"], math.ceil(spec["target_s"] / sum(estimates))))
    times: list[list[float]] = [[] for _ in steps]

    def alternate():
        for _ in range(rounds):
            for step, record in zip(steps, times):
                t0 = time.perf_counter()
                step()
                record.append(time.perf_counter() - t0)

    _, background = _background_cores(alternate)
    return {**spec, "times_s": dict(zip(spec["impls"], times)), "background_cores": background}


def run_peak(spec: dict) -> dict:
    """Best torch.mm throughput over a few large square sizes: this machine's matmul peak."""
    import torch

    from vitscope.kernels import bf16

    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    sizes = spec["sizes"]
    if dtype == torch.bfloat16 and not bf16.native_matmul():
        # PyTorch's fallback loop: a 4096² product would take minutes, and small ones run fastest
        sizes = [128, 256, 512]
    best = 0.0
    per_size = {}
    for size in sizes:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        for _ in range(2):
            torch.mm(a, b)
        times = []
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
        gflops = 2 * size**3 / min(times) / 1e9  # a peak: the best call, least disturbed by other load
        per_size[size] = round(gflops, 1)
        best = max(best, gflops)
    return {**spec, "gflops": best, "per_size": per_size}


def default_dtypes() -> list[str]:
    """Both dtypes, or float32 alone (saying so) where bfloat16 matmuls are only emulated (vitscope.kernels.bf16): there
    PyTorch's fallback loop runs them at 1-15 GFLOP/s, and every implementation's bfloat16 case takes minutes.
    Shared with bench_vit.py, whose `--dtypes` flag overrides it as this script's does."""
    from vitscope.kernels import bf16

    if bf16.native_matmul():
        return list(DTYPES)
    print("note: bfloat16 matmuls are emulated on this CPU: the bfloat16 cases are skipped; --dtypes float32 "
          "bfloat16 runs them anyway", file=sys.stderr)
    return ["float32"]


def add_malloc_flag(parser: argparse.ArgumentParser) -> None:
    """`--malloc kept|default`, shared with bench_vit.py; each spec carries the choice to its worker."""
    parser.add_argument("--malloc", choices=list(MALLOC), default="kept",
                        help="kept (default): every worker keeps its freed memory (vitscope/kernels/allocator.py), "
                             "every "
                             "implementation alike, so none pays page faults for fresh outputs; default: glibc's "
                             "own thresholds")


def apply_malloc(spec: dict) -> None:
    """In a worker: keep freed memory if the spec says so (it is the process's allocator, not a model's)."""
    if spec.get("malloc") == "kept":
        from vitscope.kernels.allocator import keep_freed_memory

        keep_freed_memory()


def worker(spec: dict) -> None:
    # Guard the shared machine: a case that outgrows its budget fails with an error here rather than
    # waking the kernel's OOM killer, which might pick someone else's process.
    limit = int(spec.get("address_space_gb", 0) * 2**30)
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    apply_malloc(spec)
    run = {"peak": run_peak, "pair": run_pair, "case": run_case}[spec["kind"]]
    result = run(spec)
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------
# Driver: spawn the cases, collect, print the tables.


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.3) -> float:
    """Wait (up to max_wait_s) until other processes use less than threshold_cores; return their use."""
    hz, deadline = os.sysconf("SC_CLK_TCK"), time.monotonic() + max_wait_s
    while True:
        busy0, t0 = _busy_jiffies(), time.perf_counter()
        time.sleep(0.5)
        cores = (_busy_jiffies() - busy0) / hz / (time.perf_counter() - t0)
        if cores < threshold_cores or time.monotonic() > deadline:
            return cores
        time.sleep(1.5)


def spawn(spec: dict, timeout_s: float = 900, quiet_wait_s: float = 0.0) -> dict:
    if quiet_wait_s:
        wait_for_quiet(quiet_wait_s)
    from _workers import run_worker  # beside _machine, which main() imports the same way

    return run_worker(__file__, spec, timeout_s=timeout_s)


def _fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _key(spec: dict) -> tuple:
    return spec["impl"], spec["n"], spec["dtype"], spec["mode"]


def _best(runs: list[dict]) -> dict:
    """The run with the lowest median among passes (background load only slows a run down)."""
    ok = [r for r in runs if "times_s" in r]
    if not ok:
        return runs[0]
    best = min(ok, key=lambda r: statistics.median(r["times_s"]))
    return {**best, "pass_medians": [statistics.median(r["times_s"]) for r in ok]}


def table(results: list[dict], peaks: dict[str, float], dtype: str, mode: str) -> str:
    rows = [r for r in results if r["dtype"] == dtype and r["mode"] == mode]
    head = (
        "| N | B | implementation | path | median ms | IQR % | bg cores | GFLOP/s | % of mm peak | peak MiB "
        "| time / explicit | time / nn.MHA |\n"
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for n in sorted({r["n"] for r in rows}):
        group = {r["impl"]: r for r in rows if r["n"] == n}
        ref = {name: statistics.median(group[name]["times_s"])
               for name in ("explicit", "nn.MHA") if name in group and "times_s" in group[name]}
        for impl in CORES + MODULES:
            r = group.get(impl)
            if r is None:
                continue
            label = impl + (" ¹" if impl in MODULES else "")
            if "times_s" not in r:
                lines.append(f"| {n} | {r['b']} | {label} | | {r.get('error', 'skipped')} | | | | | | | |")
                continue
            t = statistics.median(r["times_s"])
            q1, _, q3 = statistics.quantiles(r["times_s"], n=4) if len(r["times_s"]) > 1 else (t, t, t)
            gflops = attention_flops(r["b"], n, mode, impl in MODULES) / t / 1e9
            rel = [t / ref[name] if name in ref else None for name in ("explicit", "nn.MHA")]
            lines.append(
                f"| {n} | {r['b']} | {label} | {r['path']} | {_fmt_ms(t)} | {100 * (q3 - q1) / t:.0f} "
                f"| {r.get('background_cores', float('nan')):.1f} "
                f"| {gflops:.0f} | {100 * gflops / peaks[dtype]:.0f} | {r['peak_bytes'] / 2**20:.0f} "
                f"| {_fmt_ratio(rel[0])} | {_fmt_ratio(rel[1])} |"
            )
    return "\n".join(lines)


def sweep_table(cases: list[list[dict]]) -> str:
    """One row per (dtype, N) from its passes: times from the least disturbed pass, the ratio per pass."""
    lines = [
        "| dtype | N | B | fused ms | explicit ms | explicit / fused | faster | ratio in each pass | bg cores |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for passes in cases:
        first = passes[0]
        ok = [r for r in passes if "times_s" in r]
        if not ok:
            lines.append(f"| {first['dtype']} | {first['n']} | {first['b']} | {first['error']} | | | | | |")
            continue
        medians = [{impl: statistics.median(t) for impl, t in r["times_s"].items()} for r in ok]
        pick = min(range(len(ok)), key=lambda i: medians[i]["fused"] + medians[i]["explicit"])
        best = medians[pick]
        tf, te = best["fused"], best["explicit"]
        each = ", ".join(f"{m['explicit'] / m['fused']:.2f}" for m in medians)
        lines.append(
            f"| {first['dtype']} | {first['n']} | {first['b']} | {_fmt_ms(tf)} | {_fmt_ms(te)} "
            f"| {te / tf:.2f} | {'fused' if tf < te else 'explicit'} | {each} "
            f"| {ok[pick].get('background_cores', float('nan')):.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="N in {65, 257, 1025}, fewer repeats")
    parser.add_argument("--out", type=Path,
                        help="also write the markdown to this file (replacing only this script's section)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--max-gb", type=float, default=6.0,
                        help="skip score-materialising cases estimated above this many GB (default 6)")
    parser.add_argument("--n", type=int, nargs="+", help="sequence lengths (default: the full or quick set)")
    parser.add_argument("--passes", type=int, default=1,
                        help="passes over all cases, the best pass reported (default 1)")
    parser.add_argument("--sweep-passes", type=int, default=None,
                        help="passes over the crossover sweep (default 2; 1 with --quick)")
    parser.add_argument("--quiet-wait", type=float, default=3.0,
                        help="before each case wait up to this many seconds for other load to drop (default 3)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the fused/explicit crossover sweep")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None,
                        help="dtypes to run (default: both; float32 alone where bfloat16 matmuls are only emulated, "
                             "as on AVX2 CPUs, where its long sequences would take hours)")
    add_malloc_flag(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return

    import torch

    from _machine import machine_header

    args.sweep_passes = args.sweep_passes or (1 if args.quick else 2)
    dtypes = args.dtypes or default_dtypes()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    if args.quick:
        ns, sweep_ns, reps = QUICK_N, QUICK_SWEEP_N, dict(min_repeats=3, max_repeats=10, target_s=0.5)
    else:
        ns, sweep_ns, reps = FULL_N, SWEEP_N, dict(min_repeats=5, max_repeats=40, target_s=1.0)
    ns = tuple(args.n) if args.n else ns
    address_space_gb = args.max_gb * 1.5 + 4  # headroom for torch itself and the non-score tensors
    command = "python benchmarks/bench_attention.py " + " ".join(a for a in (argv or sys.argv[1:]))
    out = [
        "## Attention (benchmarks/bench_attention.py)",
        "",
        f"Command: `{command.strip()}`",
        "",
        machine_header({"torch_threads": threads, "malloc": MALLOC[args.malloc]}),
        "",
    ]
    print("\n".join(out), flush=True)

    def measure_peaks() -> dict[str, dict]:
        found = {}
        for dtype in dtypes:
            r = spawn({"kind": "peak", "dtype": dtype, "threads": threads, "sizes": [2048, 4096],
                       "malloc": args.malloc, "repeats": 3 if args.quick else 6})
            if "error" in r:
                sys.exit(f"measuring the {dtype} matmul peak failed: {r['error']}")
            found[dtype] = r
        return found

    # Measured before and after the cases; the better of the two counts, as background load only lowers it.
    peaks_before = measure_peaks()
    print("  matmul peaks (GFLOP/s): "
          + ", ".join(f"{d} {r['gflops']:.0f}" for d, r in peaks_before.items()), file=sys.stderr, flush=True)

    specs: list[dict] = []
    skipped: list[dict] = []
    for n in ns:
        b = batch_for(n)
        for dtype in dtypes:
            for mode in MODES:
                for impl in CORES + MODULES:
                    spec = {"kind": "case", "impl": impl, "n": n, "b": b, "dtype": dtype, "mode": mode,
                            "threads": threads, "address_space_gb": address_space_gb, "malloc": args.malloc,
                            **reps}
                    if n > 4097 and impl != "fused" and impl not in MATERIALISING:
                        continue  # each call takes seconds there; the other fused rows would repeat it
                    if impl in MATERIALISING and explicit_bytes(b, n, mode) > args.max_gb * 1e9:
                        gb = explicit_bytes(b, n, mode) / 1e9
                        skipped.append({**spec, "error": f"skipped: needs ~{gb:.0f} GB"})
                        continue
                    if n > 4097:  # each call takes seconds: fewer repeats, one pass
                        spec.update(min_repeats=3, max_repeats=3)
                    specs.append(spec)

    # Several passes over all cases, the order reversed every other pass, so a burst of background load
    # spoils one pass of a case rather than all of them; each case reports its least disturbed pass.
    runs: dict[tuple, list[dict]] = {}
    for p in range(args.passes):
        for spec in specs if p % 2 == 0 else specs[::-1]:
            if p and spec["n"] > 4097:
                continue
            r = spawn(spec, quiet_wait_s=args.quiet_wait)
            runs.setdefault(_key(spec), []).append(r)
            took = f"{statistics.median(r['times_s']) * 1e3:.2f} ms" if "times_s" in r else r["error"]
            print(f"  pass {p + 1}: N={spec['n']} {spec['dtype']} {spec['mode']} {spec['impl']}: {took}",
                  file=sys.stderr, flush=True)
    results = skipped + [_best(rs) for rs in runs.values()]

    peaks_after = measure_peaks()
    peaks: dict[str, float] = {}
    for dtype in dtypes:
        runs = (peaks_before[dtype], peaks_after[dtype])
        peaks[dtype] = max(r["gflops"] for r in runs)
        sizes = "; ".join(
            f"{when}: " + ", ".join(f"{s}² {g:.0f}" for s, g in r["per_size"].items())
            for when, r in zip(("before", "after"), runs)
        )
        out.append(f"- torch.mm peak, {dtype}: **{peaks[dtype]:.0f} GFLOP/s** (best call per size, {sizes})")
    out.append("- load average (1, 5, 15 min) at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    out.append("")
    print("\n".join(out[-4:]), flush=True)

    notes = [
        "¹ modules on x (B, N, 384): their time, GFLOP/s and memory include the q/k/v and output "
        "projections (8·B·N·E² more flops); compare them with each other, cores with cores.",
        "",
        "FLOPs: 4·B·H·N²·D forward (the two attention matmuls), ×3 for forward+backward. "
        "Peak MiB: growth of the process's resident set (VmHWM after a reset via /proc/self/clear_refs, "
        "minus VmRSS before) during the first full-size call, inputs already allocated, "
        "libraries initialised on a tiny case first; it includes outputs and gradients. "
        "Median ms: the lowest of the passes' medians (`--passes`); IQR %: interquartile range of "
        "that pass's repeats over its median; bg cores: CPU cores other processes kept busy meanwhile "
        "(above ~0.3 the row was disturbed). "
        "`path` for `attend` is the kernel it chose.",
    ]
    for dtype in dtypes:
        for mode in MODES:
            title = f"### {dtype}, {'forward (inference mode)' if mode == 'fwd' else 'forward + backward'}"
            block = [title, "", table(results, peaks, dtype, mode), ""]
            print("\n".join(block), flush=True)
            out += block
    print("\n".join(notes), flush=True)
    out += notes + [""]

    if not args.no_sweep:
        sweep: dict[tuple, list[dict]] = {}
        for p in range(args.sweep_passes):
            for dtype in dtypes:
                for n in sweep_ns if p % 2 == 0 else sweep_ns[::-1]:
                    spec = {"kind": "pair", "impls": ["fused", "explicit"], "n": n, "b": batch_for(n),
                            "dtype": dtype, "mode": "fwd+bwd", "threads": threads, "malloc": args.malloc,
                            "address_space_gb": address_space_gb, **reps, "target_s": 2 * reps["target_s"]}
                    sweep.setdefault((dtype, n), []).append(spawn(spec, quiet_wait_s=args.quiet_wait))
                    print(f"  sweep pass {p + 1}: N={n} {dtype} done", file=sys.stderr, flush=True)
        block = [
            "### Crossover: fused vs explicit, forward + backward "
            f"(B = round({TOKENS_PER_BATCH} / N); sets `EXPLICIT_HALF_MAX_KEYS`)",
            "",
            "Both in one process, calls alternating round by round, so background load hits both alike; "
            "medians over the rounds.",
            "",
            sweep_table([sweep[key] for key in sorted(sweep)]),
            "",
        ]
        print("\n".join(block), flush=True)
        out += block

    if args.out:
        write_section(args.out, "\n".join(out))
        print(f"wrote {args.out}", file=sys.stderr)


def write_section(path: Path, section: str) -> None:
    """Write `section` (it starts with its own '## ' heading) into `path`, replacing only that section
    when the file already has it, so the other scripts' sections in a shared RESULTS.md survive."""
    heading = section.split("\n", 1)[0]
    text = path.read_text() if path.exists() else ""
    start = text.find(heading + "\n")
    if start < 0:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + section.rstrip("\n") + "\n"
    else:
        end = text.find("\n## ", start + len(heading))
        rest = text[end + 1:] if end >= 0 else ""
        text = text[:start] + section.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    path.write_text(text)


if __name__ == "__main__":
    main()
