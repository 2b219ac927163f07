"""vitscope.kernels.apply: the fast modules give the plain model's numbers (outputs and gradients, float32 and
bfloat16, training and inference), keep its parameters, state_dict and hooks, hand every observable call to
the plain path, and run no vitscope kernel inside `kernels.disabled()`.

Whatever the CPU, these run the kernels it can run; `make test` runs this folder again under each smaller
instruction set the CPU has (VITSCOPE_ISA), so every variant is tested on it."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_grads_close
from vitscope import kernels
from vitscope.decoder import TransformerDecoder
from vitscope.inspect import capture_attention
from vitscope.kernels import fused_linear, fused_mlp, native, short_attention
from vitscope.kernels.modules import FastAttention, FastBlock, FastMlp, FastViT
from vitscope.models import create_model
from vitscope.vit import Block, Mlp, VisionTransformer

MODELS = {
    "plain 28x28 ViT": ("vit_tiny_patch4_28", {"mlp_ratio": 4.0, "depth": 2}),
    "conv-stem preset": ("vit_fmnist_quick", {}),
    "class token, layer scale": ("vit_tiny_patch4_28", {"depth": 2, "init_values": 0.1}),
    "average pooling, no stem": ("vit_fmnist_quick", {"stem": []}),  # the caption encoder's tokens
}
# bfloat16: both sides round every product's inputs, at different places; float32: sums in another order
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 5e-2)}


def _pair(name: str, **extra) -> tuple[VisionTransformer, VisionTransformer]:
    preset, overrides = MODELS[name]
    torch.manual_seed(0)
    plain = create_model(preset, **overrides, **extra)
    return plain, kernels.apply(copy.deepcopy(plain))


def _step(model, x, y, dtype, train: bool):
    model.train(train)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        if not train:
            with torch.inference_mode():
                return model(x).float().clone(), None
        out = model(x)
        loss = F.cross_entropy(out.float(), y)
    loss.backward()
    return out.float().detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_fast_model_gives_the_plain_models_numbers(name, dtype, train):
    plain, fast = _pair(name)
    assert type(fast) is FastViT and all(type(b) is FastBlock for b in fast.blocks)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    exact = copy.deepcopy(plain).double()  # float64: how far each side is from the exact numbers
    ours, our_grads = _step(fast, x, y, dtype, train)
    theirs, their_grads = _step(plain, x, y, dtype, train)
    atol, grad_tol = TOLERANCE[dtype]
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= atol * max(scale, 1.0)
    if not train:
        return
    if dtype == torch.float32:
        assert_grads_close(our_grads, their_grads, grad_tol)
        return
    # bfloat16: each side rounds at other places, so hold the kernels' gradients to float64 as closely as
    # PyTorch's own bfloat16 path holds (small gradients, such as a norm's bias, differ by several percent)
    _, exact_grads = _step(exact, x.double(), y, torch.float64, train)
    for n, g in exact_grads.items():
        s = g.abs().max().item() + 1e-12
        ours_err, theirs_err = ((our_grads[n] - g).abs().max().item() / s, (their_grads[n] - g).abs().max().item() / s)
        assert ours_err <= 2 * theirs_err + grad_tol, (n, ours_err, theirs_err)


def test_apply_keeps_parameters_state_dict_and_hooks_and_revert_undoes_it():
    plain, _ = _pair("conv-stem preset")
    params = dict(plain.named_parameters())
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    seen = []
    plain.blocks[0].register_forward_hook(lambda m, i, out: seen.append(out.shape))
    fast = kernels.apply(plain)
    assert fast is plain and type(fast.blocks[0].mlp) is FastMlp and type(fast.blocks[0].attn) is FastAttention
    assert all(p is params[n] for n, p in fast.named_parameters())  # the same Parameter objects: optimizers hold
    assert fast.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in fast.state_dict().items())
    fast.eval()
    with torch.inference_mode():
        fast(torch.randn(2, 1, 28, 28))
    assert seen == [(2, 49, 128)]  # a hooked block runs as a module, and its hook sees every token
    assert type(copy.deepcopy(fast)) is FastViT  # EMA copies keep the fast classes
    kernels.apply(fast)  # twice: decides again, changes nothing
    kernels.revert(fast)
    assert type(fast) is VisionTransformer and type(fast.blocks[0]) is Block and type(fast.blocks[0].mlp) is Mlp
    assert type(fast.blocks[0].mlp.fc1) is torch.nn.Linear
    assert fast.patch_embed.stem[0].weight.is_contiguous()  # back to the plain layout
    assert type(create_model("vit_tiny_patch4_28", depth=1, kernels=True)) is FastViT
    assert type(create_model("vit_tiny_patch4_28", depth=1)) is VisionTransformer


def test_capture_head_masks_and_returned_weights_take_the_plain_path():
    plain, fast = _pair("plain 28x28 ViT")
    plain.eval(), fast.eval()
    x = torch.randn(2, 1, 28, 28)
    ours, theirs = capture_attention(fast, x), capture_attention(plain, x)
    for a, b in zip(ours.values() if isinstance(ours, dict) else ours, theirs.values() if isinstance(theirs, dict)
                    else theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for m in (plain, fast):
        m.blocks[1].attn.head_mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), plain(x), atol=1e-5, rtol=1e-4)
        tokens = torch.randn(2, 50, fast.config.embed_dim)
        out, w = fast.blocks[0].attn(tokens, return_weights=True)
        ref, ref_w = plain.blocks[0].attn(tokens, return_weights=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w, ref_w)


def test_a_decoder_with_masks_caches_and_cross_attention_keeps_its_numbers():
    torch.manual_seed(0)
    plain = TransformerDecoder(50, 64, 2, 4, 16, context_dim=32).eval()
    fast = kernels.apply(copy.deepcopy(plain))
    tokens, context = torch.randint(0, 50, (3, 9)), torch.randn(3, 7, 32)
    pad = torch.zeros(3, 9, dtype=torch.bool)
    pad[0, 6:] = True
    with torch.inference_mode():
        torch.testing.assert_close(fast(tokens, context, padding_mask=pad), plain(tokens, context, padding_mask=pad),
                                   atol=1e-5, rtol=1e-4)
        caches = fast.new_caches()
        steps = [fast(tokens[:, i:i + 1], context, caches=caches) for i in range(tokens.shape[1])]
        torch.testing.assert_close(torch.cat(steps, 1), plain(tokens, context), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("padded", [False, True], ids=["", "padded context"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_decoders_cross_attention_trains_through_the_kernels_with_the_plain_numbers(dtype, padded, monkeypatch):
    """Teacher forcing (a captioner's training step): the cross-attention over an unpadded context runs vitscope's
    attention kernels from the q and kv projections; the loss and every gradient are the plain decoder's. A padding
    mask keeps PyTorch's path."""
    torch.manual_seed(0)
    plain = TransformerDecoder(50, 64, 2, 4, 16, context_dim=32)
    fast = kernels.apply(copy.deepcopy(plain))
    tokens, context = torch.randint(0, 50, (3, 9)), torch.randn(3, 37, 32)
    pad = torch.zeros(3, 37, dtype=torch.bool)
    pad[0, 20:] = True
    calls = []
    attend = short_attention.attend_q_kv
    monkeypatch.setattr(short_attention, "attend_q_kv", lambda *a, **k: calls.append(1) or attend(*a, **k))

    def step(model):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = model(tokens[:, :-1], context, context_padding_mask=pad if padded else None)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ours, our_grads = step(fast)
    theirs, their_grads = step(plain)
    q, k = torch.randn(3, 4, 8, 16, dtype=dtype, requires_grad=True), torch.randn(3, 4, 37, 16, dtype=dtype)
    usable = short_attention.usable(q, k, k)  # this CPU's kernels for the dtype, at head dim 16
    assert len(calls) == (0 if padded or not usable else len(fast.blocks))
    atol, grad_tol = TOLERANCE[dtype]
    assert (ours - theirs).abs().item() <= atol * max(theirs.abs().item(), 1.0)
    assert_grads_close(our_grads, their_grads, grad_tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_no_vitscope_kernel_runs_while_the_kernels_are_off(dtype, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a vitscope kernel ran inside kernels.disabled()")

    plain, fast = _pair("conv-stem preset")
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    ran_before = native.library() is not None or fused_linear.available()
    monkeypatch.setattr(native, "library", refuse)  # every C kernel is called through it
    monkeypatch.setattr(fused_linear, "_KERNEL", refuse)  # oneDNN's fused linear, vitscope's bfloat16 path
    monkeypatch.setattr(fused_mlp, "_KERNEL", refuse)
    with kernels.disabled():
        assert not kernels.enabled()
        ours, our_grads = _step(fast, x, y, dtype, train=True)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            fast.eval()(x)
    theirs, their_grads = _step(plain, x, y, dtype, train=True)
    atol, grad_tol = TOLERANCE[dtype]  # bfloat16: the stem's convs run channels-last, summing in another order
    assert (ours - theirs).abs().max().item() <= atol * max(theirs.abs().max().item(), 1.0)
    assert_grads_close(our_grads, their_grads, grad_tol)
    if ran_before and dtype == torch.float32 and native.cpu_features() >= {"avx2", "fma"}:
        with pytest.raises(AssertionError, match="inside kernels.disabled"):  # outside it, they do run
            _step(fast, x, y, dtype, train=True)


def _in_subprocess(code: str, **env) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, **env}).stdout.strip()


def test_vitscope_isa_caps_the_instruction_set_the_kernels_see():
    code = ("from vitscope.kernels import native; print(sorted(native.cpu_features() & "
            "{'avx512f', 'avx512_bf16', 'amx_bf16'}), native.unavailable('avx512'))")
    capped = _in_subprocess(code, VITSCOPE_ISA="avx2")
    assert capped.startswith("[] ")
    if "avx512f" in set(native._cpuinfo("flags").split()):
        assert capped.endswith("capped at avx2 by VITSCOPE_ISA")
    bad = _in_subprocess("from vitscope.kernels import native; print(native.unavailable())", VITSCOPE_ISA="sse9")
    assert "VITSCOPE_ISA='sse9' names no instruction set" in bad
    assert native.supported_isas() == [isa for isa in native.ISAS if native.supported_isas().count(isa)]
