"""Every explorer carries "Over training" when given a run's probes: a slider with one entry per kept step, each
step's probed attention at every layer and head (or, past the section's budget, as probes_figure reduces it: last
layer, heads averaged); in a real Chromium, picking a layer and a head and moving the slider shows that layer and
head at that step. The sequence explorers refuse a page past max_bytes with one clear error. (Real runs' pages:
test_probes.py for explorer.html, test_translate_cli.py for translations.html.)"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from helpers import CHROMIUM, playwright_or_skip
from vitscope import create_model
from vitscope.errors import ConfigError
from vitscope.inspect import Probes, explore, probes_page
from vitscope.inspect.caption_explorer import caption_explorer_data, caption_page
from vitscope.inspect.probes_page import probes_data
from vitscope.inspect.translate_explorer import translate_explorer_data, translate_page

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
TOL = dict(rtol=2e-3, atol=2e-4)  # float16 on the page


def page_data(html: str) -> dict:
    """The JSON a page carries."""
    return json.loads(html.split('<script id="vitscope-data" type="application/json">')[1].split("</script>")[0])


def unhalf(frame: dict) -> torch.Tensor:
    """One frame of the page's data (base64 float16 and its shape) as a float tensor."""
    return torch.from_numpy(np.frombuffer(base64.b64decode(frame["data"]), "<f2").astype(np.float32)
                            .reshape(frame["shape"]).copy())


def _rows(*shape, seed=0) -> torch.Tensor:
    """Attention-like rows: non-negative, each summing to 1 over the last axis."""
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)).softmax(-1)


STEPS = [0, 10, 20]


def caption_probes() -> Probes:  # 2 scenes, 3 words, a 2-layer 2-head decoder over a class token + 2 x 2 grid
    images = torch.randint(0, 256, (2, 1, 8, 8), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    tensors = {s: {"attention": _rows(2, 3, 2, 2, 5, seed=s)} for s in STEPS}
    inputs = [{"words": ["a", "bag", "here"]}, {"words": ["two", "coats", "there"]}]
    return Probes("caption", inputs, STEPS, [0, 1, 2], tensors, images, (2, 2), 1)


def translate_probes() -> Probes:
    tensors = {s: {"attention": _rows(2, 3, 4, seed=s)} for s in STEPS}  # an RNN: (K, T, N)
    inputs = [{"source": ["w", "x", "y", "z"], "target": ["a", "b", "c"]},
              {"source": ["p", "q", "r", "s"], "target": ["d", "e", "f"]}]
    return Probes("translate", inputs, STEPS, [0, 1, 2], tensors)


def translate_transformer_probes() -> Probes:  # a 2-layer 2-head decoder: (K, T, L, H, N)
    tensors = {s: {"attention": _rows(2, 3, 2, 2, 4, seed=s)} for s in STEPS}
    return Probes("translate", translate_probes().inputs, STEPS, [0, 1, 2], tensors)


def classify_probes() -> Probes:  # 3 images, a 2-layer 2-head model on a 4 x 4 grid
    images = torch.randint(0, 256, (3, 1, 8, 8), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    tensors = {s: {"attention": _rows(3, 2, 2, 16, seed=s), "distance": torch.rand(2, 2) * 4 + s / 10}
               for s in STEPS}
    return Probes("classify", [{"label": "0"}, {"label": "1"}, {"label": "2"}], STEPS, [0, 1, 2], tensors, images,
                  (4, 4), 0)


def view(probes: Probes, step: int, layer: int | None = None, head: int | str = "mean") -> torch.Tensor:
    """What the page should show of `step`, from the probes' own tensor: (K, P) for classify, (K, T, N) for a
    sequence; `layer` None is the last layer."""
    att = probes.attention(step)  # (K, L, H, P), (K, T, L, H, N) or (K, T, N)
    if att.ndim == 3:
        return att
    layer = -1 if layer is None else layer
    att = att[:, layer] if probes.kind == "classify" else att[:, :, layer, :, probes.num_prefix_tokens:]
    return att.mean(-2) if head == "mean" else att[..., head, :]  # att: (K, [T,] H, N)


def caption_page_of(probes=None, **kw):
    att = [_rows(2, 2, 2, 5), _rows(3, 2, 2, 5, seed=3)]
    data = caption_explorer_data(torch.zeros(2, 1, 8, 8, dtype=torch.uint8), [["a", "bag"], ["a", "coat", "x"]], att,
                                 grid=(2, 2), num_prefix_tokens=1, probes=probes, **kw)
    return caption_page(data)


def translate_page_of(probes=None, **kw):
    data = translate_explorer_data([["w", "x", "y"]], [["a", "b"]], [_rows(2, 3)], gold=[[0, 1]],
                                   references=[["a", "b"]], probes=probes, **kw)
    return translate_page(data)


def test_one_slider_entry_per_step_holding_every_layer_and_head():
    for probes, make in [(caption_probes(), caption_page_of), (translate_probes(), translate_page_of),
                         (translate_transformer_probes(), translate_page_of), (classify_probes(), probes_page)]:
        over = page_data(make(probes).html)["probes"]
        assert over["steps"] == STEPS and len(over["frames"]) == len(STEPS) and over["note"] is None
        layered = probes.attention(0).ndim > 3  # the RNN translator's attention has no layers or heads
        assert (over["layers"], over["heads"]) == ((2, 2) if layered else (None, None))
        for s, frame in zip(STEPS, over["frames"]):
            got = unhalf(frame)
            for layer, head in [(0, 0), (0, 1), (1, 0), (1, 1)] if layered else [(None, "mean")]:
                # classify (K, L, H, P), caption (K, T, L, H, P) past its class token, translate (K, T, N)
                at = got[:, layer, head] if probes.kind == "classify" else got[:, :, layer, head] if layered else got
                torch.testing.assert_close(at, view(probes, s, layer, head), atol=1e-3, rtol=1e-3)
    assert "over-training" not in caption_page_of().html  # no probes, no section
    assert page_data(translate_page_of().html)["probes"] is None


def test_past_its_budget_the_section_keeps_the_last_layer_heads_averaged():
    for probes in (classify_probes(), caption_probes(), translate_transformer_probes()):
        full = probes_data(probes)
        assert full["layers"] == 2 and full["note"] is None
        small = probes_data(probes, max_bytes=len(full["frames"][0]["data"]))  # one step's worth: too small
        assert small["layers"] is small["heads"] is None
        assert "shows only the last layer, heads averaged" in small["note"] and "max_bytes" in small["note"]
        for s, frame in zip(STEPS, small["frames"]):
            torch.testing.assert_close(unhalf(frame), view(probes, s), atol=1e-3, rtol=1e-3)
        assert probes_data(probes, max_bytes=sum(len(f["data"]) for f in full["frames"]))["layers"] == 2  # it fits
    assert probes_data(translate_probes(), max_bytes=1)["note"] is None  # nothing to reduce in an RNN's alignment


def test_the_translate_explorer_refuses_a_page_too_large_as_the_caption_explorer_does():
    for make, fewer in [(translate_page_of, "sentences"), (caption_page_of, "images")]:
        with pytest.raises(ConfigError, match=f"would embed .* MiB of attention; pass fewer {fewer} or raise "
                                              "max_bytes"):
            make(max_bytes=8)
        make(max_bytes=300)  # the same page fits a larger limit
    # the probes count too: a page that fits alone is refused with them
    with pytest.raises(ConfigError, match="pass fewer sentences"):
        translate_page_of(translate_probes(), max_bytes=300)



def test_picking_a_layer_and_head_and_moving_the_slider_shows_them_in_chromium(tmp_path):
    sync_api = playwright_or_skip()
    model = create_model("vit_tiny_patch4_28", img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2).eval()
    torch.manual_seed(0)
    cls = classify_probes()
    pages = {"explorer": (explore(model, torch.randn(2, 1, 8, 8), probes=cls), cls, 3 + 0),
             "captions": (caption_page_of(caption_probes()), caption_probes(), 3),
             "translations": (translate_page_of(translate_probes()), translate_probes(), 0),
             "transformer translations": (translate_page_of(translate_transformer_probes()),
                                          translate_transformer_probes(), 0),
             "probes": (probes_page(cls), cls, 3),
             "reduced": (probes_page(cls, max_bytes=100), cls, 3)}  # past its budget: no pickers
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        errors = []
        try:
            for name, (page_obj, probes, maps) in pages.items():
                page = browser.new_page(viewport={"width": 1100, "height": 900})
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(page_obj.save(tmp_path / f"{name.replace(' ', '_')}.html").as_uri())
                page.wait_for_function("window.vitscope && window.vitscope.training && window.vitscope.training.ready")
                assert page.locator("#probe-ticks option").count() == len(STEPS)
                assert page.eval_on_selector("#probe-step", "e => +e.max") == len(STEPS) - 1
                pickers = probes.attention(0).ndim > 3 and name != "reduced"
                assert page.locator("#probe-heads").is_visible() == pickers, name
                shown = page.evaluate("window.vitscope.training.current()")
                # the view starts at the end of training, at the last layer, heads averaged
                assert shown["step"] == STEPS[-1]
                assert (shown["layer"], shown["head"]) == ((1, "mean") if pickers else (None, None)), name
                np.testing.assert_allclose(shown["values"], view(probes, STEPS[-1]).flatten().numpy(), **TOL)
                layer, head = (0, 1) if pickers else (None, "mean")
                if pickers:
                    page.select_option("#probe-layer", "0")
                    page.select_option("#probe-head", "1")
                page.locator("#probe-step").fill("1")
                shown = page.evaluate("window.vitscope.training.current()")
                assert (shown["index"], shown["step"], shown["layer"]) == (1, 10, layer), name
                np.testing.assert_allclose(shown["values"], view(probes, 10, layer, head).flatten().numpy(), **TOL)
                if probes.kind == "classify":
                    np.testing.assert_allclose(shown["distance"], probes.distance(10).flatten().numpy(), rtol=2e-3)
                    assert page.locator("table.dist td").count() == 2 * 2  # layers x heads at this step
                    picked = page.locator("table.dist td.picked")
                    # the shown cell: layer 0's head 1, or where reduced the last layer's row
                    assert picked.count() == (1 if pickers else 2), name
                    if pickers:
                        assert picked.text_content() == f"{probes.distance(10)[0, 1]:.2f}"
                        page.locator("table.dist td").nth(2).click()  # layer 1, head 0: the pickers follow
                        shown = page.evaluate("window.vitscope.training.current()")
                        assert (shown["layer"], shown["head"]) == (1, 0)
                        np.testing.assert_allclose(shown["values"], view(probes, 10, 1, 0).flatten().numpy(), **TOL)
                        page.select_option("#probe-head", "mean")
                        assert page.locator("table.dist td.picked").count() == 2  # the whole layer's row
                note = page.locator("#probe-note").text_content()
                assert ("shows only the last layer" in note) == (name == "reduced"), name
                if probes.kind == "translate":
                    assert page.locator("#probe-view table.heat td").count() == 3 * 4  # target x source words
                else:
                    assert page.locator("#probe-view canvas").count() == maps
                assert page.locator("#over-training").get_attribute("data-step") == "10"
                assert not errors, (name, errors)
                page.close()
        finally:
            browser.close()
