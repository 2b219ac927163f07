# ruff: noqa: E501  (HTML and JavaScript read better unwrapped)
"""The explorer's caption mode: one self-contained HTML page (data and code inline, no network; the parts every
page shares: vitscope.inspect.page).

A person picks an image, reads its generated caption, clicks a word and sees where that word
looked: the transformer's cross-attention of one layer or the mean of layers, one head or the mean
of heads; the LSTM's alignment map. The image's reference captions stand beside it.

    data = caption_explorer_data(images, words, attentions, grid=(7, 7), num_prefix_tokens=1,
                                 references=ds.captions[:8])
    caption_page(data)                       # in a notebook cell: the page, inline
    write_caption_page(data, "captions.html")  # the same page as a file

The page takes plain data (words and their attention arrays), so it draws any captioner's output;
`vitscope.caption.plots.write_caption_explorer` decodes a model's captions into it.

Each word's attention travels as base64 float16, (T, L, H, N) per image (L = H = 1 for the LSTM).
Tests read the shown map through `window.vitscope.currentMap()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from vitscope.errors import ConfigError
from vitscope.inspect.page import DEFAULT_MAX_PAGE_BYTES, Page, half_b64, png_data_url, render_page


def caption_explorer_data(images: Tensor, captions: Sequence[Sequence[str]], attentions: Sequence[Tensor], *,
                          grid: tuple[int, int], num_prefix_tokens: int = 0,
                          references: Sequence[Sequence[str]] | None = None, names: Sequence[str] | None = None,
                          max_bytes: int = DEFAULT_MAX_PAGE_BYTES) -> dict:
    """What the page shows, JSON-ready. images (B, C, H, W); captions[i] the words of image i;
    attentions[i] their attention, (T, N) for the LSTM or (T, L, H, N) for the transformer, row t for
    the step that chose word t (a row after the last word is that caption's <eos>)."""
    if not (len(images) == len(captions) == len(attentions)):
        raise ValueError(f"{len(images)} images, {len(captions)} captions and {len(attentions)} attention maps; "
                         "give one of each per image")
    entries, size, shape = [], 0, None
    for i, (words, att) in enumerate(zip(captions, attentions)):
        att = att.detach().float().cpu()
        att = att[:, None, None] if att.ndim == 2 else att  # (T, L, H, N)
        if shape is None:
            shape = att.shape[1:]
        elif att.shape[1:] != shape:
            raise ValueError(f"image {i}'s attention has shape {tuple(att.shape[1:])} per word, image 0's {tuple(shape)}")
        if att.shape[-1] != num_prefix_tokens + grid[0] * grid[1]:
            raise ValueError(f"attention over {att.shape[-1]} tokens does not fit {num_prefix_tokens} prefix "
                             f"tokens + a {grid[0]} x {grid[1]} grid")
        words = list(words)
        labels = words + (["<eos>"] if att.shape[0] > len(words) else [])
        att = att[: len(labels)]
        size += att.numel() * 2 * 4 // 3
        entries.append({"src": png_data_url(images[i]), "words": labels, "weights": half_b64(att),
                        "references": list(references[i]) if references is not None else [],
                        "name": names[i] if names is not None and i < len(names) else None})
    if size > max_bytes:
        raise ConfigError(f"the page would embed {size / 2**20:.1f} MiB of attention; pass fewer images or raise max_bytes")
    return {"grid": list(grid), "num_prefix_tokens": num_prefix_tokens, "image_size": list(images.shape[-2:]),
            "num_layers": int(shape[0]) if shape is not None else 1, "num_heads": int(shape[1]) if shape is not None else 1,
            "kind": "lstm" if attentions and attentions[0].ndim == 2 else "transformer", "images": entries}


def caption_page(data: dict, *, title: str = "vitscope captions") -> Page:
    """The page for `caption_explorer_data`'s data: a notebook shows it inline, `.save(path)` writes it."""
    return Page(render_page(title=title, data=data, css=CSS, body=BODY, script=SCRIPT))


def write_caption_page(data: dict, out_path: str | Path, *, title: str = "vitscope captions") -> Path:
    """The page for `caption_explorer_data`'s data, written to `out_path` (.html)."""
    return caption_page(data, title=title).save(out_path)


CSS = """  #caption { font-size: 18px; max-width: 560px; margin: 4px 0 10px; }
  #caption button { font: inherit; border: 1px solid transparent; background: none; padding: 1px 3px; margin: 1px; cursor: pointer; border-radius: 4px; }
  #caption button:hover { border-color: #999; }
  #caption button.active { background: #333; color: #fff; }
  .refs { max-width: 440px; }
  #references { margin: 0; padding-left: 18px; }
  #info { font-size: 12px; color: #444; max-width: 320px; }
"""

BODY = """<div class="controls">
  <span><label for="image">Image</label> <select id="image"></select></span>
  <span><label for="layer">Layer</label> <select id="layer"></select></span>
  <span><label for="head">Head</label> <select id="head"></select></span>
  <span><label for="opacity">Map opacity</label> <input id="opacity" type="range" min="0" max="100" value="62"></span>
</div>
<div id="caption"></div>
<div class="panels">
  <div class="panel">
    <h2 id="map-title">Where the word looked</h2>
    <canvas id="map" class="map"></canvas>
    <p id="info"></p>
  </div>
  <div class="panel refs">
    <h2>Reference captions</h2>
    <ol id="references"></ol>
    <p class="muted">Click a word of the generated caption to see its attention. Colours run from 0 to
    the map's own maximum; the cyan box is its peak.</p>
  </div>
</div>
"""

SCRIPT = r"""  const P = D.num_prefix_tokens, GH = D.grid[0], GW = D.grid[1], N = P + GH * GW;
  const L = D.num_layers, H = D.num_heads, LSTM = D.kind === "lstm";

  const W = D.images.map(im => decodeHalf(im.weights));  // per image (T, L, H, N)
  const state = { image: 0, word: 0, layer: "mean", head: "mean", opacity: 0.62 };

  function att(t, l, h, k) { return W[state.image][((t * L + l) * H + h) * N + k]; }
  function value(k) {  // the selected word's attention to token k, averaged as selected
    const ls = state.layer === "mean" ? [...Array(L).keys()] : [state.layer];
    const hs = state.head === "mean" ? [...Array(H).keys()] : [state.head];
    let s = 0;
    for (const l of ls) for (const h of hs) s += att(state.word, l, h, k);
    return s / (ls.length * hs.length);
  }
  function currentMap() {
    const row = [], prefix = [];
    for (let p = 0; p < GH * GW; p++) row.push(value(P + p));
    for (let p = 0; p < P; p++) prefix.push(value(p));
    let peak = 0;
    for (let p = 1; p < row.length; p++) if (row[p] > row[peak]) peak = p;
    return { image: state.image, word: state.word, text: D.images[state.image].words[state.word],
             layer: state.layer, head: state.head, grid: [GH, GW], row: row, prefix: prefix, peak: peak };
  }

  const SCALE = Math.max(1, Math.floor(320 / Math.max(D.image_size[0], D.image_size[1])));
  const CH = D.image_size[0] * SCALE, CW = D.image_size[1] * SCALE, cellH = CH / GH, cellW = CW / GW;

  function draw(m) {
    const cv = document.getElementById("map"), ctx = cv.getContext("2d");
    cv.width = CW; cv.height = CH;
    ctx.imageSmoothingEnabled = false;
    const im = imgs[state.image];
    if (im.complete) ctx.drawImage(im, 0, 0, CW, CH);
    const mx = Math.max(...m.row);
    for (let r = 0; r < GH; r++) for (let c = 0; c < GW; c++) {
      const [cr, cg, cb] = color(mx > 0 ? m.row[r * GW + c] / mx : 0);
      ctx.fillStyle = "rgba(" + cr + "," + cg + "," + cb + "," + state.opacity + ")";
      ctx.fillRect(c * cellW, r * cellH, cellW, cellH);
    }
    const pr = Math.floor(m.peak / GW), pc = m.peak % GW;
    ctx.strokeStyle = "#00e5ff"; ctx.lineWidth = 2;
    ctx.strokeRect(pc * cellW + 1, pr * cellH + 1, cellW - 2, cellH - 2);
    cv.dataset.values = JSON.stringify(m.row.map(v => +v.toPrecision(6)));
  }

  function render() {
    const im = D.images[state.image], m = currentMap();
    const cap = document.getElementById("caption");
    cap.innerHTML = "";
    im.words.forEach((w, t) => {
      const b = document.createElement("button");
      b.textContent = w; b.dataset.word = t;
      if (t === state.word) b.className = "active";
      b.addEventListener("click", () => setState({ word: t }));
      cap.appendChild(b);
    });
    const refs = document.getElementById("references");
    refs.innerHTML = "";
    for (const r of im.references) { const li = document.createElement("li"); li.textContent = r; refs.appendChild(li); }
    draw(m);
    const src = LSTM ? "the LSTM's alignment" : (state.layer === "mean" ? "mean of layers" : "layer " + state.layer)
      + ", " + (state.head === "mean" ? "mean of heads" : "head " + state.head);
    document.getElementById("map-title").textContent = "Where \u201c" + m.text + "\u201d looked";
    const pre = m.prefix.reduce((a, b) => a + b, 0);
    document.getElementById("info").textContent = src + ". Peak at patch (row " + Math.floor(m.peak / GW) + ", col "
      + (m.peak % GW) + ")" + (P ? "; " + (100 * pre).toFixed(1) + "% of the attention went to the class token (not drawn)." : ".");
    document.body.dataset.state = JSON.stringify({ image: state.image, word: state.word, layer: state.layer, head: state.head });
  }

  function setState(change) {
    Object.assign(state, change);
    state.word = Math.min(state.word, D.images[state.image].words.length - 1);
    document.getElementById("image").value = String(state.image);
    document.getElementById("layer").value = String(state.layer);
    document.getElementById("head").value = String(state.head);
    render();
  }
  fill("image", D.images.map((im, i) => [i, "image " + i + (im.name ? " \u2014 " + im.name : "")]));
  fill("layer", [["mean", "mean of layers"]].concat(Array.from({ length: L }, (_, l) => [l, "layer " + l])));
  fill("head", [["mean", "mean of heads"]].concat(Array.from({ length: H }, (_, h) => [h, "head " + h])));
  document.getElementById("layer").disabled = LSTM;
  document.getElementById("head").disabled = LSTM;
  const num = v => v === "mean" ? "mean" : +v;
  document.getElementById("image").addEventListener("change", e => setState({ image: +e.target.value, word: 0 }));
  document.getElementById("layer").addEventListener("change", e => setState({ layer: num(e.target.value) }));
  document.getElementById("head").addEventListener("change", e => setState({ head: num(e.target.value) }));
  document.getElementById("opacity").addEventListener("input", e => setState({ opacity: +e.target.value / 100 }));
  whenImagesDecoded(render);
  setState({});
  window.vitscope = { data: D, state: state, currentMap: currentMap, setState: setState, ready: true };
"""
