"""The explorer in a real headless Chromium: pick, hover, switch modes, compare the map with the data."""

import json

import numpy as np
import pytest
import torch

from helpers import CHROMIUM, playwright_or_skip
from vitscope import create_model
from vitscope.inspect import capture_attention, rollout, write_explorer

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
TOL = dict(rtol=2e-3, atol=2e-4)  # float16 on the page



@pytest.fixture(scope="module")
def page_and_data(tmp_path_factory):
    sync_api = playwright_or_skip()
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", depth=2, embed_dim=32, num_heads=4, img_size=(20, 28)).eval()
    images = torch.randn(2, 1, 20, 28)
    out = write_explorer(model, images, tmp_path_factory.mktemp("explorer") / "explorer.html",
                         labels=torch.tensor([3, 5]), class_names=[f"class {i}" for i in range(10)])
    text = out.read_text()
    assert "http://" not in text and "https://" not in text  # nothing to fetch: works offline
    cap = capture_attention(model, images)
    w = torch.stack(cap.layers(), 1).numpy()  # (B, L, H, N, N)
    roll = rollout(cap.layers(), num_prefix_tokens=1).numpy()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(out.as_uri())
            page.wait_for_function("window.vitscope && window.vitscope.ready")
            yield page, w, roll, out, errors
        finally:
            browser.close()


def _hover_patch(page, r, c, grid=(5, 7)):
    box = page.locator("#map-row").bounding_box()
    x = box["x"] + (c + 0.5) * box["width"] / grid[1]
    y = box["y"] + (r + 0.5) * box["height"] / grid[0]
    page.mouse.move(x, y)


def _shown(page):
    return page.evaluate("window.vitscope.currentMap()")


def test_explorer_in_chromium(page_and_data):
    page, w, roll, out, errors = page_and_data
    p, gw = 1, 7
    # starts on the CLS map of the last layer, mean of heads
    m = _shown(page)
    assert (m["mode"], m["layer"], m["head"], m["token"]) == ("cls", 1, "mean", 0)
    np.testing.assert_allclose(m["row"], w[0, 1, :, 0, p:].mean(0), **TOL)

    page.select_option("#image", "1")
    page.select_option("#layer", "0")
    page.select_option("#head", "2")
    before = _shown(page)["row"]
    _hover_patch(page, 3, 5)
    m = _shown(page)
    q = p + 3 * gw + 5
    assert (m["mode"], m["image"], m["layer"], m["head"], m["token"]) == ("patch", 1, 0, 2, q)
    assert not np.allclose(m["row"], before)
    np.testing.assert_allclose(m["row"], w[1, 0, 2, q, p:], **TOL)  # where the patch looks: its row
    np.testing.assert_allclose(m["col"], w[1, 0, 2, p:, q], **TOL)  # what looks at it: its column
    shown = json.loads(page.get_attribute("#map-row", "data-values"))
    np.testing.assert_allclose(shown, w[1, 0, 2, q, p:], **TOL)
    _hover_patch(page, 0, 1)
    np.testing.assert_allclose(_shown(page)["row"], w[1, 0, 2, p + 1, p:], **TOL)

    page.click("#mode-cls")
    m = _shown(page)
    assert m["mode"] == "cls" and m["token"] == 0
    np.testing.assert_allclose(m["row"], w[1, 0, 2, 0, p:], **TOL)

    page.click("#stats tbody tr[data-head='1']")
    np.testing.assert_allclose(_shown(page)["row"], w[1, 0, 1, 0, p:], **TOL)
    assert page.locator("#stats tbody tr").count() == 4

    page.click("#mode-rollout")
    m = _shown(page)
    assert m["mode"] == "rollout"
    np.testing.assert_allclose(m["row"], roll[1, 0, p:], **TOL)
    assert page.inner_text("#label") == "true label: class 5"
    assert page.locator("#predictions tr").count() == 5
    page.screenshot(path=str(out.with_suffix(".png")), full_page=True)
    assert errors == []


def test_explorer_data_from_uint8_images_with_mean_std():
    """How `vitscope train` calls it: uint8 images, the training mean/std, labels as a list."""
    import base64

    from vitscope.inspect.explorer import explorer_data

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", depth=2, embed_dim=16, num_heads=2).eval()
    images = torch.randint(0, 256, (3, 1, 28, 28), dtype=torch.uint8)
    data = explorer_data(model, images, labels=[1, None, 9], class_names=[f"k{i}" for i in range(10)],
                         mean=[0.3], std=[0.4])
    assert [im["label"] for im in data["images"]] == ["k1", None, "k9"]
    assert len(data["images"][0]["top"]) == 5
    assert data["images"][0]["src"].startswith("data:image/png;base64,")
    w = np.frombuffer(base64.b64decode(data["weights"]), dtype="<f2").reshape(3, 2, 2, 50, 50)
    cap = capture_attention(model, (images.float() / 255 - 0.3) / 0.4)
    np.testing.assert_allclose(w, torch.stack(cap.layers(), 1).numpy(), **TOL)
    with pytest.raises(ValueError, match="fewer images"):
        explorer_data(model, images, max_bytes=1000)


def test_explore_is_a_page_a_notebook_shows_inline(tmp_path):
    """`explore` returns the page `write_explorer` writes; its `_repr_html_` holds that page in an iframe."""
    import base64
    import html

    from vitscope.inspect import explore
    from vitscope.inspect.page import Page

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", depth=1, embed_dim=16, num_heads=2).eval()
    images = torch.randn(2, 1, 28, 28)
    page = explore(model, images, labels=[3, 4], class_names=[f"class {i}" for i in range(10)])
    assert isinstance(page, Page)
    shown = page._repr_html_()
    assert shown.startswith("<iframe srcdoc=\"") and shown.endswith("</iframe>")
    srcdoc = shown[len("<iframe srcdoc=\""):shown.index("\"", len("<iframe srcdoc=\""))]
    assert html.unescape(srcdoc) == page.html  # the whole page, escaped once
    data = json.loads(page.html.split('type="application/json">')[1].split("</script>")[0])
    w = np.frombuffer(base64.b64decode(data["weights"]), dtype="<f2").reshape(2, 1, 2, 50, 50)
    np.testing.assert_allclose(w[:, 0], capture_attention(model, images)[0].numpy(), **TOL)
    assert data["images"][1]["label"] == "class 4"
    written = write_explorer(model, images, tmp_path / "e.html", labels=[3, 4],
                             class_names=[f"class {i}" for i in range(10)])
    assert page.save(tmp_path / "p.html").read_text() == written.read_text() == page.html


def test_explore_inline_runs_in_chromium(page_and_data, tmp_path):
    """The page works inside the notebook's iframe as it does as a file."""
    from vitscope.inspect import explore

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", depth=1, embed_dim=16, num_heads=2).eval()
    images = torch.randn(1, 1, 28, 28)
    w = capture_attention(model, images)[0].numpy()
    notebook = tmp_path / "notebook.html"
    notebook.write_text("<!DOCTYPE html><html><body><h1>a notebook</h1>" + explore(model, images)._repr_html_()
                        + "</body></html>")
    page = page_and_data[0].context.browser.new_page()  # the module's browser: one Playwright at a time
    try:
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(notebook.as_uri())
        frame = page.frames[1]
        frame.wait_for_function("window.vitscope && window.vitscope.ready")
        m = frame.evaluate("window.vitscope.currentMap()")
        np.testing.assert_allclose(m["row"], w[0, :, 0, 1:].mean(0), **TOL)
        assert page.evaluate("window.vitscope === undefined")  # the page's script stays in its frame
        assert errors == []
    finally:
        page.close()
