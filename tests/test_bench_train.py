"""benchmarks/bench_train.py on run directories the test writes: the table, the time-to-accuracy columns and
the curves, without training anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_train.py"


def _run_dir(root: Path, name: str, accs: list[float], minutes_per_epoch: float) -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"image": {"eval_flip": True}}))
    rows = [{"epoch": e + 1, "test_acc": a, "train_time_s": 60 * minutes_per_epoch * (e + 1)}
            for e, a in enumerate(accs)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({
        "model": "vit_fmnist_quick", "parameters": 560618, "epochs": len(accs), "test_acc": accs[-1],
        "train_time_s": rows[-1]["train_time_s"], "images_per_s": 300.0, "test_views": 2}))
    return d


def test_from_runs_gives_each_seeds_minutes_to_each_accuracy(tmp_path):
    a = _run_dir(tmp_path, "fmnist_quick-seed0", [0.891, 0.921, 0.937], 3.0)
    b = _run_dir(tmp_path, "fmnist_quick-seed1", [0.874, 0.918, 0.935], 3.0)
    c = _run_dir(tmp_path, "fmnist_tutorial-seed0", [0.74, 0.86, 0.876], 0.5)
    png, out = tmp_path / "curves.png", tmp_path / "table.md"
    r = subprocess.run([sys.executable, str(SCRIPT), "--from-runs", str(a), str(b), str(c), "--png", str(png),
                        "--out", str(out), "--reach", "87.5", "92", "95"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    assert rows[0].endswith("| images/s | min to 87.5% | min to 92% | min to 95% |")
    quick, tutorial = rows[1].split(" | "), rows[2].split(" | ")
    assert quick[0] == "| fmnist_quick" and quick[4] == "2" and quick[-3:] == ["3.0, 6.0", "6.0, 9.0", "never, never |"]
    assert tutorial[0] == "| fmnist_tutorial" and tutorial[-3:] == ["1.5", "never", "never |"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
