"""A/B: the working tree's C kernels against another commit's, in one process, in a model's training step.

    python benchmarks/ab_native_build.py --ref HEAD --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256
    python benchmarks/ab_native_build.py --ref HEAD~3 --inference --model vit_small_patch16_224 --batch 64
    python benchmarks/ab_native_build.py --ref HEAD --attention 256 50 4 32 --rounds 10 --steps 20
    python benchmarks/ab_native_build.py --ref HEAD --ref-flags "-O3 -fPIC -fopenmp -std=gnu11" \
        --model vit_tiny_patch4_28 --set mlp_ratio=4.0 --batch 256 --dtype float32   # the compiler's flags

A change to vitscope/kernels/native/ is measured against the commit before it: that commit's kernel sources
(`git show REF:src/vitscope/kernels/native/...`) are built beside the working tree's, both libraries are
loaded, and the model's training steps (benchmarks/_ab.py), or with `--inference` its inference
forwards, alternate between them round by round, with `vitscope.kernels.native.library` answering with one
library or the other. Everything else (the Python side, the model, the batch) is the working tree's,
so the C functions' signatures must be the same in both. Separate processes would not do here: this
host's speed drifts by 10-20% over minutes, more than most kernel changes are worth.

`--attention B N H D` times the attention kernels alone instead (bfloat16, or float32 with `--dtype
float32`), as a ViT's layer calls them (vitscope.kernels.short_attention on one fused qkv projection's output,
(B, N, 3·H·D)): the forward with its log-sum-exps, and the backward, each in milliseconds per call,
alternating between the two builds.

`--ref-flags` builds the ref's sources with other compiler flags than vitscope.kernels.native.FLAGS (its
instruction sets' flags are added as ever): with `--ref HEAD` the same code compiled two ways.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from ab_fused_linear import inference_step  # noqa: E402
from vitscope.kernels import allocator, native, short_attention  # noqa: E402
from vitscope.models import create_model  # noqa: E402

NATIVE = "src/vitscope/kernels/native"


def sources_at(ref: str, into: Path) -> Path:
    """The kernel sources (*.c, *.h) of commit `ref`, written into the folder `into`."""
    root = Path(__file__).resolve().parent.parent
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{ref}:{NATIVE}"], cwd=root, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".c", ".h")):
            blob = subprocess.run(["git", "show", f"{ref}:{NATIVE}/{name}"], cwd=root, check=True,
                                  capture_output=True).stdout
            (into / name).write_bytes(blob)
    return into


_DEFINITION = r"^[a-z_0-9]+\s+({})\(([^)]*)\)\s*\{{"
_ALIAS = re.compile(r"^#define\s+(\w+)\s+(vs_\w+)\s*$", re.M)  # a header's entry point, named by its .c


def prototypes(folder: Path) -> dict[str, tuple[str, ...]]:
    """Each exported C function (vs_*) in `folder`'s sources, defined there or in a header under a macro's
    name: its parameters' types, their names left out."""
    def types(params: str) -> tuple[str, ...]:
        return tuple(" ".join(re.sub(r"\w+\s*$", "", q).split()) for q in params.split(","))

    headers = "\n".join(p.read_text() for p in sorted(folder.glob("*.h")))
    found = {}
    for path in sorted(folder.glob("*.c")):
        text = path.read_text()
        for name, params in re.findall(_DEFINITION.format(r"vs_\w+"), text, re.M):
            found[name] = types(params)
        for macro, name in _ALIAS.findall(text):
            for _, params in re.findall(_DEFINITION.format(re.escape(macro)), headers, re.M)[:1]:
                found[name] = types(params)
    return found


def differing(ours: dict[str, tuple[str, ...]], theirs: dict[str, tuple[str, ...]]) -> list[str]:
    """The working tree's C functions that the other sources lack or declare with other parameter types."""
    return sorted(name for name, types in ours.items() if theirs.get(name) != types)


def load_from(folder: Path):
    """The kernels built from `folder`'s sources, loaded and typed as vitscope.kernels.native loads its own."""
    here = native._HERE
    native._HERE = folder
    try:
        lib = native._load.__wrapped__()
    except AttributeError as e:  # ctypes: a C function the working tree types is missing there
        sys.exit(f"the kernels from {folder} lack a C function the working tree calls ({e}); run this "
                 "script from a worktree at a commit with the ref's entry points, with PYTHONPATH=<worktree>/src")
    finally:
        native._HERE = here
    if lib is None:
        sys.exit(f"the kernels from {folder} did not build or load: {native._reason}")
    return lib


def using(step, lib):
    """`step` run with vitscope.kernels.native.library() answering `lib`."""
    return ab.with_attribute(step, native, "library", lambda: lib)


def attention(args, ours, theirs) -> None:
    """The attention kernels' forward and backward alone, each build in turn, `args.rounds` rounds of
    `args.steps` calls; prints each one's median milliseconds per call and their ratio."""
    b, n, h, d = args.attention
    allocator.keep_freed_memory()  # as in the training steps: no page faults for each call's outputs
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    qkv = torch.randn(b, n, 3 * h * d).to(dtype)  # (B, N, 3·H·D), as the fused projection writes it
    scale = d ** -0.5
    out, lse = short_attention._qkv_forward(qkv, h, scale, -1, True)  # the working tree's build
    g = torch.randn_like(out)
    saved = out if n > short_attention.MAX_KEYS else out.new_empty(0)  # the blockwise backward reads rowsum(g o)
    parts = {"forward": lambda: short_attention._qkv_forward(qkv, h, scale, -1, True),
             "backward": lambda: short_attention._qkv_backward(g, qkv, lse, saved, h, scale, -1)}
    times = {(part, name): [] for part in parts for name in ("working tree", args.ref)}
    for fn in parts.values():
        for lib in (ours, theirs):
            ab.ms_per_call(using(fn, lib), 3)
    for _ in range(args.rounds):
        for part, fn in parts.items():
            for name, lib in (("working tree", ours), (args.ref, theirs)):
                times[(part, name)].append(ab.ms_per_call(using(fn, lib), args.steps))
    print(ab.machine_header())
    print(f"\n{args.dtype} attention, B = {b}, N = {n}, H = {h}, D = {d} (one layer's heads), {args.rounds} "
          f"alternating rounds of {args.steps} calls\n")
    print(f"| part | working tree ms | {args.ref} ms | {args.ref} ÷ working tree |\n|---|---:|---:|---:|")
    for part in parts:
        a, r = (statistics.median(times[(part, name)]) for name in ("working tree", args.ref))
        print(f"| {part} | {a:.3f} | {r:.3f} | **{r / a:.3f}** |")


def main(argv: list[str] | None = None) -> None:
    ap = ab.parser(__doc__)
    ab.add_model_sets(ap)
    ap.add_argument("--ref", default="HEAD", help="the commit whose kernels are B (default HEAD)")
    ap.add_argument("--inference", action="store_true", help="time inference forwards instead of training steps")
    ap.add_argument("--ref-flags", metavar="FLAGS",
                    help="compile the ref's kernels with these flags instead of vitscope.kernels.native.FLAGS (quoted, "
                         "space-separated): the same sources with other flags, with --ref HEAD")
    ap.add_argument("--attention", type=int, nargs=4, metavar=("B", "N", "H", "D"),
                    help="time the attention kernels alone (in --dtype) on a (B, N, 3·H·D) qkv instead of a model")
    args = ap.parse_args(argv)
    overrides = ab.model_overrides(ap, args)
    ours = native.library()
    if ours is None:
        sys.exit(f"vitscope's kernels cannot run here: {native.why_not()}")
    with tempfile.TemporaryDirectory(prefix="vitscope-ab-native-") as tmp:
        folder = sources_at(args.ref, Path(tmp))
        changed = differing(prototypes(native._HERE), prototypes(folder))
        if changed:  # ctypes would call them with the working tree's arguments, unchecked
            sys.exit(f"{args.ref}'s kernels declare {', '.join(changed)} otherwise than the working tree, "
                     "or lack them; the Python side calling them is the working tree's. For such a ref, run "
                     "this script from a worktree at a commit with the ref's signatures, with "
                     "PYTHONPATH=<worktree>/src")
        flags = native.FLAGS
        if args.ref_flags is not None:
            native.FLAGS = args.ref_flags.split()
        try:
            theirs = load_from(folder)
        finally:
            native.FLAGS = flags
    if args.attention:
        attention(args, ours, theirs)
        return
    torch.manual_seed(0)
    model = create_model(args.model, **overrides)
    if args.inference:
        model.eval()
        step = inference_step(model, args.batch, dtype=args.dtype)
    else:
        step = ab.training_step(model, args.batch, dtype=args.dtype)
    steps = {"working tree": using(step, ours), args.ref: using(step, theirs)}
    rates = ab.alternate(steps, batch=args.batch, rounds=args.rounds, steps_per_round=args.steps)
    print(ab.machine_header())
    what = "inference forward" if args.inference else "training step"
    print(f"\n{' '.join([args.model, *args.set])}, batch {args.batch}, {ab.step_label(args)} {what}, "
          f"{args.rounds} alternating rounds of {args.steps}\n")
    print(ab.ratio_table(rates, "working tree", args.ref, "kernels"))


if __name__ == "__main__":
    main()
