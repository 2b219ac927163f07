"""Helpers the tests share (imported by name: `from helpers import ...`); the fixtures are in conftest.py."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

# The browser the page tests drive: Debian's chromium through Playwright's Python package.
CHROMIUM = os.environ.get("VITSCOPE_CHROMIUM", "/usr/bin/chromium")


def playwright_or_skip():
    """playwright.sync_api, or a skip that says what is missing (the package, or the browser)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                                   "(pip install playwright; the browser is Debian's chromium)")
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set VITSCOPE_CHROMIUM)")
    return sync_api


def random_layer_norm(c: int, seed: int = 0) -> torch.nn.LayerNorm:
    """A LayerNorm over c features (eps 1e-6, ViT's) with random weight and bias, so that both matter."""
    torch.manual_seed(seed)
    norm = torch.nn.LayerNorm(c, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    return norm


def assert_grads_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], tol: float) -> None:
    """Every gradient within `tol` of the other's largest magnitude."""
    assert ours.keys() == theirs.keys()
    for name in ours:
        scale = theirs[name].abs().max().item() + 1e-12
        assert (ours[name] - theirs[name]).abs().max().item() / scale < tol, name


def long_vit_grads_against_pytorch(monkeypatch, dtype: torch.dtype, tol: float) -> None:
    """577 tokens (96×96, patch 4): a two-block ViT's gradients for one training step (`dtype`: float32, or
    bfloat16 autocast) with vitscope's attention kernels, its blockwise forward and backward, held within
    `tol` of the same step with them switched off (PyTorch's kernels)."""
    from vitscope.kernels import short_attention
    from vitscope.models import create_model

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", mlp_ratio=4.0, depth=2, img_size=96, kernels=True)
    x, y = torch.randn(2, 1, 96, 96), torch.randint(0, 10, (2,))
    calls = []
    real = short_attention.attend_qkv
    monkeypatch.setattr(short_attention, "attend_qkv", lambda *a, **k: calls.append(1) or real(*a, **k))

    def grads():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            F.cross_entropy(model(x), y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ours = grads()
    assert len(calls) == 2  # both blocks ran the kernels
    with monkeypatch.context() as m:
        m.setattr(short_attention, "usable_qkv", lambda *a: False)
        m.setattr(short_attention, "usable", lambda *a: False)
        theirs = grads()
    assert_grads_close(ours, theirs, tol)


def qkv_attention_against_float64(dtype: torch.dtype, queries: int | None, g_stride: int = 1, n: int = 50):
    """vitscope's attend_qkv on a random (3, n, 3·4·32) qkv of `dtype`, forward and backward, next to the
    same attention in float64 through the usual split (its first `queries` queries, or all). Returns
    (out, qkv grad, float64 out, float64 qkv grad); checks that attend_qkv accepted the input and that
    queries past the first n got no gradient. `g_stride` > 1 hands it a non-contiguous output gradient."""
    from vitscope.kernels import short_attention

    b, h, d = 3, 4, 32
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(b, n, 3 * h * d, generator=gen).to(dtype)
    nq = n if queries is None else queries
    g = torch.randn(b, nq, h * d * g_stride, generator=gen)[..., ::g_stride].to(dtype)

    def split_path(t):
        q, k, v = t.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        q = q if queries is None else q[:, :, :queries]
        return F.scaled_dot_product_attention(q, k, v, scale=0.2).transpose(1, 2).reshape(b, nq, h * d)

    x = qkv.clone().requires_grad_()
    assert short_attention.usable_qkv(x, h, queries)
    out = short_attention.attend_qkv(x, h, 0.2, queries)
    out.backward(g)
    ref_x = qkv.double().requires_grad_()
    ref = split_path(ref_x)
    ref.backward(g.double())
    assert out.shape == ref.shape == (b, nq, h * d)
    if queries is not None:  # queries past the first n get no gradient
        assert x.grad.view(b, n, 3, h, d)[:, queries:, 0].abs().max() == 0
    return out, x.grad, ref, ref_x.grad


def torch_mha_like(ours, dim: int, num_heads: int, kdim: int | None = None):
    """torch.nn.MultiheadAttention holding vitscope MultiHeadAttention `ours`'s weights (self- or cross-)."""
    ref = torch.nn.MultiheadAttention(dim, num_heads, batch_first=True, kdim=kdim, vdim=kdim)
    with torch.no_grad():
        if not ours.cross:
            ref.in_proj_weight.copy_(ours.qkv.weight)  # rows: q, k, v, as in our fused qkv
            ref.in_proj_bias.copy_(ours.qkv.bias)
        elif kdim is None:
            ref.in_proj_weight.copy_(torch.cat([ours.q.weight, ours.kv.weight]))
            ref.in_proj_bias.copy_(torch.cat([ours.q.bias, ours.kv.bias]))
        else:
            ref.q_proj_weight.copy_(ours.q.weight)
            ref.k_proj_weight.copy_(ours.kv.weight[:dim])
            ref.v_proj_weight.copy_(ours.kv.weight[dim:])
            ref.in_proj_bias.copy_(torch.cat([ours.q.bias, ours.kv.bias]))
        ref.out_proj.weight.copy_(ours.proj.weight)
        ref.out_proj.bias.copy_(ours.proj.bias)
    return ref.eval()


def raises_one_line(call, *fragments, error: type[Exception] = Exception) -> str:
    """Run `call`, expect `error` with a one-line message holding every fragment; return the message."""
    import pytest

    with pytest.raises(error) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


def load_benchmark(name: str):
    """benchmarks/`name`.py imported as the scripts import each other (their folder on sys.path)."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(folder))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    return module
