"""vitscope.training.muon.Muon (same-shaped matrices orthogonalised together) against torch.optim.Muon on copies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vitscope.training.muon import Muon, orthogonalize

# a ViT's repeats: two blocks' qkv (384, 128), proj (128, 128), fc1 (256, 128) and fc2 (128, 256), whose
# oriented shapes make four batches; a conv kernel's (64, 288) and a tall (96, 32) alone
SHAPES = [(384, 128), (128, 128), (256, 128), (128, 256)] * 2 + [(64, 288), (96, 32)]


def _pair(seed: int, **kw) -> tuple[list[nn.Parameter], list[nn.Parameter], Muon, torch.optim.Muon]:
    torch.manual_seed(seed)
    ours = [nn.Parameter(torch.randn(s) * 0.02) for s in SHAPES]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    return ours, ref, Muon(ours, **kw), torch.optim.Muon(ref, **kw)


def _bf16_close(a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    """Equal up to one bfloat16 rounding of an update of size `scale` (torch's iteration is bfloat16)."""
    torch.testing.assert_close(a, b, atol=scale * 2 ** -7, rtol=0)


@pytest.mark.parametrize("kw", [
    dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
    dict(lr=0.05, weight_decay=0.0, momentum=0.9, nesterov=False),
    dict(lr=0.01, weight_decay=0.01, adjust_lr_fn="original", ns_steps=3),
])
def test_four_steps_equal_torch_muon(kw):
    ours, ref, opt, ref_opt = _pair(0, **kw)
    for step in range(4):
        for p, q in zip(ours, ref):
            g = torch.randn_like(p) * (1 + step)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for p, q, start in zip(ours, ref, _pair(0, **kw)[0]):
        assert not torch.equal(p, start)
        _bf16_close(p.detach(), q.detach(), scale=kw["lr"] * max(1.0, 0.2 * max(p.shape)))
        buf, ref_buf = opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"]
        assert torch.equal(buf, ref_buf)  # float32 lerps: the same ops in the same order


def test_batched_iteration_equals_one_matrix_at_a_time():
    torch.manual_seed(1)
    coeffs = (3.4445, -4.7750, 2.0315)
    mats = [torch.randn(128, 256), torch.randn(256, 128), torch.randn(128, 256)]  # one oriented shape
    together = orthogonalize(mats, coeffs, 5, 1e-7)
    for m, t in zip(mats, together):
        alone = orthogonalize([m], coeffs, 5, 1e-7)[0]
        assert t.shape == m.shape and t.dtype == torch.bfloat16
        _bf16_close(t.float(), alone.float(), scale=1.0)
        # semi-orthogonal to Muon's tolerance: the singular values land in about (0.5, 1.5)
        s = torch.linalg.svdvals(t.float())
        assert 0.3 < s.min() and s.max() < 1.5


def test_parameters_without_gradients_are_skipped_and_a_closure_is_called():
    ours, ref, opt, ref_opt = _pair(2, lr=0.02)
    ours[0].grad = torch.ones_like(ours[0])
    ref[0].grad = torch.ones_like(ref[0])
    before = [p.detach().clone() for p in ours]
    assert opt.step(lambda: torch.tensor(3.0)) == 3.0
    ref_opt.step()
    assert not torch.equal(ours[0], before[0])
    assert all(torch.equal(p, b) for p, b in zip(ours[1:], before[1:]))
    _bf16_close(ours[0].detach(), ref[0].detach(), scale=0.02)


def test_state_dicts_load_into_torch_muon_and_back():
    ours, ref, opt, ref_opt = _pair(3, lr=0.02)
    for p in ours:
        p.grad = torch.randn_like(p)
    opt.step()
    ref_opt.load_state_dict(opt.state_dict())
    for p, q in zip(ours, ref):
        assert torch.equal(ref_opt.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])
    again = Muon(ours, lr=0.02)
    again.load_state_dict(ref_opt.state_dict())
    assert again.param_groups[0]["lr"] == 0.02 and len(again.state) == len(ours)


def test_a_torch_without_muon_gets_a_clear_error(monkeypatch):
    import importlib

    import vitscope.training.muon

    monkeypatch.delattr(torch.optim, "Muon")
    try:
        stale = importlib.reload(vitscope.training.muon)
        with pytest.raises(RuntimeError, match="--optimizer adamw"):
            stale.Muon([nn.Parameter(torch.zeros(4, 4))], lr=0.02)
    finally:
        monkeypatch.undo()
        importlib.reload(vitscope.training.muon)
