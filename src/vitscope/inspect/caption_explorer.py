# ruff: noqa: E501  (HTML and JavaScript read better unwrapped)
"""The explorer's caption mode: one self-contained HTML page (data and code inline, no network; the parts every
page shares: vitscope.inspect.page; the parts it shares with the translation explorer: .sequence_page; the
"Over training" slider: .probes_page).

A person picks an image, reads its generated caption, clicks a word and sees where that word
looked: the transformer's cross-attention of one layer or the mean of layers, one head or the mean
of heads; the LSTM's alignment map. The image's reference captions stand beside it.

    data = caption_explorer_data(images, words, attentions, grid=(7, 7), num_prefix_tokens=1,
                                 references=ds.captions[:8])
    caption_page(data)                       # in a notebook cell: the page, inline
    write_caption_page(data, "captions.html")  # the same page as a file
    caption_explorer_data(..., probes=read_probes(run_dir))  # with a slider over the run's training steps

The page takes plain data (words and their attention arrays), so it draws any captioner's output;
`vitscope.caption.plots.write_caption_explorer` decodes a model's captions into it.

Each word's attention travels as base64 float16, (T, L, H, N) per image (L = H = 1 for the LSTM).
Tests read the shown map through `window.vitscope.currentMap()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from vitscope.inspect.page import DEFAULT_MAX_PAGE_BYTES, Page, check_size, half_b64, png_data_url, render_page
from vitscope.inspect.probes import Probes
from vitscope.inspect.probes_page import data_bytes, over_training, probes_data
from vitscope.inspect.sequence_page import SEQUENCE_CSS, SEQUENCE_SCRIPT, sequence_body


def caption_explorer_data(images: Tensor, captions: Sequence[Sequence[str]], attentions: Sequence[Tensor], *,
                          grid: tuple[int, int], num_prefix_tokens: int = 0,
                          references: Sequence[Sequence[str]] | None = None, names: Sequence[str] | None = None,
                          probes: Probes | None = None, max_bytes: int = DEFAULT_MAX_PAGE_BYTES) -> dict:
    """What the page shows, JSON-ready. images (B, C, H, W); captions[i] the words of image i;
    attentions[i] their attention, (T, N) for the LSTM or (T, L, H, N) for the transformer, row t for
    the step that chose word t (a row after the last word is that caption's <eos>). With a run's `probes`
    the page adds "Over training", a slider over the steps the run kept. A page past `max_bytes` is refused
    (a ConfigError that says how to shrink it)."""
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
    over = probes_data(probes) if probes is not None else None
    check_size(size + data_bytes(over), max_bytes, fewer="images")
    return {"grid": list(grid), "num_prefix_tokens": num_prefix_tokens, "image_size": list(images.shape[-2:]),
            "num_layers": int(shape[0]) if shape is not None else 1, "num_heads": int(shape[1]) if shape is not None else 1,
            "kind": "lstm" if attentions and attentions[0].ndim == 2 else "transformer", "item": "image",
            "images": entries, "probes": over}


def caption_page(data: dict, *, title: str = "vitscope captions") -> Page:
    """The page for `caption_explorer_data`'s data: a notebook shows it inline, `.save(path)` writes it."""
    css, body, script = over_training(data)
    return Page(render_page(title=title, data=data, css=SEQUENCE_CSS + CSS + css, body=BODY + body,
                            script=SEQUENCE_SCRIPT + SCRIPT + script), height=900 if body else 760)


def write_caption_page(data: dict, out_path: str | Path, *, title: str = "vitscope captions") -> Path:
    """The page for `caption_explorer_data`'s data, written to `out_path` (.html)."""
    return caption_page(data, title=title).save(out_path)


CSS = """  .refs { max-width: 440px; }
  #references { margin: 0; padding-left: 18px; }
"""

BODY = sequence_body("image", "Image", """<div class="panels">
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
""", controls="""  <span><label for="opacity">Map opacity</label> <input id="opacity" type="range" min="0" max="100" value="62"></span>
""")

SCRIPT = r"""  const P = D.num_prefix_tokens, GH = D.grid[0], GW = D.grid[1], N = P + GH * GW;
  state.opacity = 0.62;

  function currentMap() {
    const row = [], prefix = [];
    for (let p = 0; p < GH * GW; p++) row.push(weight(state.word, P + p, N));
    for (let p = 0; p < P; p++) prefix.push(weight(state.word, p, N));
    return { image: state.image, word: state.word, text: D.images[state.image].words[state.word],
             layer: state.layer, head: state.head, grid: [GH, GW], row: row, prefix: prefix, peak: peakOf(row) };
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
    renderWords();
    const refs = document.getElementById("references");
    refs.innerHTML = "";
    for (const r of im.references) { const li = document.createElement("li"); li.textContent = r; refs.appendChild(li); }
    draw(m);
    document.getElementById("map-title").textContent = "Where \u201c" + m.text + "\u201d looked";
    const pre = m.prefix.reduce((a, b) => a + b, 0);
    document.getElementById("info").textContent = chosen("the LSTM's alignment") + ". Peak at patch (row "
      + Math.floor(m.peak / GW) + ", col " + (m.peak % GW) + ")"
      + (P ? "; " + (100 * pre).toFixed(1) + "% of the attention went to the class token (not drawn)." : ".");
  }

  document.getElementById("opacity").addEventListener("input", e => setState({ opacity: +e.target.value / 100 }));
  whenImagesDecoded(render);
  startExplorer((im, i) => "image " + i + (im.name ? " \u2014 " + im.name : ""), { currentMap: currentMap });
"""
