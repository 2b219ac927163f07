"""Training beside another job: each preset's training steps alone, then beside one busy process, as a ratio.

A user's laptop or a shared server runs something else too. A training whose OpenMP threads spin at every
barrier while a core is taken loses far more than its share: this script measures how much, per preset
(classification, captioning, translation), with vitscope's thread settings as `vitscope train` applies them
(`--threads`, and what the CLI sets before torch loads), and the same with the settings given by `--env`.

    .venv/bin/python benchmarks/beside_busy.py                          # every preset, alone and beside a busy loop
    .venv/bin/python benchmarks/beside_busy.py --busy python torch      # beside a Python loop, and a 1-thread matmul
    .venv/bin/python benchmarks/beside_busy.py --env GOMP_SPINCOUNT=300000   # libgomp's default spinning instead

Each case is a fresh process that trains `--steps` optimizer steps (data and model built first, untimed) and
reports the loop's training time; the figure is seconds per step, the median of `--passes` runs. The busy
process starts before the training and is killed after it. Prints the machine and versions beside the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_header  # noqa: E402

PRESETS = {"fmnist_quick": 20, "caption_quick": 10, "translate_rnn": 60}  # preset: steps timed

STEP = r"""
import json, sys, tempfile
from vitscope.console import prepare_threads
prepare_threads()
from vitscope.training.loop import train
from vitscope.training.recipes import get_recipe
name, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = get_recipe(name)
cfg.explain_images, cfg.eval_every_steps = 0, 0
if cfg.image is not None:
    cfg.image.init_weights = None
cfg.threads = threads or cfg.threads
with tempfile.TemporaryDirectory() as d:
    r = train(cfg, d, progress=False, max_steps=steps)
import torch
print(json.dumps({"s_per_step": r.train_time_s / steps, "threads": torch.get_num_threads()}))
"""

BUSY = {
    "python": "while True: pass",
    "torch": "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True: a = (a @ a).tanh()",
}


def one(preset: str, steps: int, env: dict, busy: str | None, threads: int = 0) -> dict:
    other = subprocess.Popen([sys.executable, "-c", BUSY[busy]]) if busy else None
    try:
        if other is not None:
            time.sleep(1.0)  # the busy process is running before the training starts
        out = subprocess.run([sys.executable, "-c", STEP, preset, str(steps), str(threads)], env={**os.environ, **env},
                             capture_output=True, text=True, timeout=3600, cwd=ROOT)
    finally:
        if other is not None:
            other.kill()
            other.wait()
    if out.returncode != 0:
        raise SystemExit(f"{preset}: the training failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", choices=list(PRESETS), default=list(PRESETS))
    ap.add_argument("--busy", nargs="+", choices=list(BUSY), default=["python"])
    ap.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                    help="environment variables for the training processes (e.g. GOMP_SPINCOUNT=300000: libgomp's "
                         "default spinning)")
    ap.add_argument("--threads", type=int, default=0, help="--threads for the trainings (0: the preset's)")
    ap.add_argument("--busy-none", action="store_true", help="time the trainings alone only (beside whatever runs)")
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--steps-scale", type=float, default=1.0, help="time this many times each preset's steps")
    args = ap.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in args.env)
    print(machine_header({"training environment": env or "as vitscope sets it"}))
    print("| preset | threads | alone (s/step) | " + " | ".join(f"beside {b} (s/step) | slower" for b in args.busy)
          + " |")
    print("|---|---:|---:|" + "---:|---:|" * len(args.busy))
    for preset in args.presets:
        steps = max(2, int(PRESETS[preset] * args.steps_scale))
        alone = [one(preset, steps, env, None, args.threads) for _ in range(args.passes)]
        base = statistics.median(r["s_per_step"] for r in alone)
        cells = []
        for b in [] if args.busy_none else args.busy:
            t = statistics.median(one(preset, steps, env, b, args.threads)["s_per_step"] for _ in range(args.passes))
            cells += [f"{t:.3f}", f"{t / base:.2f}x"]
        print(f"| {preset} | {alone[0]['threads']} | {base:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
