"""Where a training step's time goes: torch.profiler's operators, by their own CPU time.

    python benchmarks/profile_step.py                                   # the quick preset, batch 128
    python benchmarks/profile_step.py --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/profile_step.py --optimizer muon --rows 30
    python benchmarks/profile_step.py --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256 --time-kernels
    python benchmarks/profile_step.py --kernels false                      # PyTorch's ops alone, for comparison
    python benchmarks/profile_step.py --model vit_small_patch16_224 --batch 32 --dtype float32 --steps 2 --compile
    perf record -e cpu-clock -D 6000 -o /tmp/perf.data python benchmarks/profile_step.py \
        --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256 --loop 16   # then: perf report -i /tmp/perf.data

The step is `vitscope train`'s on a CPU, on a fixed random batch: the preset built with vitscope's kernels
swapped in (`create_model(..., kernels=True)`), bfloat16 autocast (`--dtype float32`: none), forward,
cross-entropy, backward, the optimizer as vitscope.training.loop builds it, zero_grad; the process keeps its
freed memory (vitscope.kernels.allocator), which brings a bare loop of steps to the trainer's speed.
`--kernels false` runs the same steps inside `vitscope.kernels.disabled()`: PyTorch's ops alone. After a
warm-up it profiles `--steps` steps and prints the machine, then the operators sorted by self CPU time.
`--time-kernels` times instead each call into vitscope's C kernels (native.library() answers a wrapper that times
them) and each part of the step (forward with the loss, backward, optimizer), and prints per part the time
inside the kernels and outside them (Python, autograd, PyTorch's own ops), and per kernel its calls and
time: how much of the step the kernels can still win, and what is left around them. With `--loop SECONDS` it
only runs steps for that long, for a sampling profiler outside Python to watch (perf's cpu-clock event works
where the CPU's counters are not exposed, as in this project's VMs; -D skips the start-up). `--compile` runs
the model through torch.compile first (traced in the warm-up, untimed): vitscope's kernels appear as their
custom ops (`vitscope::mlp_f32` and the like) and Inductor's code as `CompiledFxGraph` calls, to set beside
the eager profile's rows.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_header  # noqa: E402
from vitscope import kernels as vitscope_kernels  # noqa: E402
from vitscope.cli import UsageError, parse_model_sets  # noqa: E402
from vitscope.kernels import allocator, native  # noqa: E402
from vitscope.models import create_model  # noqa: E402
from vitscope.training.optim import build_optimizer  # noqa: E402


def training_step(model: nn.Module, batch: int, optimizer: str = "adamw", *, dtype: str = "bfloat16",
                  phase: Callable[[str, Callable[[], object]], object] | None = None) -> Callable[[], None]:
    """One training step of `model` on a fixed random batch, as a closure. `phase`, where given, runs each
    of the step's three parts, phase(name, part) for "forward" (with the loss), "backward" and "optimizer"
    (with zero_grad), and returns what the part returns: a way to time them."""
    allocator.keep_freed_memory()
    pe = model.patch_embed
    x = torch.randn(batch, pe.in_chans, *pe.img_size)
    y = torch.randint(0, model.config.num_classes, (batch,))  # the model's own: --set num_classes counts
    opt = build_optimizer(optimizer, model, lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999), device=torch.device("cpu"))

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            return nn.functional.cross_entropy(model(x), y)

    def update() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step() -> None:
        if phase is None:
            forward().backward()
            update()
        else:
            loss = phase("forward", forward)
            phase("backward", loss.backward)
            phase("optimizer", update)

    return step


def step_label(args: argparse.Namespace) -> str:
    """How the steps ran, for a table's caption."""
    dtype = "bfloat16 autocast" if args.dtype == "bfloat16" else "float32"
    return dtype + (", PyTorch's ops alone (vitscope.kernels.disabled)" if not args.kernels else "")


class _TimedLibrary:
    """Stands in for the loaded kernels: each C function called through it adds its wall time and a call to
    `seconds` and `calls` under its name, and to `total[0]`."""

    def __init__(self, lib):
        self._lib = lib
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.total = [0.0]

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)

        def timed(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                dt = time.perf_counter() - t0
                self.seconds[name] += dt
                self.calls[name] += 1
                self.total[0] += dt
        return timed


def kernels(args, model) -> None:
    """`--time-kernels`: the step's parts, inside vitscope's C kernels and outside them, and each kernel's time."""
    lib = native.library()
    if lib is None:
        sys.exit(f"vitscope's kernels do not run here: {native.unavailable()}")
    timed = _TimedLibrary(lib)
    parts: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])  # part: [wall, in kernels]

    def phase(name, part):
        k0, t0 = timed.total[0], time.perf_counter()
        out = part()
        parts[name][0] += time.perf_counter() - t0
        parts[name][1] += timed.total[0] - k0
        return out

    step = training_step(model, args.batch, args.optimizer, dtype=args.dtype, phase=phase)
    native.library = lambda: timed  # every caller asks native.library() at each call
    for _ in range(3):
        step()
    parts.clear()
    timed.seconds.clear()
    timed.calls.clear()
    for _ in range(args.steps):
        step()
    n = args.steps
    print(machine_header())
    name = " ".join([args.model, *args.set])
    print(f"\n{name}, batch {args.batch}, {args.optimizer}, {step_label(args)} training step, {n} steps\n")
    print("| part | ms a step | in vitscope's kernels | outside them |\n|---|---:|---:|---:|")
    for part, (wall, inside) in [*parts.items(), ("whole step", [sum(v[0] for v in parts.values()),
                                                              sum(v[1] for v in parts.values())])]:
        print(f"| {part} | {wall / n * 1e3:.1f} | {inside / n * 1e3:.1f} | {(wall - inside) / n * 1e3:.1f} |")
    print("\n| kernel | calls a step | ms a step |\n|---|---:|---:|")
    for kernel, seconds in timed.seconds.most_common():
        print(f"| {kernel} | {timed.calls[kernel] / n:g} | {seconds / n * 1e3:.2f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_fmnist_quick", help="a model preset (default vit_fmnist_quick)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a model field as `vitscope train --set` does; repeat for more fields")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8, help="steps profiled (or timed, with --time-kernels)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="bfloat16: steps under bfloat16 autocast (default); float32: without autocast")
    ap.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    ap.add_argument("--kernels", type=lambda v: {"true": True, "false": False}[v.lower()], default=True,
                    metavar="{true,false}",
                    help="false: run the steps inside vitscope.kernels.disabled(), PyTorch's ops alone (default: true)")
    ap.add_argument("--rows", type=int, default=20, help="operators to list")
    ap.add_argument("--loop", type=float, metavar="SECONDS",
                    help="run steps for SECONDS without torch.profiler (for perf record and the like)")
    ap.add_argument("--time-kernels", action="store_true",
                    help="time the calls into vitscope's C kernels and the step's parts instead of profiling")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (traced in the warm-up)")
    args = ap.parse_args(argv)
    try:
        overrides = parse_model_sets(args.set)
    except UsageError as e:
        ap.error(str(e))
    if args.time_kernels and args.compile:
        ap.error("--time-kernels times the eager step's calls; leave out --compile")
    if args.time_kernels and not args.kernels:
        ap.error("--time-kernels times vitscope's kernels; leave out --kernels false")
    torch.manual_seed(0)
    model = create_model(args.model, kernels=True, **overrides)
    if args.compile:
        model = torch.compile(model)
    if args.time_kernels:
        kernels(args, model)
        return
    with vitscope_kernels.disabled() if not args.kernels else contextlib.nullcontext():
        run(args, model)


def run(args: argparse.Namespace, model: nn.Module) -> None:
    """The profile (or with --loop, the bare loop of steps)."""
    step = training_step(model, args.batch, args.optimizer, dtype=args.dtype)
    for _ in range(3):
        step()
    if args.loop is not None:
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.loop:
            step()
            steps += 1
        ms = (time.perf_counter() - t0) / max(steps, 1) * 1e3
        print(f"{steps} steps, {ms:.1f} ms a step ({args.batch * 1e3 / ms:.0f} images/s)")
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    print(machine_header())
    name = " ".join([args.model, *args.set])
    print(f"\n{name}, batch {args.batch}, {args.optimizer}, {step_label(args)} training step"
          f"{', compiled' if args.compile else ''}, {args.steps} steps profiled\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
