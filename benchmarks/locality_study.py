"""Do a small ViT's heads become local? Each run one change to tutorial 2's model, read from the run's probes.

    python benchmarks/locality_study.py                 # every run below, one after another (hours on 2 cores)
    python benchmarks/locality_study.py augment cutmix  # the named ones
    python benchmarks/locality_study.py --report        # only read the runs already in --out
    python benchmarks/locality_study.py --report --json docs/tutorials/checkpoints/locality_study.json

Each run is `vitscope train --preset fmnist_tutorial` with tutorial 2's model (width 32, 4 blocks of 4 heads,
MLP ratio 2, patch 4: 49 tokens of 4 x 4 pixels) and one change. A run keeps every head's mean attention
distance at each evaluation (probes.safetensors, the class token left out and each row renormalised over the
patches, as tutorial 2 computes it); the report gives, at the run's last evaluation, the nearest and the
farthest head against the distance of uniform attention over the same grid, and the test accuracy. A head
as local as the ViT paper's lowest ones (Figure 7) would sit at a fraction of the uniform distance.

What it found (AMD EPYC Zen 3, float32, one thread each, 2026-11-29; seed 0):

    run        change                                         epochs  accuracy  heads' mean distance (uniform)
    patch2     patch 2: 196 tokens of 2 x 2 pixels                 2    78.2%   14.3-14.9 px (14.6)
    patch2_sc  patch 2, sincos2d positions                         2    75.8%   13.5-14.9 px (14.6)
    augment    random crops (pad 2) and flips                     20    86.3%   13.3-15.2 px (14.4)
    wide       width 64, sincos2d positions, crops and flips      10    84.0%   13.0-16.9 px (14.4)
    cutmix     CutMix on every batch, crops and flips             15    80.3%   13.8-15.0 px (14.4)
    pixels     scikit-learn's 8 x 8 digits, tokens of one pixel  100    90.5%   3.7-4.2 px (4.1)

No head became local: the nearest kept at least 89% of uniform attention's distance, with or without augmentation, with
finer tokens (one pixel each: a token alone cannot see a stroke) and with CutMix. The patch-2 and wide
runs were stopped early (the epochs given), the machine being shared. Tutorial 2 builds its table from the
--json file (each run's distances at its last evaluation, its accuracy, epochs and command) and sets the findings
beside Raghu et al. (2021), who found that large-scale pre-training data helps a ViT's lowest layers attend
locally.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from vitscope.inspect import read_probes

TUTORIAL_MODEL = ["--preset", "fmnist_tutorial", "--set", "depth=4", "--set", "num_heads=4", "--set", "mlp_ratio=2"]
CROPS = ["--aug-crop", "pad", "--aug-flip", "true"]
# name: (the change to the checkpoint's command, epochs, the change in words)
RUNS = {
    "patch2": (["--set", "patch_size=2"], 8),
    "patch2_sc": (["--set", "patch_size=2", "--set", "pos_embed=sincos2d"], 8),
    "augment": (CROPS, 20),
    "wide": (["--set", "embed_dim=64", "--set", "pos_embed=sincos2d", *CROPS], 20),
    "cutmix": ([*CROPS, "--aug-cutmix-alpha", "1.0", "--aug-mix-prob", "1.0"], 15),
    "pixels": (["--dataset", "digits", "--set", "img_size=8", "--set", "patch_size=1"], 100),
}


def command(name: str, out: Path) -> list[str]:
    change, epochs = RUNS[name]
    return ["vitscope", "train", *TUTORIAL_MODEL, *change, "--epochs", str(epochs), "--threads", "1", "--seed", "0",
            "--explain-images", "0", "--out", str(out / name), "--overwrite"]


def train(name: str, out: Path) -> None:
    cmd = command(name, out)
    print(" ".join(cmd), flush=True)
    subprocess.run([sys.executable, "-m", *cmd], check=True)


def report(name: str, out: Path) -> dict | None:
    """The run's line of the table, printed, and as a dict for --json; None where the run is missing."""
    run = out / name
    if not (run / "probes.safetensors").is_file():
        print(f"{name:10s} (no run in {run})")
        return None
    probes = read_probes(run)
    first, last = probes.steps[0], probes.steps[-1]
    uniform = float(probes.distance(first).mean())  # at step 0 every head attends about evenly
    d = probes.distance(last)  # (layers, heads)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evaluated = [r for r in rows if "test_acc" in r]
    accuracy = f"{evaluated[-1]['test_acc']:.1%}" if evaluated else "-"
    epoch = evaluated[-1]["epoch"] if evaluated else "-"
    print(f"{name:10s} step {last:6d}  epoch {epoch:>4}  accuracy {accuracy:>6}  "
          f"heads {float(d.min()):.1f}-{float(d.max()):.1f} px (uniform {uniform:.1f}); nearest/uniform "
          f"{float(d.min()) / uniform:.2f}")
    return {"step": last, "epoch": epoch, "test_acc": evaluated[-1]["test_acc"] if evaluated else None,
            "uniform": round(uniform, 3), "distance": [[round(float(v), 3) for v in row] for row in d],
            "command": " ".join(command(name, Path("runs/locality")))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help=f"runs to train, of {', '.join(RUNS)} (default: all)")
    parser.add_argument("--out", type=Path, default=Path("runs/locality"))
    parser.add_argument("--report", action="store_true", help="only read the runs already trained")
    parser.add_argument("--json", type=Path, help="also write the table here (tutorial 2 reads it)")
    args = parser.parse_args()
    names = args.runs or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"no run named {', '.join(unknown)}; the runs are {', '.join(RUNS)}")
    if not args.report:
        for name in names:
            train(name, args.out)
    table = {name: report(name, args.out) for name in names}
    if args.json:
        args.json.write_text(json.dumps({k: v for k, v in table.items() if v is not None}, indent=1) + "\n")


if __name__ == "__main__":
    main()
