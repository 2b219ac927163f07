"""The registry decides which kernels run: change an entry and the dispatch follows, and what it reports
(`why_not`) is what the kernel modules do."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from vitscope import kernels
from vitscope.kernels import fused_gelu, fused_linear, linear_bf16, native, registry, short_attention
from vitscope.models import create_model

BF = torch.bfloat16


def _replace(monkeypatch, name: str, dtype: str, **changes) -> None:
    """The registry with the entries for (name, dtype) changed (or, with no changes, removed)."""
    table = []
    for k in registry.KERNELS:
        if k.name == name and dtype in k.dtypes:
            if changes:
                table.append(dataclasses.replace(k, **changes))
        else:
            table.append(k)
    monkeypatch.setattr(registry, "KERNELS", tuple(table))


def test_what_the_registry_reports_is_what_runs():
    for kernel in registry.KERNELS:
        for dtype in kernel.dtypes:
            assert (kernels.why_not(kernel) is None) == (registry.runs(kernel.name, dtype) == kernel), kernel
    # one kernel per (name, dtype) at most, so the fast modules ask one question each
    x = torch.ones(4, 16)
    assert fused_gelu.fusable(x) == (registry.runs("gelu", torch.float32) is not None)
    assert fused_gelu.fusable(x.to(BF)) == (registry.runs("gelu", BF) is not None)
    q = torch.randn(1, 2, 8, 32)
    for dtype in (torch.float32, BF):
        assert short_attention.usable(q.to(dtype), q.to(dtype), q.to(dtype)) == \
            (registry.runs("attention", dtype) is not None)


def test_an_entry_taken_out_runs_nowhere(monkeypatch):
    x, q = torch.ones(4, 16), torch.randn(1, 2, 8, 32)
    for dtype in ("float32", "bfloat16"):
        _replace(monkeypatch, "gelu", dtype)
        _replace(monkeypatch, "attention", dtype)
    for dtype in (torch.float32, BF):
        assert not fused_gelu.fusable(x.to(dtype))
        assert not short_attention.usable(q.to(dtype), q.to(dtype), q.to(dtype))
        assert "has no attention kernel" in registry.why_none("attention", dtype)
    monkeypatch.undo()  # the table as shipped: decided again from it
    assert fused_gelu.fusable(x.to(BF)) == (registry.runs("gelu", BF) is not None)


@pytest.mark.skipif(registry.runs("linear product", BF) is None,
                    reason=f"the bfloat16 product kernel does not run here: {registry.why_none('linear product', BF)}")
def test_a_changed_entry_changes_what_a_model_runs(monkeypatch):
    """The product kernel told to stand aside where the CPU has AVX-512 (as the float32 GELU does): apply()
    decides again, and the same model's linear layers run oneDNN's product, with the same numbers."""
    calls = []
    forward = linear_bf16.forward
    monkeypatch.setattr(linear_bf16, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", mlp_ratio=4.0, depth=2).eval()
    x = torch.randn(8, 1, 28, 28)

    def logits():
        with torch.inference_mode(), torch.autocast("cpu", dtype=BF):
            return model(x).float()

    with kernels.disabled():
        plain = logits()
    kernels.apply(model)
    ours = logits()
    assert calls, "the product kernel should run as shipped"
    torch.testing.assert_close(ours, plain, atol=3e-2, rtol=5e-2)

    _replace(monkeypatch, "linear product", "bfloat16", yields_to="avx512")
    kernels.apply(model)
    assert "AVX-512" in registry.why_none("linear product", BF)
    calls.clear()
    assert not linear_bf16.runnable(torch.ones(4, 64, dtype=BF), torch.ones(32, 64, dtype=BF))
    stood_aside = logits()
    assert not calls
    torch.testing.assert_close(stood_aside, plain, atol=3e-2, rtol=5e-2)
    reference = F.linear(x.flatten(1)[:, :16].to(BF), torch.ones(32, 16, dtype=BF))  # oneDNN's own product
    assert torch.equal(fused_linear.linear(x.flatten(1)[:, :16], torch.ones(32, 16)), reference)


def test_decisions_read_the_cpu_once(monkeypatch):
    """After apply() decides, asking costs no read of the CPU's features (they were read on every call)."""
    registry.decide()
    monkeypatch.setattr(native, "cpu_features", lambda: pytest.fail("read the CPU again"))
    monkeypatch.setattr(native, "cpu_has_amx", lambda: pytest.fail("read the CPU again"))
    x = torch.ones(64, 64, dtype=BF)
    linear_bf16.runnable(x, x)
    fused_linear._native_weight_grad(x, x)
    fused_gelu.fusable(x)
