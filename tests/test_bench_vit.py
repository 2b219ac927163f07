"""benchmarks/bench_vit.py end to end on tiny settings: it runs, measures and writes its own section.

A smoke test of the script, not a timing: the numbers are not checked, only that every piece works.
The end-to-end run is marked slow (half a minute of worker processes): CI runs it after the default suite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_vit.py"
SECTION = "## ViT training and inference (benchmarks/bench_vit.py)"


@pytest.mark.slow
def test_quick_run_writes_its_section_and_keeps_the_others(tmp_path):
    out = tmp_path / "RESULTS.md"
    out.write_text("## Attention (benchmarks/bench_attention.py)\n\nkept\n\n" + SECTION + "\n\nSTALE-ROW\n")
    cmd = [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--cases", "fmnist_plain",
           "--impls", "vitscope", "tutorial", "--dtypes", "float32", "--modes", "train",
           "--train-batch", "4", "--warmup", "0", "--steps", "2", "--passes", "2", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert "kept" in text and "STALE-ROW" not in text and text.count(SECTION) == 1
    rows = [line for line in text.splitlines() if line.startswith("| train | float32 | no |")]
    assert [row.split(" | ")[3] for row in rows] == ["vitscope", "tutorial"], rows
    assert all("1,199,882" in row for row in rows)  # the same shape in every implementation
    targets = [line for line in text.splitlines() if line.startswith("| fmnist_plain | train | no |")]
    assert targets  # the targets table
    assert len(targets[0].split(" | ")[7].split()) == 2  # vitscope's ratio to the tutorial in each pass
    assert "- passes: 2" in text


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_vit", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return bench


def test_each_row_is_its_cases_median_pass():
    bench = _bench_module()
    runs = [{"batch": 10, "times_s": [t], "pass": i} for i, t in enumerate([0.5, 0.2, 0.1])]
    row = bench.median_pass(runs)
    assert row["pass"] == 1 and row["passes_images_per_s"] == [20.0, 50.0, 100.0]
    failed = {"batch": 10, "error": "out of memory"}
    assert bench.median_pass([runs[0], failed]) is failed


def test_slow_shapes_keep_a_decimal_of_images_per_second():
    rate_text = _bench_module().rate_text  # _machine's, which the A/B scripts' tables use too
    assert [rate_text(x) for x in (3.64, 44.06, 99.96, 100.4, 1574.2)] == ["3.6", "44.1", "100", "100", "1,574"]
