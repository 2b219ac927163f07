"""benchmarks/bench_vit224.py (ViT-S/16 and ViT-B/16 at 224 against transformers and the matmul peak): its FLOP
count against the published one, how rows are made from rounds, its answers to bad flags, and a --quick run.

No timing is checked: only that every row is there and its ratios and peak fractions are positive finite numbers.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_benchmark

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_vit224.py"


def test_forward_flops_match_the_published_counts():
    """timm and fvcore give ViT-S/16 4.6 and ViT-B/16 17.6 GMACs (multiply-adds) a 224×224 image; bench_vit.py
    counts the same model its own way (stem-aware)."""
    from vitscope.models import get_config

    bench = load_benchmark("bench_vit224")
    s16, b16 = get_config("vit_small_patch16_224"), get_config("vit_base_patch16_224")
    assert bench.forward_flops(s16) / 2 == pytest.approx(4.6e9, rel=0.01)
    assert bench.forward_flops(b16) / 2 == pytest.approx(17.6e9, rel=0.01)
    assert bench.forward_flops(s16) == load_benchmark("bench_vit").forward_flops(s16)


def test_every_implementation_builds_the_same_model():
    import torch

    bench = load_benchmark("bench_vit224")
    for preset, _ in bench.SHAPES.values():
        with torch.device("meta"):  # counts without allocating
            counts = {impl: sum(p.numel() for p in bench.build(impl, preset, {}).parameters()) for impl in bench.IMPLS}
        assert len(set(counts.values())) == 1, counts
    assert counts["vitscope"] == 86_567_656  # ViT-B/16 with its 1000-class head, as timm's


def _round(impl: str, batch: int, times: list[float]) -> dict:
    return {"impl": impl, "batch": batch, "times_s": times, "path": "sdpa", "first_s": 1.0,
            "background_cores": 0.1, "params": 10}


def test_rows_are_medians_over_rounds_against_the_fastest_transformers_row():
    bench = load_benchmark("bench_vit224")
    rows = [bench.row([_round("vitscope", 32, [1.0, 2.0, 4.0]), _round("vitscope", 32, [0.5]),
                       _round("vitscope", 32, [2.0])]),  # 16, 64 and 16 images/s: median 16
            bench.row([_round("hf-sdpa", 32, [4.0]), _round("hf-sdpa", 32, [4.0]), _round("hf-sdpa", 32, [8.0])]),
            bench.row([_round("hf-eager", 32, [8.0])] * 3),
            bench.row([_round("hf-sdpa-compile", 32, [1.0]), {"impl": "hf-sdpa-compile", "error": "Inductor failed"}])]
    assert rows[0]["images_per_s"] == 16 and rows[0]["per_round"] == [16, 64, 16]
    assert rows[3] == {"impl": "hf-sdpa-compile", "error": "Inductor failed"}
    out = bench.with_ratios(rows, gflop_per_image=2.0, peak_gflops=64.0)
    assert [r.get("ratio") for r in out] == [2.0, 1.0, 0.5, None]  # over sdpa's 8 images/s; the failed row has none
    assert out[0]["gflops"] == 32 and out[0]["peak_fraction"] == 0.5
    table = bench.targets_table({"vit_s16": {("train", "bfloat16"): out}}, native_bf16=True)
    assert "| vit_s16 | train | bfloat16 | 2.00 | ≥ 1.5 | 50 | ≥ 45 | yes |" in table
    table = bench.targets_table({"vit_s16": {("infer", "float32"): out}}, native_bf16=False)
    assert "| vit_s16 | infer | float32 | 2.00 | ≥ 1.0 | 50 |  | yes |" in table  # Zen 3: no slower, no peak target


@pytest.mark.parametrize("flags, says", [(["--rounds", "0"], "--rounds must be at least 1, got 0"),
                                         (["--shapes", "vit_l16"], "invalid choice: 'vit_l16'"),
                                         (["--steps", "-1"], "--steps must be 0")])
def test_bad_flags_get_one_line_and_exit_2(flags, says):
    r = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_quick_run_has_every_row_with_finite_ratios_and_peak_fractions(tmp_path):
    bench = load_benchmark("bench_vit224")
    out = tmp_path / "RESULTS.md"
    out.write_text("## Another section\n\nkept\n")
    cmd = [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--shapes", "vit_s16", "--dtypes", "float32",
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert "kept" in text and "(benchmarks/bench_vit224.py)" in text and "- transformers: " in text
    for mode in ("train", "infer"):
        rows = [line.strip("| ").split(" | ") for line in text.splitlines()
                if line.startswith(f"| {mode} | float32 | ")]
        assert [cells[2] for cells in rows] == [bench.LABELS[impl] for impl in bench.IMPLS]
        for cells in rows:
            ratio, percent = float(cells[6]), float(cells[8])
            assert math.isfinite(ratio) and ratio > 0 and math.isfinite(percent) and percent > 0, cells
    assert any(line.startswith("| vit_s16 | train | float32 | ") for line in text.splitlines())
    assert "torch.mm peak, float32: **" in text and "parameters in every implementation" in text
