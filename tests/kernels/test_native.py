"""vitscope's C kernels as a library: building, caching, and which instruction sets may run where."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from vitscope.attention import attend
from vitscope.kernels import native, registry, short_attention

needs_library = pytest.mark.skipif(native.library() is None, reason=f"kernels unavailable: {native.unavailable()}")


def test_switched_off_by_environment():
    code = "from vitscope.kernels import native; print(native.library() is None, native.unavailable())"
    env = {**os.environ, "VITSCOPE_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True switched off by VITSCOPE_NATIVE=0"


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
def test_build_caches_by_source_and_reports_compiler_errors(tmp_path):
    src = tmp_path / "tiny.c"
    src.write_text("int vs_answer(void) { return 42; }\n")
    first = native.build([src], "tiny", out_dir=tmp_path / "cache")
    assert native.build([src], "tiny", out_dir=tmp_path / "cache") == first  # built once
    import ctypes
    assert ctypes.CDLL(str(first)).vs_answer() == 42
    src.write_text("int vs_answer(void) { return 43; }\n")
    assert native.build([src], "tiny", out_dir=tmp_path / "cache") != first  # an edited source builds afresh
    src.write_text("int vs_answer(void) { return }\n")
    with pytest.raises(RuntimeError, match="could not build tiny.c"):
        native.build([src], "tiny", out_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no half-written files


def test_loop_alignment_only_for_gcc():
    """GCC (named gcc, or cc with the Free Software Foundation's notice) gets every flag; clang, which took
    -falign-loops only from version 13, goes without it and keeps the rest."""
    gcc = native._flags(["gcc (GCC) 13.2.0", "Copyright (C) 2023 Free Software Foundation, Inc."])
    debian_cc = native._flags(["cc (Debian 12.2.0-14) 12.2.0", "Copyright (C) 2022 Free Software Foundation, Inc."])
    clang = native._flags(["Debian clang version 12.0.1", "Target: x86_64-pc-linux-gnu"])
    assert gcc == debian_cc == native.FLAGS
    assert "-falign-loops=32" in gcc and "-falign-loops=32" not in clang
    assert clang == [f for f in native.FLAGS if f != "-falign-loops=32"]


def test_build_without_a_compiler(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        native.build([tmp_path / "x.c"], "x")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("VITSCOPE_CACHE", str(tmp_path / "c"))
    assert native.cache_dir() == tmp_path / "c" / "native"
    monkeypatch.delenv("VITSCOPE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert native.cache_dir() == tmp_path / "x" / "vitscope" / "native"


@needs_library
def test_runnable_refuses_forward_ad_and_torch_func_tensors():
    import torch.autograd.forward_ad as fwAD

    x = torch.randn(2, 3)
    assert native.runnable(x, None, isa="avx2")  # the base set: wherever the library loads
    with fwAD.dual_level():
        assert not native.runnable(fwAD.make_dual(x, torch.ones_like(x)), isa="avx2")
    seen = []
    torch.func.vmap(lambda t: seen.append(native.runnable(t, isa="avx2")) or t)(x)
    assert seen == [False]


@pytest.mark.parametrize("dtype,isa", [(torch.float32, "avx512"), (torch.bfloat16, "amx")])
def test_unavailable_kernel_raises_a_clear_error(monkeypatch, dtype, isa):
    monkeypatch.setattr(registry, "_decided", None)  # decided again with the CPU below; the test's end restores it
    monkeypatch.setattr(native, "has", lambda name: False)
    monkeypatch.setattr(native, "unavailable", lambda name=None: f"this CPU lacks the {name} instructions")
    # 32 queries: past EXPLICIT_HALF_MAX_QUERIES, where attend() calls PyTorch's fused kernel in bfloat16 too
    q, k, v = torch.randn(3, 1, 1, 32, 32).to(dtype).unbind(0)
    assert not short_attention.usable(q, k, v)
    with pytest.raises(RuntimeError, match=f"lacks the {isa} instructions"):
        short_attention.attend(q, k, v)
    with torch.inference_mode():  # and attend() keeps PyTorch's kernel
        torch.testing.assert_close(attend(q, k, v), F.scaled_dot_product_attention(q, k, v))


def test_each_instruction_set_needs_the_one_before_it():
    names = list(native.ISAS)
    for smaller, larger in zip(names, names[1:]):
        assert set(native.ISAS[smaller][1]) < set(native.ISAS[larger][1])
        assert set(native.ISAS[smaller][0]) < set(native.ISAS[larger][0])
    assert set(native.SOURCES.values()) <= set(names)
    assert set(native.SOURCES) == {p.name for p in native._HERE.glob("*.c")}  # every source has its set


def test_an_instruction_set_runs_only_where_the_cpu_lists_its_features(monkeypatch):
    monkeypatch.delenv("VITSCOPE_ISA", raising=False)  # the CPU's own features, uncapped (test-every-isa caps)
    features = set(native.ISAS["avx512_bf16"][1])
    monkeypatch.setattr(native, "cpu_features", lambda: features)
    assert native._lacking("avx512") is None and native._lacking("avx512_bf16") is None
    assert native._lacking("amx") == "this CPU lacks amx_tile, amx_bf16"
    monkeypatch.setattr(native, "cpu_features", lambda: features - {"avx512bw"})
    assert native._lacking("avx512") == "this CPU lacks avx512bw"


@needs_library
def test_what_this_machine_runs_is_what_its_cpu_has():
    have = native.cpu_features()  # as VITSCOPE_ISA caps them
    names, cap = list(native.ISAS), native.isa_cap()
    for isa, (_, features) in native.ISAS.items():
        if not set(features) <= have:
            # refused: above the cap, for the cap; else for the features this CPU lacks
            capped = cap is not None and names.index(isa) > names.index(cap)
            assert not native.has(isa) and ("capped" if capped else "lacks") in native.unavailable(isa)
        elif isa != "amx":  # AMX may also be refused by the kernel (arch_prctl)
            assert native.has(isa) and native.unavailable(isa) is None


def test_every_kernel_source_and_header_ships_in_the_package():
    """A wheel carries only what pyproject's package-data names: a missing header fails every build."""
    import fnmatch
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["vitscope"]
    folder = root / "src" / "vitscope" / "kernels" / "native"
    needed = [p.name for p in folder.iterdir() if p.suffix in {".c", ".h"}]
    assert "simd.h" in needed
    for name in needed:
        assert any(fnmatch.fnmatch(f"kernels/native/{name}", g) for g in globs), f"{name} is not in package-data"


@pytest.mark.parametrize("dtype,nk", [(torch.float32, 50), (torch.bfloat16, 50), (torch.bfloat16, 600)])
def test_thread_count_does_not_change_the_result(dtype, nk):
    """Each head runs on one thread whatever the count, so the numbers are the same bit for bit."""
    if short_attention.build_for(dtype) is None:
        pytest.skip(f"kernel unavailable: {registry.why_none('attention', dtype)}")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 3, n, 32, generator=gen).to(dtype) for n in (50, nk, nk))
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            many = short_attention.attend(q, k, v)
            torch.set_num_threads(1)
            one = short_attention.attend(q, k, v)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(many, one)


@pytest.mark.parametrize("bf16", [False, True])
def test_torch_compile_traces_a_vit_in_one_graph(bf16):
    """Asking whether a kernel may run must not break a compiled graph (the loader's lock once did, at
    every attention call): under torch.compile the kernels answer no before touching the library."""
    import torch._dynamo as dynamo

    from vitscope.models import create_model

    model = create_model("vit_tiny_patch4_28", mlp_ratio=4.0, depth=2, kernels=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        explained = dynamo.explain(model)(torch.randn(4, 1, 28, 28))
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]


def test_has_carries_the_marker_assume_constant_result_sets():
    """native.has is marked as torch.compiler.assume_constant_result marks a function, without importing
    torch._dynamo with vitscope: whatever the decorator sets on a function, `has` has too."""

    def probe() -> bool:
        return True

    before = set(vars(probe))
    marked = torch.compiler.assume_constant_result(probe)
    added = {k: v for k, v in vars(marked).items() if k not in before}
    assert added, "assume_constant_result no longer marks the function: mark native.has with the decorator"
    assert all(getattr(native.has, k, None) == v for k, v in added.items()), added


def test_importing_vitscope_leaves_dynamo_unloaded():
    """torch._dynamo costs 2-3 s to import: every CLI command and script would pay it."""
    code = "import sys, vitscope, vitscope.cli, vitscope.training.loop; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(short_attention.build_for(torch.float32) is None,
                    reason=f"kernels unavailable: {registry.why_none('attention', torch.float32)}")
def test_a_model_compiled_before_any_eager_call_gets_the_kernels():
    """In a fresh process, torch.compile traces the model before anything has loaded the library: the
    kernels' availability is a constant the trace asks for (loading it), so the custom ops are in the
    graph, with no graph break. (It used to answer no until an eager call had loaded the library.)"""
    code = """
import torch, torch._dynamo as dynamo
from vitscope.models import create_model
ops = []
def seen(gm, example_inputs):
    ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    return gm
model = create_model("vit_tiny_patch4_28", mlp_ratio=4.0, depth=2, kernels=True)
x = torch.randn(4, 1, 28, 28)
print(dynamo.explain(model)(x).graph_break_count)
dynamo.reset()
torch.compile(model, backend=seen)(x)
print(ops.count("vitscope.qkv_attention.default"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "2"]


@pytest.mark.skipif(short_attention.build_for(torch.float32) is None,
                    reason=f"kernels unavailable: {registry.why_none('attention', torch.float32)}")
@pytest.mark.parametrize("bf16", [False, True])
def test_torch_compile_keeps_the_kernels_and_their_gradients(bf16):
    """Under torch.compile the qkv attention (and in bfloat16 the training MLP; in float32 on AVX2 CPUs the
    MLP and the linear layers) run as vitscope's custom ops, inside the graph, and a compiled training step's
    gradients are the eager step's (AOTAutograd with eager kernels: the fake shapes, the saved tensors and the
    backward ops are all traced)."""
    import torch._dynamo as dynamo
    import torch.nn.functional as F

    from vitscope.kernels import fused_linear, short_attention
    from vitscope.models import create_model

    if bf16 and short_attention.build_for(torch.bfloat16) is None:
        pytest.skip(registry.why_none("attention", torch.bfloat16))
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", mlp_ratio=4.0, depth=2, kernels=True)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    ops = []

    def seen(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def grads(net):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            F.cross_entropy(net(x), y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        torch.compile(model, backend=seen)(x)
    assert ops.count("vitscope.qkv_attention.default") == 2  # one per block
    assert ops.count("vitscope.mlp_bf16.default") == (2 if bf16 and fused_linear.available() else 0)
    # in float32 on the CPUs that run vitscope's float32 products, the MLPs and the other linear layers too
    # (qkv and proj per block, and the head)
    f32 = not bf16 and fused_linear.float32_kernels()
    assert ops.count("vitscope.mlp_f32.default") == (2 if f32 else 0)
    assert ops.count("vitscope.linear_f32.default") == (5 if f32 else 0)
    dynamo.reset()
    eager, compiled = grads(model), grads(torch.compile(model, backend="aot_eager"))
    dynamo.reset()
    from helpers import assert_grads_close

    assert_grads_close(compiled, eager, 1e-2 if bf16 else 1e-5)
