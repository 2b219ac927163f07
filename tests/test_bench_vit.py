"""The CPU benchmark scripts (benchmarks/bench_vit.py, bench_attention.py, profile_step.py) on tiny settings:
they run, time vitscope with its kernels applied, and print or write their tables.

Smoke tests of the scripts, not timings: no number is checked, only that every piece works, on any CPU
(where vitscope's kernels cannot run, the scripts time PyTorch's ops and say so). The runs that take more
than a few seconds (worker processes, torch.compile, profiling) are marked slow: CI runs them after the
default suite.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import load_benchmark

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "bench_vit.py"
SECTION = "## ViT training and inference (benchmarks/bench_vit.py)"




def _float32_attention_kernel_runs() -> bool:
    from vitscope.kernels import short_attention

    return short_attention.build_for(torch.float32) is not None


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
    assert "- vitscope's kernels that run here: " in text
    rows = [line for line in text.splitlines() if line.startswith("| train | float32 | no |")]
    assert [row.split(" | ")[3] for row in rows] == ["vitscope", "tutorial"], rows
    assert all("1,199,882" in row for row in rows)  # the same shape in every implementation
    # vitscope's row ran its attention kernel wherever this CPU has one: the worker applied the kernels
    assert rows[0].split(" | ")[4] == ("vitscope kernel" if _float32_attention_kernel_runs() else "sdpa")
    targets = [line for line in text.splitlines() if line.startswith("| fmnist_plain | train | float32 | no |")]
    assert targets  # the table against the references
    assert targets[0].split(" | ")[5] == "tutorial"  # the only other implementation run
    assert len(targets[0].split(" | ")[8].split()) == 2  # vitscope's ratio to it in each pass
    assert "- passes: 2" in text


def test_vitscope_is_timed_with_its_kernels_applied():
    from vitscope.kernels.modules import FastViT
    from vitscope.vit import VisionTransformer

    bench = load_benchmark("bench_vit")
    for shape in bench.SHAPES:
        assert type(bench.build_model("vitscope", shape)) is FastViT
    assert type(bench.build_model("vitscope", "fmnist_plain", kernels=False)) is VisionTransformer
    model = bench.build_model("vitscope", "fmnist_plain")
    x = torch.randn(2, 1, 28, 28)
    path = bench._kernel_used(lambda: model(x), True)
    assert path == ("vitscope kernel" if _float32_attention_kernel_runs() else "fused")


def test_each_row_is_its_cases_median_pass():
    bench = load_benchmark("bench_vit")
    runs = [{"batch": 10, "times_s": [t], "pass": i} for i, t in enumerate([0.5, 0.2, 0.1])]
    row = bench.median_pass(runs)
    assert row["pass"] == 1 and row["passes_images_per_s"] == [20.0, 50.0, 100.0]
    failed = {"batch": 10, "error": "out of memory"}
    assert bench.median_pass([runs[0], failed]) is failed


def test_slow_shapes_keep_a_decimal_of_images_per_second():
    rate_text = load_benchmark("bench_vit").rate_text  # _machine's, which every script's tables use
    assert [rate_text(x) for x in (3.64, 44.06, 99.96, 100.4, 1574.2)] == ["3.6", "44.1", "100", "100", "1,574"]


@pytest.mark.parametrize("train", [False, True])
def test_attention_bench_times_vitscope_through_its_kernels(train):
    """bench_attention.py's `attend` and `vitscope MHA` rows are vitscope.kernels': its C kernel where this
    CPU runs one for float32 (ViT-S heads, 64 wide), PyTorch's own path elsewhere."""
    bench = load_benchmark("bench_attention")
    step, path = bench._build("attend", 2, 65, torch.float32, train)
    step()
    assert path == ("vitscope kernel" if _float32_attention_kernel_runs() else "fused")
    step, path = bench._build("vitscope MHA", 2, 65, torch.float32, train)
    step()
    assert path == "attend: " + ("vitscope kernel" if _float32_attention_kernel_runs() else "fused")


def _profile(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / "profile_step.py"), *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_profile_lists_the_operators():
    r = _profile("--set", "depth=1", "--batch", "4", "--steps", "1", "--rows", "5")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Self CPU time total" in r.stdout and "aten::" in r.stdout


@pytest.mark.slow
def test_profile_without_the_kernels_says_so():
    r = _profile("--set", "depth=1", "--batch", "4", "--steps", "1", "--rows", "5", "--dtype", "float32",
                 "--kernels", "false")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "float32, PyTorch's ops alone (vitscope.kernels.disabled) training step" in r.stdout
    both = _profile("--time-kernels", "--kernels", "false")
    assert both.returncode == 2 and "leave out --kernels false" in both.stderr
    bad = _profile("--set", "depht=1")
    assert bad.returncode == 2 and "not a model field" in bad.stderr


@pytest.mark.slow
def test_profile_of_the_compiled_step_names_vitscope_ops():
    from vitscope.kernels import native

    if native.library() is None:
        pytest.skip(f"vitscope's kernels do not run here ({native.unavailable()}), so the graph has none of its ops")
    r = _profile("--set", "depth=1", "--batch", "4", "--steps", "1", "--rows", "40", "--dtype", "float32",
                 "--compile", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "training step, compiled, 1 steps profiled" in r.stdout
    assert "vitscope::" in r.stdout and "CompiledFxGraph" in r.stdout
    both = _profile("--compile", "--time-kernels")
    assert both.returncode == 2 and "leave out --compile" in both.stderr


@pytest.mark.slow
def test_profile_loop_only_runs_steps():
    r = _profile("--set", "depth=1", "--batch", "4", "--loop", "0.2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"^\d+ steps, [\d.]+ ms a step \(\d+ images/s\)$", r.stdout.strip())
    assert "Self CPU" not in r.stdout


@pytest.mark.slow
def test_profile_kernels_splits_the_step_inside_and_outside_the_kernels():
    from vitscope.kernels import native

    if native.library() is None:
        pytest.skip(f"vitscope's kernels do not run here ({native.unavailable()})")
    dtype = "bfloat16" if native.has("avx512_bf16") else "float32"  # AVX2 alone: the float32 attention kernel
    r = _profile("--set", "depth=1", "--batch", "4", "--steps", "2", "--time-kernels", "--dtype", dtype)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    parts = {row.split(" | ")[0][2:]: [float(v) for v in row.strip(" |").split(" | ")[1:]] for row in rows[1:5]}
    assert list(parts) == ["forward", "backward", "optimizer", "whole step"]
    for wall, inside, outside in parts.values():
        assert wall > 0 and inside >= 0 and abs(wall - inside - outside) < 0.11
    assert parts["whole step"][1] > 0  # some kernel ran
    assert any(row.startswith("| vs_") for row in rows)
