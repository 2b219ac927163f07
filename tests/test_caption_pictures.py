"""The per-word attention figure and the explorer's caption mode (in a real headless Chromium)."""


import numpy as np
import pytest
import torch

from helpers import CHROMIUM, playwright_or_skip
from test_caption_models import images, one_thread, tiny  # noqa: F401 (one_thread: autouse)
from vitscope.caption.plots import (
    caption_figure,
    explore_captions,
    plot_caption_attention,
    word_maps,
    write_caption_explorer,
)
from vitscope.inspect.caption_explorer import caption_explorer_data, write_caption_page
from vitscope.sequence.decoding import beam_search
from vitscope.sequence.vocab import Vocabulary

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
TOL = dict(rtol=2e-3, atol=2e-4)  # float16 on the page
VOCAB = Vocabulary(["<pad>", "<bos>", "<eos>", "<unk>", "bag", "coat", "sneaker"])


def test_word_maps_pick_and_average():
    att = torch.rand(3, 2, 4, 1 + 6)  # (T, L, H, CLS + 2x3 patches)
    maps = word_maps(att, (2, 3), num_prefix_tokens=1)
    torch.testing.assert_close(maps, att[..., 1:].mean((1, 2)).view(3, 2, 3))
    one = word_maps(att, (2, 3), num_prefix_tokens=1, layer=1, head=2)
    torch.testing.assert_close(one, att[:, 1, 2, 1:].view(3, 2, 3))
    assert word_maps(torch.rand(3, 6), (2, 3)).shape == (3, 2, 3)
    with pytest.raises(ValueError, match="do not fill"):
        word_maps(att, (3, 3), num_prefix_tokens=1)


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_caption_figure_has_one_panel_per_word(kind, tmp_path):
    model = tiny(kind)
    image = (torch.rand(1, 8, 8) * 255).to(torch.uint8)
    fig = caption_figure(model, image, VOCAB, (0.5,), (0.25,), beam=3, path=tmp_path / "c.png")
    out = beam_search(model, (image[None].float() / 255 - 0.5) / 0.25, beam=3)
    words = out.words(VOCAB)[0]
    shown = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert shown[0] == "image" and shown[1:1 + len(words)] == words
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_figure_on_hand_made_attention(tmp_path):
    image = torch.zeros(1, 56, 56, dtype=torch.uint8)
    image[0, 28:, 28:] = 200
    att = torch.full((2, 16), 0.01)
    att[0, 15] = 1.0  # 'bag' looks at the bottom-right patch
    fig = plot_caption_attention(image, ["bag"], att, grid=(4, 4), references=["a bag at the bottom right"],
                                 path=tmp_path / "f.png")
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == ["image", "bag", "<eos>"]



def test_data_checks():
    with pytest.raises(ValueError, match="one of each per image"):
        caption_explorer_data(torch.zeros(2, 1, 8, 8), [["a"]], [torch.zeros(1, 5)], grid=(2, 2), num_prefix_tokens=1)
    with pytest.raises(ValueError, match="does not fit"):
        caption_explorer_data(torch.zeros(1, 1, 8, 8), [["a"]], [torch.zeros(1, 5)], grid=(2, 2))


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_caption_explorer_in_chromium(kind, tmp_path):
    sync_api = playwright_or_skip()
    model = tiny(kind)
    imgs = (images(2).clamp(-2, 2) * 60 + 128).to(torch.uint8)
    refs = [["a bag at the top left", "top left: bag"], ["a coat"]]
    path = write_caption_explorer(model, imgs, VOCAB, tmp_path / "captions.html", mean=(0.5,), std=(0.25,),
                                  beam=3, references=refs, names=["first", "second"])
    text = path.read_text()
    assert "http://" not in text and "https://" not in text  # works offline
    out = beam_search(model, (imgs.float() / 255 - 0.5) / 0.25, beam=3)
    words = out.words(VOCAB)
    att = out.attention.numpy()  # (B, T, L, H, N) or (B, T, N)
    if kind == "lstm":
        att = att[:, :, None, None]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 700})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(path.as_uri())
            page.wait_for_function("window.vitscope && window.vitscope.ready")
            m = page.evaluate("window.vitscope.currentMap()")
            assert (m["image"], m["word"], m["layer"], m["head"]) == (0, 0, "mean", "mean")
            np.testing.assert_allclose(m["row"], att[0, 0, :, :, 1:].mean((0, 1)), **TOL)
            assert page.locator("#references li").all_text_contents() == refs[0]

            page.select_option("#image", "1")
            assert page.locator("#references li").all_text_contents() == refs[1]
            buttons = page.locator("#words button")
            assert buttons.all_text_contents()[:len(words[1])] == words[1]
            t = min(1, buttons.count() - 1)
            buttons.nth(t).click()
            if kind == "transformer":
                page.select_option("#layer", "1")
                page.select_option("#head", "0")
                want = att[1, t, 1, 0, 1:]
            else:
                assert page.locator("#layer").is_disabled()
                want = att[1, t, 0, 0, 1:]
            m = page.evaluate("window.vitscope.currentMap()")
            assert (m["image"], m["word"]) == (1, t)
            np.testing.assert_allclose(m["row"], want, **TOL)
            assert m["peak"] == int(np.argmax(m["row"]))
            page.screenshot(path=str(tmp_path / f"explorer_{kind}.png"))
            assert not errors, errors
        finally:
            browser.close()


def test_page_from_hand_made_data(tmp_path):
    att = torch.zeros(2, 5)
    att[0, 1 + 3] = 1
    att[1, 0] = 1
    data = caption_explorer_data(torch.zeros(1, 1, 8, 8, dtype=torch.uint8), [["bag"]], [att], grid=(2, 2),
                                 num_prefix_tokens=1)
    assert data["kind"] == "lstm" and data["images"][0]["words"] == ["bag", "<eos>"]
    assert write_caption_page(data, tmp_path / "p.html").read_text().count("<script") == 2


def test_captions_page_shows_inline_and_saves_what_the_file_holds(tmp_path):
    import html

    from vitscope.figures import Figure

    model = tiny("transformer")
    imgs = (images(2).clamp(-2, 2) * 60 + 128).to(torch.uint8)
    page = explore_captions(model, imgs, VOCAB, mean=(0.5,), std=(0.25,), beam=3, names=["first", "second"])
    written = write_caption_explorer(model, imgs, VOCAB, tmp_path / "c.html", mean=(0.5,), std=(0.25,), beam=3,
                                     names=["first", "second"])
    assert page.html == written.read_text() and '"name":"second"' in page.html
    assert html.escape(page.html, quote=True) in page._repr_html_()
    fig = caption_figure(model, imgs[0], VOCAB, (0.5,), (0.25,), beam=3)
    assert isinstance(fig, Figure) and fig._repr_png_().startswith(b"\x89PNG")
