"""benchmarks/bench_caption.py on tiny settings: vitscope's and transformers' captioners are built to one
shape, generate exactly the tokens asked for, train a step, and the script prints its tables. A smoke
test, not a timing: no speed is checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_benchmark

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
pytest.importorskip("transformers")




@pytest.mark.slow  # building transformers' models takes seconds
def test_both_captioners_have_caption_quicks_size_within_five_percent():
    bench = load_benchmark("bench_caption")
    shape = bench.quick_shape()
    counts = {impl: sum(p.numel() for p in bench.build_impl(impl, shape).parameters())
              for impl in ("vitscope-plain", "hf-eager")}
    assert abs(counts["vitscope-plain"] - counts["hf-eager"]) <= 0.05 * counts["hf-eager"]


@pytest.mark.parametrize("impl", ["vitscope", pytest.param("hf-eager", marks=pytest.mark.slow)])
def test_a_worker_generates_and_trains(impl):
    bench = load_benchmark("bench_caption")
    cases = [dict(mode=m, n=3, dtype="float32") for m in ("greedy", "beam 2", "train")]
    out = bench.run_impl(dict(impl=impl, shape=bench.quick_shape(small=True), cases=cases, batch=2, repeats=1,
                              threads=1))
    assert set(out["times"]) == {bench.case_name(c) for c in cases}
    assert all(len(t) == 1 and t[0] >= 0 for t in out["times"].values())


@pytest.mark.slow
def test_the_script_prints_its_tables():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_caption.py"), "--small", "--batch", "2",
                          "--lengths", "2", "--beam", "2", "--rounds", "1", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    assert "| implementation | parameters |" in out and "parameter counts differ by" in out
    assert out.count("| greedy, N = 2, float32 |") == 2  # CPU time and wall time
