"""Alternating in-process A/B timing of training steps, shared by the ab_*.py scripts.

Every variant lives in one process and their timed rounds alternate, so a drift of the host's speed
(about 20% here, over minutes) falls on all of them alike. A step is the training step of
vitscope.training.loop (bfloat16 autocast, or float32 with `--dtype float32`): forward, cross-entropy,
backward, the optimizer (fused AdamW unless a script chooses Muon), zero_grad. The process keeps its
freed memory (vitscope/kernels/allocator.py): a bare loop of steps faults about twice as often as
vitscope.training.loop's loop does with glibc's defaults, and kept memory brings it to the trainer's speed,
so it is the closer stand-in for the step users get.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from _machine import machine_header, rate_text
from vitscope.cli import UsageError, parse_model_sets
from vitscope.kernels import allocator
from vitscope.models import create_model
from vitscope.training.optim import OptimizerName, build_optimizer

DTYPES = ("bfloat16", "float32")


def training_step(model: nn.Module, batch: int, optimizer: OptimizerName = "adamw", *,
                  keep_freed_memory: bool = True, dtype: str = "bfloat16",
                  phase: Callable[[str, Callable[[], object]], object] | None = None) -> Callable[[], None]:
    """One training step of `model` on a fixed random batch, as a closure, under bfloat16 autocast
    (`dtype="float32"`: none); the optimizer is built as vitscope.training.loop builds it, and the process
    keeps its freed memory unless `keep_freed_memory` is False (see the module's docstring). `phase`,
    where given, runs each of the step's three parts, phase(name, part) for "forward" (with the loss),
    "backward" and "optimizer" (with zero_grad), and returns what the part returns: a way to time them."""
    if keep_freed_memory:
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


def with_attribute(step: Callable[[], None], owner: object, name: str, value: object) -> Callable[[], None]:
    """`step` run with `owner.name` set to `value` and put back after, so two variants of one switch
    (a module's constant or function) can alternate in one process."""
    def run() -> None:
        shipped = getattr(owner, name)
        setattr(owner, name, value)
        try:
            step()
        finally:
            setattr(owner, name, shipped)
    return run


def alternate(steps: dict[str, Callable[[], None]], *, batch: int, rounds: int, steps_per_round: int,
              warmup: int = 3) -> dict[str, list[float]]:
    """Images/s of each variant, one figure per round; the rounds interleave the variants."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    rates: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                step()
            rates[name].append(batch * steps_per_round / (time.perf_counter() - t0))
    return rates


def products_parser(doc: str, shapes: list[str], metavar: str) -> argparse.ArgumentParser:
    """The flags of a script that times one product alone per shape: --rows, --shapes (`metavar`, e.g.
    OUTxIN), --rounds and --reps."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--rows", type=int, default=12800)
    ap.add_argument("--shapes", nargs="+", default=shapes, metavar=metavar)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="products per round and variant")
    return ap


def ms_per_call(fn: Callable[[], object], reps: int) -> float:
    """Milliseconds per call of `fn` over `reps` calls in a row."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def alternate_calls(ours: Callable[[], torch.Tensor], theirs: Callable[[], torch.Tensor], exact: torch.Tensor, *,
                    rounds: int, reps: int) -> tuple[float, float, float, float]:
    """Two implementations of one product: (ours ms, theirs ms, ours error, theirs error), each one's median
    milliseconds per call over `rounds` alternating rounds of `reps` calls (after a warm-up of each), and its
    largest error against `exact` relative to exact's largest magnitude."""
    errs = [((f().double() - exact).abs().max() / exact.abs().max()).item() for f in (ours, theirs)]
    for f in (ours, theirs):
        ms_per_call(f, 3)
    a, b = [], []
    for _ in range(rounds):
        a.append(ms_per_call(ours, reps))
        b.append(ms_per_call(theirs, reps))
    return statistics.median(a), statistics.median(b), errs[0], errs[1]


def ratio_table(rates: dict[str, list[float]], first: str, second: str, label: str) -> str:
    """A markdown table of the rounds, and the median of the per-round ratios first ÷ second."""
    ratios = [a / b for a, b in zip(rates[first], rates[second])]
    lines = [f"| {label} | images/s per round | median |", "|---|---|---:|"]
    lines += [f"| {name} | {' '.join(rate_text(v) for v in r)} | {rate_text(statistics.median(r))} |"
              for name, r in rates.items()]
    lines.append(f"\n{first} ÷ {second}, per round: {' '.join(f'{v:.2f}' for v in ratios)}; "
                 f"median **{statistics.median(ratios):.2f}**")
    return "\n".join(lines)


def parser(doc: str) -> argparse.ArgumentParser:
    """The flags every ab_*.py script takes; a script may add its own before parsing."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--model", default="vit_fmnist_quick")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round and variant")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                    help="bfloat16: steps under bfloat16 autocast (default); float32: without autocast")
    return ap


def step_label(args: argparse.Namespace) -> str:
    """How the steps ran, for a table's caption: 'bfloat16 autocast' or 'float32'."""
    return "bfloat16 autocast" if getattr(args, "dtype", "bfloat16") == "bfloat16" else "float32"


def add_model_sets(ap: argparse.ArgumentParser) -> None:
    """`--set FIELD=VALUE`, repeatable: model config overrides as `vitscope train --set` takes them."""
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a model field as `vitscope train --set` does; repeat for more fields")


def model_overrides(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The parsed `--set` items; a bad one is the parser's usage error."""
    try:
        return parse_model_sets(args.set)
    except UsageError as e:
        ap.error(str(e))


def plain_step(doc: str, argv: list[str], flag: str,
               rounds: int) -> tuple[argparse.Namespace, dict, Callable[[], None]]:
    """A script's in-step mode (`flag`, e.g. `--in-step`): its flags parsed, the model's overrides (the plain
    28x28 ViT's `mlp_ratio=4.0` where it is the model and no `--set` is given) and the training step, by
    default the plain ViT's at batch 256."""
    ap = parser(doc)
    add_model_sets(ap)
    ap.set_defaults(model="vit_tiny_patch4_28", batch=256, rounds=rounds)
    ap.add_argument(flag, action="store_true")
    args = ap.parse_args(argv)
    overrides = model_overrides(ap, args) or ({"mlp_ratio": 4.0} if args.model == "vit_tiny_patch4_28" else {})
    torch.manual_seed(0)
    return args, overrides, training_step(create_model(args.model, **overrides), args.batch)


def main(doc: str, label: str, make_steps: Callable[[str, int], dict[str, Callable[[], None]]],
         argv: list[str] | None = None, args: argparse.Namespace | None = None) -> None:
    """An ab_*.py script's command line: build the two variants' steps, alternate them, print the table.

    `args`, when given, is already parsed (by `parser(doc)` with the script's own flags added)."""
    args = args or parser(doc).parse_args(argv)
    steps = make_steps(args.model, args.batch)
    rates = alternate(steps, batch=args.batch, rounds=args.rounds, steps_per_round=args.steps)
    print(machine_header())
    print(f"\n{args.model}, batch {args.batch}, {step_label(args)} training step, {args.rounds} alternating "
          f"rounds of {args.steps} steps\n")
    first, second = steps
    print(ratio_table(rates, first, second, label))
