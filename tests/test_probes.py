"""Attention over training: a run keeps the attention of a few fixed inputs at step 0 and at every evaluation
(probes.safetensors), draws it at a few steps side by side (probes.png) and gives its explorer a slider over the
steps (explorer.html's "Over training"); a resumed run ends with the same probes, bit for bit, as one that never
stopped."""

from __future__ import annotations

import pytest
import torch

from test_explorer_over_training import page_data, unhalf
from test_train import TINY, tiny_config
from vitscope.errors import InputError
from vitscope.inspect.probes import probes_figure, read_probes
from vitscope.inspect.probes_page import probes_page
from vitscope.training.loop import train

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("probes") / "run"
    train(tiny_config(epochs=2, explain_images=2), out, progress=False)
    return out


def test_a_run_keeps_its_probes_at_step_0_and_every_evaluation(run):
    p = read_probes(run)
    assert p.kind == "classify" and p.steps == [0, 22, 44] and p.epochs == [0, 1, 2]
    assert [q["label"] for q in p.inputs] == ["0", "1", "2", "3"]  # the first test image of each of 4 classes
    assert p.images.dtype == torch.uint8 and tuple(p.images.shape) == (4, 1, 8, 8)
    att = p.attention(44)
    assert tuple(att.shape) == (4, TINY["depth"], TINY["num_heads"], 16)  # (K, L, H, P) on a 4 x 4 grid
    # no class token here: each patch's mean received attention over all queries, a distribution over patches
    torch.testing.assert_close(att.sum(-1), torch.ones(4, 2, 2), atol=2e-3, rtol=0)
    assert tuple(p.distance(44).shape) == (2, 2)
    assert not torch.equal(p.attention(0), att)  # training changed where the heads look
    assert (run / "probes.safetensors").stat().st_size < 5 * 2**20


def test_the_figure_and_the_page(run, tmp_path):
    assert (run / "probes.png").is_file() and not (run / "probes.html").exists()  # the explorer has the slider
    p = read_probes(run)
    fig = probes_figure(p, steps=[0, 44], path=tmp_path / "two.png")
    assert len(fig.axes) == 2 * 4 + 1  # two steps of four images, and the distance curves
    page = probes_page(p).html
    assert '"steps":[0,22,44]' in page and 'type="range"' in page
    with pytest.raises(InputError, match="no probes at step 5"):
        probes_figure(p, steps=[5])


def test_resume_keeps_the_same_probes(run, tmp_path):
    cfg = tiny_config(epochs=2)
    train(cfg, tmp_path, progress=False, max_steps=30)  # stops inside epoch 2, after the probes of step 22
    assert read_probes(tmp_path).steps == [0, 22]
    train(cfg, tmp_path, resume=True, progress=False)
    a, b = read_probes(run), read_probes(tmp_path)
    assert a.steps == b.steps
    for s in a.steps:
        for name in a.tensors[s]:
            assert torch.equal(a.tensors[s][name], b.tensors[s][name]), (s, name)


def test_missing_or_damaged_probes_are_one_clear_error(tmp_path):
    with pytest.raises(InputError, match="no probes"):
        read_probes(tmp_path)
    (tmp_path / "probes.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(InputError, match="damaged"):
        read_probes(tmp_path)


def test_the_explorer_has_a_slider_over_the_steps_holding_the_probes(run):
    """explorer.html's "Over training": one slider entry per kept step, each step's class-token maps at every
    layer and head and each head's mean distance as probes.safetensors holds them."""
    p = read_probes(run)
    page = (run / "explorer.html").read_text()
    assert 'id="over-training"' in page and 'id="probe-step"' in page
    over = page_data(page)["probes"]
    assert over["kind"] == "classify" and over["steps"] == p.steps == [0, 22, 44]
    assert len(over["frames"]) == len(over["distances"]) == len(p.steps)
    assert (over["layers"], over["heads"]) == (TINY["depth"], TINY["num_heads"])
    for s, frame, dist in zip(p.steps, over["frames"], over["distances"]):
        torch.testing.assert_close(unhalf(frame), p.attention(s), atol=1e-3, rtol=1e-3)  # (K, L, H, P)
        torch.testing.assert_close(unhalf(dist), p.distance(s), atol=1e-2, rtol=1e-3)
