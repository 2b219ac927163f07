"""`vitscope bench`: how fast a model trains and infers on this machine, with vitscope's kernels and
without them, and which of them run here.

The repository's benchmarks/ scripts compare vitscope with other libraries and write RESULTS.md; this
command is the installed package's own check, for a user asking "is the fast path on, and what does
it give me here?". It prints the machine (CPU and the instruction sets the kernels need, or the GPU),
the state of each of vitscope's kernels (on, or why not), then a table: a preset's training step
(forward, cross-entropy, backward, fused AdamW, zero_grad) and inference forward in images/s, with
vitscope's kernels and with PyTorch's ops in their place, in alternating rounds in one process so a
drift of the machine's speed falls on both alike; and the attention call alone at the model's head
shape: vitscope's `attend` against F.scaled_dot_product_attention and the explicit softmax path.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from vitscope import kernels
from vitscope.kernels import native


def cpu_description() -> tuple[str, list[str]]:
    """The CPU's model name and which of the instruction sets vitscope's kernels use it has."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return model, [f for f in wanted if f in native.cpu_features()]


def kernel_states() -> list[tuple[str, str]]:
    """(kernel, 'on' or 'off: why') for each kernel of vitscope's registry."""
    rows = []
    for k in kernels.KERNELS:
        why = kernels.why_not(k)
        rows.append((f"{k.name}, {'/'.join(k.dtypes)} ({k.isa or 'oneDNN'})", "on" if why is None else f"off: {why}"))
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(variants: dict[str, Callable[[], None]], rounds: int, steps: int, device: torch.device,
              per_step: int, bar=None) -> dict[str, list[float]]:
    """Items per second of each variant in each round (`per_step` items a call), the rounds interleaved;
    `bar` (tqdm) advances one a step."""
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            _sync(device)
            rates[name].append(per_step * steps / (time.perf_counter() - t0))
            if bar is not None:
                bar.update(steps)
    return rates


def _model_steps(model: torch.nn.Module, batch: int, dtype: torch.dtype, device: torch.device):
    pe = model.patch_embed
    x = torch.randn(batch, pe.in_chans, *pe.img_size, device=device)
    y = torch.randint(0, model.config.num_classes, (batch,), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    half = dtype == torch.bfloat16

    def train() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def infer() -> None:
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
            model(x)

    return train, infer


def _without_kernels(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with kernels.disabled():
            fn()
    return run


def _explicit(q, k, v):
    w = torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1, dtype=torch.float32)
    return w.to(q.dtype) @ v


def _attention_calls(b: int, h: int, n: int, d: int, dtype: torch.dtype, device: torch.device):
    """{name: (forward, forward + backward)} at one head shape."""
    qkv = torch.randn(b, n, 3, h, d, device=device, dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, D) views of one tensor, as in the models
    g = torch.randn(b, h, n, d, device=device, dtype=dtype)
    out = {}
    for name, fn in (("vitscope attend", lambda q, k, v: kernels.attend(q, k, v)),
                     ("F.scaled_dot_product_attention", F.scaled_dot_product_attention),
                     ("explicit softmax", _explicit)):
        def forward(fn=fn):
            with torch.inference_mode():
                fn(q, k, v)

        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def both(fn=fn, leaves=leaves):
            fn(*leaves).backward(g)

        out[name] = (forward, both)
    return out


def run(model_name: str, overrides: dict, batch: int, dtype: torch.dtype, device: torch.device, rounds: int,
        steps: int, progress: bool = False) -> dict:
    """Every measurement as a dict (what --json prints); with `progress`, a bar on stderr."""
    from tqdm.auto import tqdm

    from vitscope.models import create_model

    torch.manual_seed(0)
    model = create_model(model_name, **overrides).to(device)
    if device.type == "cpu":
        kernels.apply(model)
    train, infer = _model_steps(model, batch, dtype, device)
    result: dict = {"model": model_name, "overrides": overrides, "batch": batch,
                    "dtype": str(dtype).removeprefix("torch."), "device": str(device), "rounds": rounds,
                    "steps": steps, "images_per_s": {}, "attention_ms": {}}
    bar = tqdm(total=10 * rounds * steps + 10, disable=not progress, unit="call", desc="vitscope bench",
               leave=False)
    for mode, fn in (("train", train), ("infer", infer)):
        variants = {"vitscope": fn, "PyTorch's ops": _without_kernels(fn)}
        for v in variants.values():  # warm-up: builds, caches, first allocations
            v()
            bar.update(1)
        rates = alternate(variants, rounds, steps, device, batch, bar)
        result["images_per_s"][mode] = {name: statistics.median(r) for name, r in rates.items()}
    cfg = model.config
    gh, gw = model.patch_embed.grid_size
    n = model.num_prefix_tokens + gh * gw
    heads, d = cfg.num_heads, cfg.embed_dim // cfg.num_heads
    result["attention_shape"] = {"batch": batch, "heads": heads, "tokens": n, "head_dim": d}
    calls = _attention_calls(batch, heads, n, d, dtype, device)
    for i, pass_name in enumerate(("forward", "forward+backward")):
        variants = {name: fns[i] for name, fns in calls.items()}
        for v in variants.values():
            v()
            bar.update(1)
        rates = alternate(variants, rounds, steps, device, 1, bar)
        result["attention_ms"][pass_name] = {name: 1e3 / statistics.median(r) for name, r in rates.items()}
    bar.close()
    return result


def report(result: dict) -> str:
    """The human-readable table of a `run` result."""
    import vitscope

    lines = []
    if result["device"].startswith("cuda"):
        lines.append(f"GPU: {torch.cuda.get_device_name(torch.device(result['device']))}")
    model, flags = cpu_description()
    lines += [f"CPU: {model} ({', '.join(flags) or 'none of avx512f, avx512_bf16, amx_bf16'}), "
              f"torch threads {torch.get_num_threads()}",
              f"torch {torch.__version__}, vitscope {getattr(vitscope, '__version__', '?')}", "",
              "vitscope's kernels here:"]
    states = kernel_states()
    width = max(len(name) for name, _ in states)
    lines += [f"  {name:<{width}}  {state}" for name, state in states]
    sets = " ".join(f"{k}={v}" for k, v in result["overrides"].items())
    lines += ["", f"{result['model']}{' ' + sets if sets else ''}, batch {result['batch']}, {result['dtype']}"
              f"{' autocast' if result['dtype'] == 'bfloat16' else ''}, {result['device']}; median of "
              f"{result['rounds']} alternating rounds of {result['steps']} steps", "",
              f"{'':<16} {'vitscope':>12} {'PyTorch ops':>12} {'speed-up':>9}"]
    for mode, label in (("train", "train images/s"), ("infer", "infer images/s")):
        r = result["images_per_s"][mode]
        ours, theirs = r["vitscope"], r["PyTorch's ops"]
        lines.append(f"{label:<16} {ours:>12,.0f} {theirs:>12,.0f} {ours / theirs:>8.2f}x")
    s = result["attention_shape"]
    lines += ["", f"attention alone, ({s['batch']}, {s['heads']}, {s['tokens']}, {s['head_dim']}), ms a call:",
              f"{'':<32} {'forward':>9} {'fwd+bwd':>9}"]
    for name in result["attention_ms"]["forward"]:
        lines.append(f"{name:<32} {result['attention_ms']['forward'][name]:>9.3f} "
                     f"{result['attention_ms']['forward+backward'][name]:>9.3f}")
    return "\n".join(lines)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="images/s with and without vitscope's kernels here, and which of them run",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit_tiny_patch4_28", help="a preset (`vitscope models`)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a model field")
    p.add_argument("--batch", type=int, default=128, help="images a step (default: 128)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="bfloat16: under bfloat16 autocast; float32: without; auto (default): bfloat16 where the "
                        "device multiplies it natively, else float32 (as `vitscope train` picks)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--rounds", type=int, default=5,
                   help="timed rounds, the variants taking turns in each; medians reported (default: 5)")
    p.add_argument("--steps", type=int, default=5, help="steps per round and variant")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.set_defaults(run=run_bench)


def run_bench(args) -> int:
    from vitscope.cli.common import UsageError, parse_model_sets
    from vitscope.models import list_models

    if args.model not in list_models():
        raise UsageError(f"unknown model {args.model!r}; `vitscope models` lists the presets")
    if args.batch < 1 or args.rounds < 1 or args.steps < 1:
        raise UsageError("--batch, --rounds and --steps take positive numbers")
    if args.device.split(":")[0] not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device}: choose cpu or cuda")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible to torch here")
    from vitscope.kernels import bf16

    name = args.dtype if args.dtype != "auto" else ("bfloat16" if bf16.native_matmul(device) else "float32")
    dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
    result = run(args.model, parse_model_sets(args.set), args.batch, dtype, device, args.rounds, args.steps,
                 progress=True)
    print(json.dumps(result, indent=1) if args.json else report(result))
    return 0
