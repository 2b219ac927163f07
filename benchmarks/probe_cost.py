"""What a run's probes cost: the time to compute and write one evaluation's probes, times the evaluations a
preset's run makes, against that run's training time; and the size of the probes file at the end.

    .venv/bin/python benchmarks/probe_cost.py                      # fmnist_quick, caption_quick, translate_rnn
    .venv/bin/python benchmarks/probe_cost.py --train-s translate_rnn=60 fmnist_quick=1200

The training time per preset is given (`--train-s`, seconds), as a full run's summary.json reports it on the
machine; the probes are timed here on the preset's freshly built model (the cost does not depend on training).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vitscope.console import prepare_threads

prepare_threads()  # as the vitscope command runs a training: before torch loads

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_header  # noqa: E402
from vitscope.training.probes import ProbeLog  # noqa: E402
from vitscope.training.recipes import get_recipe  # noqa: E402
from vitscope.training.setup import setup  # noqa: E402

# Training seconds of a full run on the Zen 3 EPYC (2 cores, float32): README and RESULTS.md
TRAIN_S = {"fmnist_quick": 1200.0, "caption_quick": 900.0, "translate_rnn": 60.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=list(TRAIN_S))
    ap.add_argument("--train-s", nargs="*", default=[], metavar="PRESET=SECONDS")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    train_s = {**TRAIN_S, **{k: float(v) for k, v in (kv.split("=") for kv in args.train_s)}}
    print(machine_header())
    print("| preset | evaluations + step 0 | one probe (ms) | all probes (s) | of training | file (kB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.presets:
        cfg = get_recipe(name)
        if cfg.image is not None:
            cfg.image.init_weights = None
        s = setup(cfg, torch.device("cpu"), resume=False)
        task = s.task
        steps = task.train_size // cfg.batch_size * cfg.epochs
        evals = cfg.epochs + (steps // cfg.eval_every_steps if cfg.eval_every_steps else 0) + 1
        with tempfile.TemporaryDirectory() as d:
            log = ProbeLog(Path(d), *task.probe_header())
            times = []
            for i in range(max(args.repeats, evals if evals <= 40 else args.repeats)):
                t = time.perf_counter()
                log.record(i, i, task.probe(task.model, device=torch.device("cpu"), bf16=s.bf16))
                times.append(time.perf_counter() - t)
            # the file as a run leaves it: one record per evaluation
            size = log.path.stat().st_size / len(times) * evals / 1024
        one = statistics.median(times)
        print(f"| {name} | {evals} | {1000 * one:.1f} | {one * evals:.2f} | {100 * one * evals / train_s[name]:.2f}% "
              f"| {size:.0f} |", flush=True)


if __name__ == "__main__":
    main()
