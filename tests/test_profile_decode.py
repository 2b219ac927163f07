"""benchmarks/profile_decode.py's parts on a tiny captioner: the loop's timers leave the model as they found it (the
same tokens after as before, no instance attribute left behind), the parts are the ones the table names, and the
encoder's pieces (with their FLOP counts) and the figure come out. A smoke test, not a timing: no speed is checked."""

from __future__ import annotations

import torch

from helpers import load_benchmark


def test_loop_parts_leave_the_model_as_it_was_and_add_up():
    bench = load_benchmark("profile_decode")
    model = bench.build_impl("vitscope", bench.quick_shape(small=True)).eval()
    images = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        memory = model.encode(images)
        before = bench.decode(model, memory=memory, beam=1, max_len=5).tokens
        parts = bench.loop_parts(model, memory, 4, rounds=1)
        after = bench.decode(model, memory=memory, beam=1, max_len=5).tokens
    assert torch.equal(before, after)
    wrapped = ("step_cross_attention", "step_self_attention", "step_mlp", "_step")
    assert not set(wrapped) & set(vars(model.decoder)) and "step" not in vars(model)
    assert set(parts) == {"first step (fills the caches)", "cross-attention", "self-attention", "MLP",
                          "rest of the steps", "checks before each step", "between steps"}
    # each part a CPU time (differences of the process clock, so at worst a tick below 0); the first step works
    assert all(ms > -1.0 for ms in parts.values()) and parts["first step (fills the caches)"] > 0


def test_encoder_pieces_and_the_figure(tmp_path):
    bench = load_benchmark("profile_decode")
    model = bench.build_impl("vitscope", bench.quick_shape(small=True)).eval()
    images = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        pieces = bench.encoder_pieces(model, images)
    names = [p[0] for p in pieces]
    assert names[1:] == ["qkv projection", "attention", "output projection", "fc1", "GELU", "fc2",
                         "LayerNorm (one of two)"]
    b, n, d = 2, (16 // 4) ** 2, 32  # the small shape: 16 x 16 images, patches of 4, width 32, no class token
    assert abs(dict((p[0], p[3]) for p in pieces)["qkv projection"] - 2 * b * n * d * 3 * d / 1e9) < 1e-12
    path = tmp_path / "decode.png"
    bench.draw(path, 4, {"vitscope": (1.0, 3.0), "vitscope-plain": (1.5, 4.0), "hf-sdpa": (2.0, 6.0)},
               {"cross-attention": 1.0, "MLP": 0.5}, "tiny")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
