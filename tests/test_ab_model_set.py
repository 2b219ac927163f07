"""benchmarks/ab_*.py, ablate_step.py, profile_step.py and softmax_bound.py on tiny settings: each runs
and prints its table. Smoke tests of the scripts, not timings. Those that take more than a few seconds
(torch.compile, several worker processes, profiling) are marked slow: CI runs them after the default suite."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vitscope.kernels import short_attention

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "ab_model_set.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def _table(script: str, *args: str) -> tuple[str, list[str]]:
    """Run benchmarks/`script` with `args`; its stdout and the markdown table rows in it."""
    r = subprocess.run([sys.executable, str(SCRIPT.parent / script), *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, [line for line in r.stdout.splitlines() if line.startswith("| ")]


@pytest.mark.slow
def test_overridden_model_against_preset():
    r = _run("--set", "depth=1", "--set", "stem=[[16,2],[32,2]]", "--batch", "4", "--rounds", "2", "--steps", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == "| model | images/s per round | median |"
    assert rows[1].startswith("| depth=1 stem=[[16,2],[32,2]] | ") and rows[2].startswith("| preset | ")
    assert len(rows[1].split(" | ")[1].split()) == 2  # one figure per round
    assert "÷ preset, per round:" in r.stdout


def test_no_override_is_a_clear_error():
    r = _run("--batch", "4")
    assert r.returncode != 0 and "give at least one --set FIELD=VALUE" in r.stderr


@pytest.mark.slow
def test_muon_against_adamw():
    out, rows = _table("ab_optimizer.py", "--batch", "4", "--rounds", "2", "--steps", "1")
    assert rows[0] == "| optimizer | images/s per round | median |"
    assert rows[1].startswith("| muon | ") and rows[2].startswith("| adamw | ")
    assert "muon ÷ adamw, per round:" in out


@pytest.mark.slow
def test_explicit_attention_against_fused_and_a_bad_field():
    out, rows = _table("ab_attention_kernel.py", "--set", "depth=1", "--batch", "4", "--rounds", "2", "--steps", "1")
    assert rows[1].startswith("| explicit | ") and rows[2].startswith("| fused | ")
    assert "explicit ÷ fused, per round:" in out
    script = SCRIPT.parent / "ab_attention_kernel.py"
    bad = subprocess.run([sys.executable, str(script), "--set", "depht=1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a model field" in bad.stderr


@pytest.mark.slow
def test_profile_lists_the_operators():
    script = SCRIPT.parent / "profile_step.py"
    r = subprocess.run([sys.executable, str(script), "--set", "depth=1", "--batch", "4", "--steps", "1", "--rows", "5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Self CPU time total" in r.stdout and "aten::" in r.stdout


@pytest.mark.slow
def test_profile_of_the_compiled_step_names_vitscope_ops():
    script = SCRIPT.parent / "profile_step.py"
    r = subprocess.run([sys.executable, str(script), "--set", "depth=1", "--batch", "4", "--steps", "1", "--rows", "40",
                        "--dtype", "float32", "--compile"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "training step, compiled, 1 steps profiled" in r.stdout
    assert "vitscope::" in r.stdout and "CompiledFxGraph" in r.stdout
    both = subprocess.run([sys.executable, str(script), "--compile", "--kernels"], capture_output=True, text=True,
                          timeout=120)
    assert both.returncode == 2 and "leave out --compile" in both.stderr


@pytest.mark.slow
def test_kept_freed_memory_against_glibc_defaults():
    out, rows = _table("ab_allocator.py", "--set", "depth=1", "--batch", "4", "--rounds", "1", "--steps", "1")
    assert rows[1].startswith("| kept | ") and rows[2].startswith("| default | ")
    assert "kept ÷ default, per round:" in out
    assert rows[3] == "| freed memory | page faults per step | system time per step | peak resident memory |"


def _needs_onednn_bf16_linear() -> None:
    from vitscope.kernels import fused_linear

    if not fused_linear.available():
        pytest.skip("this CPU has no oneDNN bfloat16 linear (bfloat16 is emulated): the script has nothing to compare")


def test_fused_linear_against_nn_linear_in_inference():
    _needs_onednn_bf16_linear()
    out, rows = _table("ab_fused_linear.py", "--model", "vit_tiny_patch4_28", "--batch", "4", "--rounds", "2",
                       "--steps", "1")
    assert rows[0] == "| linear layers in bf16 inference | images/s per round | median |"
    assert rows[1].startswith("| fused | ") and rows[2].startswith("| nn.Linear | ")
    assert "bfloat16 autocast inference forward" in out and "fused ÷ nn.Linear, per round:" in out


def test_with_attribute_switches_for_the_step_and_puts_it_back():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import _ab
    finally:
        sys.path.remove(str(SCRIPT.parent))

    class Owner:
        limit = 512

    seen = []

    def step():
        seen.append(Owner.limit)
        raise KeyboardInterrupt  # even a step that fails puts the value back

    run = _ab.with_attribute(step, Owner, "limit", 0)
    try:
        run()
    except KeyboardInterrupt:
        pass
    assert seen == [0] and Owner.limit == 512


def test_fused_linear_against_nn_linear_in_training():
    _needs_onednn_bf16_linear()
    out, rows = _table("ab_fused_linear.py", "--training", "--model", "vit_tiny_patch4_28", "--batch", "4",
                       "--rounds", "2", "--steps", "1")
    assert rows[0] == "| linear layers in bf16 training | images/s per round | median |"
    assert "bfloat16 autocast training step" in out and "fused ÷ nn.Linear, per round:" in out


@pytest.mark.slow
def test_ablation_times_the_step_without_each_part():
    out, rows = _table("ablate_step.py", "--model", "vit_tiny_patch4_28", "--set", "depth=2", "--batch", "4",
                       "--rounds", "2", "--steps", "1")
    assert rows[0].startswith("| variant | images/s per round | ms a step (median) |")
    names = [row.split(" | ")[0].lstrip("| ") for row in rows[1:]]
    assert names == ["whole step", "without gelu", "without layernorm", "without attention_core", "without mlp"]
    assert all(len(row.split(" | ")[1].split()) == 2 for row in rows[1:])  # one figure per round


@pytest.mark.slow
def test_compile_ab_times_eager_and_both_compiled_graphs():
    out, rows = _table("ab_compile.py", "--model", "vit_tiny_patch4_28", "--set", "depth=1", "--batch", "4",
                       "--rounds", "1", "--steps", "1")
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| eager", "| compiled, vitscope's ops", "| compiled, none"]
    assert "eager ÷ compiled, none, per round:" in out and "compiled, vitscope's ops ÷ compiled, none" in out


def test_conv_weight_grad_ab_times_each_stem_conv_alone_and_in_the_step():
    from vitscope.kernels import native

    if not native.has("avx512_bf16"):
        pytest.skip(f"vitscope's kernels unavailable: {native.why_not('avx512_bf16')}")
    out, rows = _table("ab_conv_weight_grad.py", "--batch", "2", "--rounds", "1", "--steps", "1", "--reps", "1")
    alone = [r for r in rows if r.split(" | ")[1][0].isdigit()][:4]
    assert [r.split(" | ")[0] for r in alone] == ["| 32 → 64, 3×3 s2", "| 64 → 64, 3×3 s1", "| 64 → 128, 3×3 s2",
                                                  "| 128 → 128, 3×3 s1"]
    assert [r.split(" | ")[0] for r in rows if r.startswith(("| kernel |", "| oneDNN |"))] == ["| kernel", "| oneDNN"]
    assert "128 → 128, 1×1 s1" in out and "step time oneDNN ÷ kernel, per round:" in out


def test_kernels_ab_switches_one_part_off_with_either_optimizer():
    from vitscope.kernels import native

    if not native.has("avx512_bf16"):
        pytest.skip(f"vitscope's kernels unavailable: {native.why_not('avx512_bf16')}")
    out, rows = _table("ab_kernels.py", "--part", "conv-wgrad", "--model", "vit_fmnist_quick", "--batch", "2",
                       "--rounds", "1", "--steps", "1", "--optimizer", "muon")
    assert rows[0] == "| conv-wgrad in bf16 training | images/s per round | median |"
    assert "training step (muon)" in out and "B without: conv-wgrad" in out and "kernels ÷ without" in out


@pytest.mark.slow
def test_float32_conv_weight_grad_ab_and_two_parts_switched_off_together():
    from vitscope.kernels import fused_linear

    if not fused_linear.float32_kernels():
        pytest.skip("the float32 conv kernel runs on AMD CPUs with AVX2 and without AVX-512")
    out, rows = _table("ab_conv_weight_grad.py", "--dtype", "float32", "--batch", "2", "--rounds", "1", "--steps", "1",
                       "--reps", "1")
    alone = [r for r in rows if r.split(" | ")[1][0].isdigit()][:4]
    assert [r.split(" | ")[0] for r in alone] == ["| 32 → 64, 3×3 s2", "| 64 → 64, 3×3 s1", "| 64 → 128, 3×3 s2",
                                                  "| 128 → 128, 3×3 s1"]
    assert all(float(r.split(" | ")[-1].split(" / ")[0]) < 1e-5 for r in alone)  # near float64
    assert "float32 training step" in out and "step time oneDNN ÷ kernel, per round:" in out
    out, rows = _table("ab_kernels.py", "--dtype", "float32", "--part", "conv-wgrad", "bn-gelu", "--model",
                       "vit_fmnist_quick", "--batch", "2", "--rounds", "1", "--steps", "1", "--optimizer", "muon")
    assert rows[0] == "| conv-wgrad + bn-gelu in fp32 training | images/s per round | median |"
    assert "B without: conv-wgrad, bn-gelu" in out


def test_float32_ops_ab_times_each_product_and_the_gelu():
    out, rows = _table("ab_float32_ops.py", "--rows", "64", "--shapes", "32x16", "--rounds", "1", "--reps", "1")
    assert [r.split(" | ")[0] for r in rows[1:4]] == ["| forward x Wᵀ + b", "| input grad g W", "| weight grad gᵀ x"]
    assert all(float(r.split(" | ")[-1].rstrip(" |")) < 1e-5 for r in rows[1:4])  # both near float64
    from vitscope.kernels import fused_gelu, linear_f32

    rest = rows[4:]
    if linear_f32.usable():  # vitscope's own float32 products against the path without them
        assert rest[0].startswith("| product | out × in | kernel ms | without ms |")
        assert [r.split(" | ")[0] for r in rest[1:4]] == ["| forward x Wᵀ + b", "| input grad g W",
                                                            "| weight + bias grad"]
        assert all(float(r.split(" | ")[-2]) < 1e-5 for r in rest[1:4])
        rest = rest[4:]
    if fused_gelu.fusable(torch.ones(2)):
        assert [r.split(" | ")[0] for r in rest[1:]] == ["| forward", "| backward"]


def test_linear_ab_times_each_product_alone_and_in_the_step():
    from vitscope.kernels import native

    if not native.has("avx512_bf16"):
        pytest.skip(f"vitscope's kernels unavailable: {native.why_not('avx512_bf16')}")
    out, rows = _table("ab_linear.py", "--rows", "40", "--shapes", "128x64", "--rounds", "1", "--reps", "1")
    assert [r.split(" | ")[1] for r in rows[1:]] == ["forward", "forward + GELU", "input grad", "input grad × d"]
    assert "the products taken:" in out
    out, rows = _table("ab_linear.py", "--in-step", "--batch", "2", "--set", "depth=1", "--rounds", "1",
                       "--steps", "1")
    kinds = {r.split(" | ")[0] for r in rows}
    assert {"| forward (128, 384)", "| forward + GELU (128, 256)", "| input grad × d (256, 128)"} <= kinds
    assert "kernel ÷ oneDNN, per round:" in out


def test_dpbf16_peak_compiles_and_prints_both_rates(tmp_path):
    from vitscope.kernels import native

    if not native.has("avx512_bf16") or native.compiler() is None:
        pytest.skip(f"needs AVX512-BF16 and a C compiler: {native.why_not('avx512_bf16')}")
    exe = tmp_path / "dpbf16_peak"
    subprocess.run([native.compiler(), "-O3", "-fopenmp", "-mavx512f", "-mavx512bf16",
                    str(SCRIPT.parent / "dpbf16_peak.c"), "-o", str(exe)], check=True, timeout=60)
    out = subprocess.run([str(exe), "2"], capture_output=True, text=True, timeout=60, check=True).stdout
    one, two = (float(v) for v in re.findall(r"(\d+) GFLOP/s", out))
    assert out.startswith("vdpbf16ps peak: 1 thread") and one > 0 and two > 0


@pytest.mark.skipif(short_attention.kernel_for(torch.float32) is None, reason="no float32 attention kernel here")
def test_long_attention_ab_prints_both_passes_per_length():
    lengths = ["65", "300"] if short_attention.kernel_for(torch.float32).any_length else ["65"]
    out, rows = _table("ab_long_attention.py", "--n", *lengths, "--rounds", "1", "--heads", "2", "--head-dim", "32")
    assert rows[0].startswith("| N | B | pass | vitscope ms |")
    assert [r.split(" | ")[:3] for r in rows[1:]] == [[f"| {n}", b, p] for n, b in zip(lengths, ("63", "14"))
                                                       for p in ("fwd", "fwd+bwd")]
    assert all(float(r.split(" | ")[7].strip("*")) > 0 for r in rows[1:])


@pytest.mark.slow
def test_softmax_bound_prints_a_row_per_dtype():
    out, rows = _table("softmax_bound.py", "--sizes", "256")
    assert rows[0].startswith("| dtype | exp rate, G elements/s |")
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| float32", "| bfloat16"]
    assert all(float(row.split(" | ")[1]) > 0 for row in rows[1:])


def test_native_build_ab_refuses_kernels_with_other_signatures(tmp_path):
    """ab_native_build.py calls the other commit's kernels with the working tree's arguments: it finds each
    exported function's parameter types, also for an entry point a header defines under a macro, and names
    those that differ or are missing."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import ab_native_build as ab_native
    finally:
        sys.path.remove(str(SCRIPT.parent))
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for folder, extra in ((ours, "uint16_t *dx_bf16, "), (theirs, "")):
        folder.mkdir()
        (folder / "head.h").write_text("int ENTRY(const float *q,\n          int64_t n)\n{\n    return 0;\n}\n")
        (folder / "a.c").write_text(
            "#define ENTRY vs_entry\n#include \"head.h\"\n"
            f"void vs_norm_bwd(const float *x, float *dx, {extra}int64_t rows)\n{{\n}}\n"
            "void vs_same(float *y,  int n)\n{\n}\n")
    (theirs / "b.c").write_text("static void helper(void)\n{\n}\n")
    found = ab_native.prototypes(ours)
    assert found == {"vs_entry": ("const float *", "int64_t"),
                     "vs_norm_bwd": ("const float *", "float *", "uint16_t *", "int64_t"),
                     "vs_same": ("float *", "int")}
    assert ab_native.differing(found, ab_native.prototypes(theirs)) == ["vs_norm_bwd"]
    (theirs / "a.c").unlink()
    assert ab_native.differing(found, ab_native.prototypes(theirs)) == ["vs_entry", "vs_norm_bwd", "vs_same"]
    real = ab_native.prototypes(SCRIPT.parent.parent / "src" / "vitscope" / "native")
    assert {"vs_attention_bf16_fwd", "vs_attention_bwd", "vs_add_layer_norm_bwd"} <= set(real)


@pytest.mark.slow
def test_profile_loop_only_runs_steps():
    r = subprocess.run([sys.executable, str(SCRIPT.parent / "profile_step.py"), "--set", "depth=1", "--batch", "4",
                        "--loop", "0.2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"^\d+ steps, [\d.]+ ms a step \(\d+ images/s\)$", r.stdout.strip())
    assert "Self CPU" not in r.stdout


def test_native_build_ab_times_the_attention_kernels_alone(capsys):
    """--attention: the forward and backward of one layer's heads, each build in turn (here the working
    tree's library on both sides, so nothing is compiled)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import ab_native_build as ab_native
    finally:
        sys.path.remove(str(SCRIPT.parent))
    import torch

    from vitscope.kernels import short_attention

    if short_attention.kernel_for(torch.bfloat16) is None:
        pytest.skip("no bfloat16 attention kernel runs here")
    lib = ab_native.native.library()
    args = SimpleNamespace(attention=[2, 50, 2, 32], ref="HEAD", rounds=2, steps=1)
    ab_native.attention(args, lib, lib)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| forward", "| backward"]
    assert all(float(row.split(" | ")[1]) > 0 for row in rows[1:])


@pytest.mark.slow
def test_profile_kernels_splits_the_step_inside_and_outside_the_kernels():
    from vitscope.kernels import native

    if native.library() is None:
        pytest.skip("vitscope's kernels do not run here")
    dtype = "bfloat16" if native.has("avx512_bf16") else "float32"  # AVX2 alone: the float32 attention kernel
    out, rows = _table("profile_step.py", "--set", "depth=1", "--batch", "4", "--steps", "2", "--kernels",
                       "--dtype", dtype)
    parts = {row.split(" | ")[0][2:]: [float(v) for v in row.strip(" |").split(" | ")[1:]] for row in rows[1:5]}
    assert list(parts) == ["forward", "backward", "optimizer", "whole step"]
    for wall, inside, outside in parts.values():
        assert wall > 0 and inside >= 0 and abs(wall - inside - outside) < 0.11
    assert parts["whole step"][1] > 0  # some kernel ran
    assert any(row.startswith("| vs_") for row in rows)
