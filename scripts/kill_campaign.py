"""A campaign of random SIGKILLs against `vitscope train`, resuming after each, that must end with the weights of
an uninterrupted run, bit for bit, as a crash-safe run must.

    .venv/bin/python scripts/kill_campaign.py --kills 30 --seed 0

A tiny ViT trains on scikit-learn's digits with a checkpoint after every step, so that much of its time is spent
writing checkpoints. First one uninterrupted run gives the reference weights and the time a process takes to
start (imports, data, model). Then the same run is started and killed with SIGKILL at a random moment, one time
in five during its start-up and otherwise up to `--slack` seconds after its first new checkpoint (so the kills
follow the machine's speed), again and again: each time after the first with `--resume`. A resume
that refuses (a run killed before its first checkpoint) is counted and the run started again with
`--overwrite`, as its message says. Any other failure ends the campaign. After `--kills` kills the last resume
runs to the end, and its last.safetensors and its metric rows are compared with the reference's.

Prints one summary line of JSON: kills, resumes, refusals, the result, wall time, the command, the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = {"img_size": 8, "patch_size": 2, "embed_dim": 16, "depth": 1, "num_heads": 2, "mlp_ratio": 2.0,
        "class_token": False, "global_pool": "avg", "drop_path_rate": 0.1}


def train_flags(epochs: int) -> list[str]:
    sets = [x for k, v in TINY.items() for x in ("--set", f"{k}={json.dumps(v)}")]
    return ["--model", "vit_tiny_patch4_28", *sets, "--dataset", "digits", "--epochs", str(epochs),
            "--batch-size", "128", "--lr", "0.01", "--warmup-epochs", "0.3", "--amp", "fp32", "--threads", "1",
            "--aug-crop", "pad", "--aug-pad", "1", "--aug-flip", "true", "--explain-images", "0",
            "--checkpoint-every-steps", "1", "--no-progress"]


_children: list[subprocess.Popen] = []


def launch(cmd: list[str], env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _children.append(proc)
    return proc


def vitscope(*args: str) -> list[str]:
    return [sys.executable, "-m", "vitscope", *args]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


def _committed(run: Path) -> int | None:
    try:
        return json.loads((run / "checkpoint.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None


def _first_commit(proc: subprocess.Popen, run: Path, before: int | None) -> None:
    """Wait until the process commits a checkpoint (every step, here) or ends. Kill times measured from it follow
    the machine's speed, however loaded it is."""
    while proc.poll() is None and _committed(run) == before:
        time.sleep(0.005)


def same_weights(a: Path, b: Path) -> tuple[bool, float]:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    if wa.keys() != wb.keys():
        return False, float("inf")
    diff = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)
    return all(torch.equal(wa[k], wb[k]) for k in wa), diff


def curve(run: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["epoch"], r["step"], r["train_loss"], r["test_acc"]) for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=30, help="SIGKILLs before the last resume runs to the end")
    ap.add_argument("--epochs", type=int, default=100, help="epochs of the tiny training (11 steps each)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill times")
    ap.add_argument("--slack", type=float, default=0.5,
                    help="seconds after a life's first checkpoint within which its kill comes")
    ap.add_argument("--work", type=Path, help="folder for the runs (default: a temporary one, removed)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = args.work or Path(tempfile.mkdtemp(prefix="kill_campaign."))
    work.mkdir(parents=True, exist_ok=True)
    flags = train_flags(args.epochs)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    t_start = time.perf_counter()

    # The reference, and the time from launch to the first checkpoint.
    ref = work / "reference"
    shutil.rmtree(ref, ignore_errors=True)
    t0 = time.perf_counter()
    proc = launch(vitscope("train", *flags, "--out", str(ref)), env)
    startup = None
    while proc.poll() is None:
        if startup is None and (ref / "checkpoint.json").exists():
            startup = time.perf_counter() - t0
        time.sleep(0.01)
    if proc.returncode != 0:
        print(proc.stderr.read(), file=sys.stderr)
        return 1
    reference_s = time.perf_counter() - t0
    startup = startup or reference_s / 2
    print(f"reference: {reference_s:.1f} s, first checkpoint after {startup:.1f} s", file=sys.stderr)

    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    kills = resumes = refusals = starts = 0
    kill_steps: list[int | None] = []
    again = False  # the last resume was refused: start again with --overwrite
    while True:
        if again:
            cmd = vitscope("train", "--config", str(run / "config.json"), "--out", str(run), "--overwrite",
                           "--no-progress")
            starts, again = starts + 1, False
        elif not (run / "config.json").exists():
            cmd, starts = vitscope("train", *flags, "--out", str(run)), starts + 1
        else:
            cmd, resumes = vitscope("train", "--resume", str(run)), resumes + 1
        proc = launch(cmd, env)
        if kills < args.kills:
            if rng.random() < 0.2:  # one kill in five during start-up: imports, data, the resume's checks
                delay = rng.uniform(0.0, startup)
            else:  # the others while it trains: a random moment after its first new checkpoint
                _first_commit(proc, run, _committed(run))
                delay = rng.uniform(0.0, args.slack)
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        proc.wait()
        err = proc.stderr.read().strip()
        if proc.returncode == -signal.SIGKILL:
            kills += 1
            kill_steps.append(_committed(run))
            print(f"kill {kills}: the checkpoint in force is of step {kill_steps[-1]}", file=sys.stderr)
            continue
        if proc.returncode == 2 and "holds no checkpoint yet" in err:
            refusals += 1  # killed before its first checkpoint: start again, as the message says
            again = True
            continue
        if proc.returncode != 0:
            print(f"the run failed after {kills} kills (exit {proc.returncode}): {err[-2000:]}", file=sys.stderr)
            return 1
        if kills >= args.kills:
            break
        # finished before enough kills: the training is too short for this many
        print(f"the run finished after only {kills} kills; raise --epochs", file=sys.stderr)
        return 1

    identical, diff = same_weights(ref / "last.safetensors", run / "last.safetensors")
    same_curve = curve(ref) == curve(run)
    summary = {
        "kills": kills, "resumes": resumes, "fresh_starts": starts, "refusals": refusals,
        "steps_committed_at_kills": kill_steps,
        "result": "bit-identical" if identical and same_curve else f"DIFFERENT (max abs diff {diff}, curve "
                                                                   f"{'same' if same_curve else 'different'})",
        "max_abs_diff": diff, "same_metrics": same_curve, "steps": curve(ref)[-1][1],
        "reference_run_s": round(reference_s, 1), "startup_s": round(startup, 2),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu": cpu_model(), "cores": os.cpu_count(), "commit": commit(), "python": platform.python_version(),
    }
    print(json.dumps(summary))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if identical and same_curve else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:  # a campaign stopped by Ctrl-C leaves no training behind
        for child in _children:
            if child.poll() is None:
                child.kill()
