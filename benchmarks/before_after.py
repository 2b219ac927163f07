"""Two commits of vitscope side by side: the same training step and inference forward, in images/s.

Each commit's `src/` is exported (`git archive`) into a temporary folder, and every measurement is one
child process whose PYTHONPATH points at that commit's code, so both run the same child script, the same
torch and the same threads. Rounds alternate the commits (before, after; then after, before; ...), so a
change in the machine's load falls on both alike; each row reports the median over rounds and the ratio.
The other processes' load is measured in every child and printed. Beside images/s (wall clock) each row gives
images per CPU-second of the child: on a machine other jobs crowd, wall time mostly measures the scheduler,
while CPU time stays the work done (with one thread, `--threads 1`, exactly: several threads also count the
time they spin waiting for each other).

The child builds `vit_tiny_patch4_28` with MLP ratio 4 (28×28×1, patch 4, width 128, depth 6, heads 4,
MLP 512) with vitscope's kernels swapped in where the commit has `vitscope.kernels.apply` (older commits ran
them from the model files themselves), and times a training step (forward, cross-entropy, backward, fused
AdamW step) and an inference forward, at batch 256, in float32 and, where the CPU multiplies bfloat16
natively (AVX512-BF16 or AMX), under bfloat16 autocast. The modes `greedy` and `beam5` time caption decoding
instead: bench_caption.py's caption_quick-shaped captioner (vitscope's, kernels swapped in), a batch of 32
encoded scenes decoded for 20 words, greedy or with beam 5 (rates in captions/s); `caption_train` times that
captioner's teacher-forced training step on 32-word captions as bench_caption.py's training row does (encoder
and decoder, AdamW; rates in images/s).

    .venv/bin/python benchmarks/before_after.py 6b0efd9 HEAD                  # ~6 min on 2 cores
    .venv/bin/python benchmarks/before_after.py 6b0efd9 HEAD --rounds 5 --dtypes bfloat16
    .venv/bin/python benchmarks/before_after.py main WORKTREE                 # WORKTREE: the files as they are now
    .venv/bin/python benchmarks/before_after.py 6b0efd9 HEAD --threads 1      # on a crowded machine: CPU time
    .venv/bin/python benchmarks/before_after.py 3615971 HEAD --modes greedy beam5 --batch 32 --threads 1
    .venv/bin/python benchmarks/before_after.py 0e012ee HEAD --modes caption_train --batch 32 --threads 1

A commit is anything `git rev-parse` takes; `WORKTREE` is this checkout's `src/` as it is on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import REPO, machine_header, rate_text  # noqa: E402

PRESET, OVERRIDES = "vit_tiny_patch4_28", {"mlp_ratio": 4.0}
WORKTREE = "WORKTREE"

# The measurement, run in a fresh interpreter for each (commit, dtype, mode): only the vitscope it imports
# differs between the commits. Old and new spellings are both tried (the package layout moved).
CHILD = r"""
import importlib, json, os, sys, time
import torch
import torch.nn.functional as F

spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
for name in ("vitscope.kernels.allocator", "vitscope.allocator"):  # keep freed memory, as `vitscope train` does
    try:
        importlib.import_module(name).keep_freed_memory()
        break
    except (ImportError, AttributeError):
        pass
from vitscope.models import create_model

torch.manual_seed(0)
train, bf16 = spec["mode"] == "train", spec["dtype"] == "bfloat16"
decoding = spec["mode"] in ("greedy", "beam5")
captioning = spec["mode"] == "caption_train"
if decoding or captioning:  # the captioner of bench_caption.py, built by this commit's vitscope (kernels applied)
    sys.path.insert(0, spec["benchmarks"])
    from bench_caption import _train_step, build_impl, quick_shape
    from vitscope.sequence.decoding import decode

    shape = quick_shape()
    model = build_impl("vitscope", shape).train(captioning)
    images = torch.randn(spec["batch"], shape["in_chans"], shape["img"], shape["img"])
    if captioning:
        tokens = torch.randint(4, shape["vocab"], (spec["batch"], 33))  # 32-word captions, as bench_caption.py's
    else:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            memory = model.encode(images)
else:
    model = create_model(spec["preset"], **spec["overrides"])
    try:
        from vitscope.kernels import apply
    except ImportError:  # the kernels ran from the model files themselves
        apply = None
    if apply is not None:
        model = apply(model)
    x = torch.randn(spec["batch"], 1, 28, 28)
    y = torch.randint(0, 10, (spec["batch"],))
    model.train(train)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if train or captioning else None


def step():
    if captioning:
        _train_step("vitscope", model, opt, images, tokens, bf16)
    elif decoding:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            decode(model, memory=memory, beam=5 if spec["mode"] == "beam5" else 1, max_len=21)
    elif train:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(x)


def busy():
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]


for _ in range(spec["warmup"]):
    step()
hz, times, cpu = os.sysconf("SC_CLK_TCK"), [], []
busy0, own0, t0 = busy(), os.times(), time.perf_counter()
for _ in range(spec["steps"]):
    t1, c1 = time.perf_counter(), time.process_time()
    step()
    times.append(time.perf_counter() - t1)
    cpu.append(time.process_time() - c1)
wall, own1 = time.perf_counter() - t0, os.times()
own = (own1.user + own1.system) - (own0.user + own0.system)
background = max(0.0, ((busy() - busy0) / hz - own) / wall)
print("RESULT " + json.dumps({"times_s": times, "cpu_s": cpu, "background_cores": background}), flush=True)
"""


def export(commit: str, into: Path) -> tuple[Path, str]:
    """`commit`'s src/ under `into` (its path, and the commit's short hash); WORKTREE is this checkout's src/."""
    if commit == WORKTREE:
        return REPO / "src", "worktree"
    rev = subprocess.run(["git", "rev-parse", "--short=10", commit], cwd=REPO, capture_output=True, text=True)
    if rev.returncode:
        sys.exit(f"before_after.py: git does not know the commit {commit!r}: give a hash, a branch or HEAD")
    into.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", rev.stdout.strip(), "src"], cwd=REPO, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait():
        sys.exit(f"before_after.py: git archive {commit} src failed")
    return into / "src", rev.stdout.strip()


def measure(src: Path, spec: dict) -> dict:
    """One child process on `src`'s vitscope: its step times and the other processes' load."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                          env=env, cwd=src.parent, timeout=1200)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.exit(f"before_after.py: the child on {src} failed:\n{proc.stderr.strip()[-2000:]}")


def native_dtypes() -> list[str]:
    """float32, and bfloat16 where the CPU multiplies it natively (AVX512-BF16 or AMX)."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        flags = set()
    return ["float32", *(["bfloat16"] if flags & {"avx512_bf16", "amx_bf16"} else [])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the commit measured first (hash, branch, HEAD~3, or WORKTREE)")
    parser.add_argument("after", help="the commit it is compared with")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=None,
                        help="default: float32, and bfloat16 where the CPU has AVX512-BF16 or AMX")
    parser.add_argument("--modes", nargs="+", choices=("train", "infer", "greedy", "beam5", "caption_train"),
                        default=["train", "infer"], help="train, infer (the ViT above); greedy, beam5 (caption "
                        "decoding), caption_train (the captioner's training step); --batch 32 as measured")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per child (median taken)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.batch < 1:
        parser.error("--rounds, --steps and --batch must be at least 1")
    dtypes = args.dtypes or native_dtypes()

    with tempfile.TemporaryDirectory(prefix="vitscope-before-after-") as tmp:
        (before, b_rev), (after, a_rev) = export(args.before, Path(tmp) / "before"), export(args.after,
                                                                                            Path(tmp) / "after")
        sides = {"before": before, "after": after}
        rates: dict[tuple[str, str, str], list[float]] = {}
        per_cpu: dict[tuple[str, str, str], list[float]] = {}
        loads: list[float] = []
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for dtype in dtypes:
                for mode in args.modes:
                    for side in order:
                        spec = {"preset": PRESET, "overrides": OVERRIDES, "dtype": dtype, "mode": mode,
                                "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
                                "threads": args.threads, "benchmarks": str(REPO / "benchmarks")}
                        out = measure(sides[side], spec)
                        rate = args.batch / statistics.median(out["times_s"])
                        rates.setdefault((dtype, mode, side), []).append(rate)
                        per_cpu.setdefault((dtype, mode, side), []).append(
                            args.batch / statistics.median(out["cpu_s"]))
                        loads.append(out["background_cores"])
                        print(f"round {r + 1}: {dtype} {mode} {side}: {rate_text(rate)} images/s, "
                              f"{rate_text(per_cpu[(dtype, mode, side)][-1])} per CPU-second "
                              f"(other processes {out['background_cores']:.2f} cores)", file=sys.stderr, flush=True)

    print(f"vitscope {args.before} ({b_rev}) against {args.after} ({a_rev}): {PRESET} with MLP ratio 4, batch "
          f"{args.batch}, {args.rounds} alternating rounds of one child each, median of {args.steps} steps\n")
    print(machine_header({"other processes' load during the children (cores, median / max)":
                          f"{statistics.median(loads):.2f} / {max(loads):.2f}"}))
    print(f"\nMedians over rounds, {args.threads} threads.\n")
    print("| dtype | mode | before (images/s) | after (images/s) | after / before | rounds (before / after) "
          "| before (images per CPU-s) | after (images per CPU-s) | after / before |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|")
    for dtype in dtypes:
        for mode in args.modes:
            b, a = rates[(dtype, mode, "before")], rates[(dtype, mode, "after")]
            cb = statistics.median(per_cpu[(dtype, mode, "before")])
            ca = statistics.median(per_cpu[(dtype, mode, "after")])
            pairs = ", ".join(f"{rate_text(x)} / {rate_text(y)}" for x, y in zip(b, a))
            print(f"| {dtype} | {mode} | {rate_text(statistics.median(b))} | {rate_text(statistics.median(a))} "
                  f"| {statistics.median(a) / statistics.median(b):.3f} | {pairs} "
                  f"| {rate_text(cb)} | {rate_text(ca)} | {ca / cb:.3f} |")


if __name__ == "__main__":
    main()
