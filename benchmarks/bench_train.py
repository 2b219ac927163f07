"""Time to accuracy on Fashion-MNIST: train presets (one process each, one after another) and print
test accuracy against training wall time, with the machine and versions beside it.

    python benchmarks/bench_train.py --presets fmnist_quick fmnist_tutorial --seeds 0 1
    python benchmarks/bench_train.py --from-runs runs/bench/*      # tabulate runs already made

Writes a markdown table (stdout, and --out FILE) and the curves (accuracy vs wall time) as a PNG.
Runs must not share the machine with other heavy work: wall time is the measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_header  # noqa: E402


def run_preset(preset: str, seed: int, out: Path, extra: list[str]) -> Path:
    run_dir = out / f"{preset}-seed{seed}"
    cmd = [sys.executable, "-m", "vitscope", "train", "--preset", preset, "--seed", str(seed), "--no-progress",
           "--explain-images", "0", "--out", str(run_dir), *extra]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return run_dir


def load_run(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"dir": run_dir, "summary": summary, "config": config, "metrics": metrics}


def preset_of(run: dict) -> str:
    """The run directory's name without its `-seedN`: the table's row and the plot's colour."""
    return run["dir"].name.rsplit("-seed", 1)[0]


def minutes_to(run: dict, acc_pct: float) -> float | None:
    """Training minutes at the end of the first epoch whose test accuracy reached `acc_pct`, or None."""
    return next((row["train_time_s"] / 60 for row in run["metrics"] if 100 * row["test_acc"] >= acc_pct), None)


def table(runs: list[dict], reach: list[float]) -> str:
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(preset_of(r), []).append(r)
    lines = ["| preset | model | params | epochs | seeds | test views | test acc % (each) | mean | train min (each) "
             "| images/s |" + "".join(f" min to {a:g}% |" for a in reach),
             "|---|---|---:|---:|---:|---:|---|---:|---|---:|" + "---:|" * len(reach)]
    for name, rs in groups.items():
        accs = [100 * r["summary"]["test_acc"] for r in rs]
        mins = [r["summary"]["train_time_s"] / 60 for r in rs]
        ips = statistics.mean(r["summary"]["images_per_s"] for r in rs)
        s = rs[0]["summary"]
        image = rs[0]["config"].get("image") or rs[0]["config"]  # nested, or older
        views = s.get("test_views", 2 if image.get("eval_flip") else 1)  # older runs: no field
        lines.append(f"| {name} | {s['model']} | {s['parameters']:,} | {s['epochs']} | {len(rs)} | {views} | "
                     f"{', '.join(f'{a:.2f}' for a in accs)} | {statistics.mean(accs):.2f} | "
                     f"{', '.join(f'{m:.1f}' for m in mins)} | {ips:.0f} |"
                     + "".join(f" {_reached(rs, a)} |" for a in reach))
    return "\n".join(lines)


def _reached(runs: list[dict], acc_pct: float) -> str:
    """Each seed's minutes to `acc_pct` (the end of the epoch that reached it), "never" where none did."""
    times = [minutes_to(r, acc_pct) for r in runs]
    return ", ".join("never" if t is None else f"{t:.1f}" for t in times)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    # One colour per preset, a solid line for its first seed and dashed for the others: with more than
    # ten runs, matplotlib's default cycle would give two presets the same colour.
    presets = list(dict.fromkeys(preset_of(r) for r in runs))
    colours = plt.get_cmap("tab10" if len(presets) <= 10 else "tab20").colors
    seen: set[str] = set()
    for r in runs:
        m, preset = r["metrics"], preset_of(r)
        ax.plot([row["train_time_s"] / 60 for row in m], [100 * row["test_acc"] for row in m], "o",
                ls="--" if preset in seen else "-", ms=3, color=colours[presets.index(preset) % len(colours)],
                label=r["dir"].name)
        seen.add(preset)
    ax.axhline(92, color="grey", ls="--", lw=0.8)  # the quick target
    ax.axhline(95, color="grey", ls="--", lw=0.8)  # the best target
    ax.axvline(60, color="grey", ls=":", lw=0.8)
    ax.axvline(10, color="grey", ls=":", lw=0.8)
    ax.set(xlabel="training wall time (min, 2 CPU cores)", ylabel="test accuracy (%)",
           title="Fashion-MNIST: accuracy against training time", ylim=(80, 96))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="*", default=["fmnist_quick", "fmnist_tutorial"])
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1])
    ap.add_argument("--runs-dir", type=Path, default=Path("runs/bench"))
    ap.add_argument("--from-runs", nargs="*", type=Path, help="tabulate these run directories instead of training")
    ap.add_argument("--png", type=Path, default=Path("benchmarks/train_curves.png"))
    ap.add_argument("--out", type=Path, help="also write the markdown here")
    ap.add_argument("--reach", nargs="*", type=float, default=[87.5, 92.0, 95.0],
                    help="test accuracies (%%) whose time to reach gets a column (default: 87.5 92 95)")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: flags passed to every `vitscope train`")
    args = ap.parse_args()
    extra = [a for a in args.extra if a != "--"]
    if args.from_runs:
        dirs = [d for d in args.from_runs if (d / "summary.json").is_file()]
    else:
        dirs = [run_preset(p, s, args.runs_dir, extra) for p in args.presets for s in args.seeds]
    runs = [load_run(d) for d in dirs]
    plot(runs, args.png)
    text = f"{machine_header()}\n\n{table(runs, args.reach)}\n\nCurves: `{args.png}`\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
