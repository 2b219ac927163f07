# ruff: noqa: E501  (CSS and JavaScript read better unwrapped)
"""What the explorer's pages share: one self-contained HTML file (data and code inline, no network), its images
as PNG data URLs and its attention as base64 float16, the base styles, and the JavaScript that decodes the weights,
colours a map and fills the menus.

    page = Page(render_page(title=..., data=..., css=PAGE_CSS, body=PAGE_BODY, script=PAGE_SCRIPT))
    page            # in a notebook cell: the page itself, inline (in an iframe, so its styles and script stay its own)
    page.save(path) # the same page as a file

A page's script runs after the shared helpers inside one function, with `D`, the page's data, already parsed.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from vitscope.errors import ConfigError
from vitscope.inspect.images import display_image
from vitscope.io import atomic_write_text

# Past this a page gets slow to open; the error says how to shrink it.
DEFAULT_MAX_PAGE_BYTES = 64 * 2**20


def check_size(size: int, max_bytes: int, *, fewer: str) -> None:
    """Refuse a page that would embed more than `max_bytes` of data: a ConfigError that says how to shrink it."""
    if size > max_bytes:
        raise ConfigError(f"the page would embed {size / 2**20:.1f} MiB of attention; pass fewer {fewer} or raise "
                          f"max_bytes (now {max_bytes / 2**20:.1f} MiB)")


def png_data_url(image: Tensor) -> str:
    """One image (C, H, W), uint8 as it is or float stretched to its range, as a PNG data URL."""
    a = (display_image(image) * 255).round().astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a, mode="L" if a.ndim == 2 else "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def half_b64(t: Tensor) -> str:
    """A tensor as little-endian float16 bytes in base64: what the page's `decodeHalf` reads back."""
    return base64.b64encode(t.detach().cpu().to(torch.float16).numpy().astype("<f2").tobytes()).decode("ascii")


def render_page(*, title: str, data: dict, css: str, body: str, script: str) -> str:
    """The whole page: the shared styles then `css`, the title, `body`, the data as JSON, the shared helpers
    then `script`."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")  # no early </script>
    title = html.escape(title)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>{title}</title>\n'
            f"<style>\n{BASE_CSS}{css}</style>\n</head>\n<body>\n<h1>{title}</h1>\n{body}"
            f'<script id="vitscope-data" type="application/json">{text}</script>\n'
            f'<script>\n(function () {{\n  "use strict";\n  const D = JSON.parse(document.getElementById("vitscope-data").textContent);\n'
            f"{BASE_JS}{script}}})();\n</script>\n</body>\n</html>\n")


class Page:
    """One self-contained HTML page: `html` its text, `save(path)` writes it, and a notebook shows it inline.

    Jupyter renders `_repr_html_` into the notebook's own document; the page goes into an iframe's `srcdoc`
    there, so its styles and its script (and its `window.vitscope`) cannot touch the notebook or another page.
    """

    def __init__(self, html: str, *, height: int = 760):
        self.html = html
        self.height = height

    def save(self, path: str | Path) -> Path:
        """Write the page to `path` (.html) whole: a reader never sees half a page."""
        return atomic_write_text(path, self.html)

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" title="vitscope" '
                f'style="width: 100%; height: {int(self.height)}px; border: 1px solid #ddd; resize: vertical">'
                "</iframe>")

    def __repr__(self) -> str:
        return f"<vitscope.inspect.page.Page, {len(self.html):,} characters of HTML>"


def write_page(out_path: str | Path, *, title: str, data: dict, css: str, body: str, script: str) -> Path:
    """Write `render_page(...)` to `out_path` whole (a reader never sees half a page)."""
    return Page(render_page(title=title, data=data, css=css, body=body, script=script)).save(out_path)


BASE_CSS = """  body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 16px; color: #222; background: #fafafa; }
  h1 { font-size: 18px; margin: 0 0 8px; }
  .controls { display: flex; flex-wrap: wrap; gap: 14px; align-items: center; margin-bottom: 10px; }
  .controls label { font-weight: 600; }
  select { font: inherit; padding: 2px 6px; }
  .panels { display: flex; flex-wrap: wrap; gap: 18px; align-items: flex-start; }
  .panel { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px; }
  .panel h2 { font-size: 13px; margin: 0 0 6px; font-weight: 600; }
  canvas.map { image-rendering: pixelated; display: block; }
  .muted { color: #777; font-size: 12px; }
  table.heat { border-collapse: collapse; font-size: 12px; }
  table.heat td { width: 26px; height: 20px; border: 1px solid #eee; padding: 0; }
  table.heat th { font-weight: 400; padding: 0 4px; background: none; border: none; text-align: right; }
  table.heat th.col { writing-mode: vertical-rl; transform: rotate(180deg); height: 64px; text-align: left; }
  table.heat tr.active th { font-weight: 700; }
"""

BASE_JS = r"""
  function decodeHalf(b64) {  // base64 little-endian float16 -> Float32Array
    const bin = atob(b64), bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    const u16 = new Uint16Array(bytes.buffer), out = new Float32Array(u16.length);
    for (let i = 0; i < u16.length; i++) {
      const h = u16[i], s = (h & 0x8000) ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
      out[i] = e === 0 ? s * Math.pow(2, -14) * (f / 1024)
             : e === 31 ? (f ? NaN : s * Infinity) : s * Math.pow(2, e - 15) * (1 + f / 1024);
    }
    return out;
  }

  // inferno, sampled at 9 stops
  const STOPS = [[0,0,4],[40,11,84],[101,21,110],[159,42,99],[212,72,66],[245,125,21],[250,193,39],[245,251,161],[252,255,164]];
  function color(t) {
    t = Math.max(0, Math.min(1, t)) * (STOPS.length - 1);
    const i = Math.min(Math.floor(t), STOPS.length - 2), f = t - i, a = STOPS[i], b = STOPS[i + 1];
    return [0, 1, 2].map(j => Math.round(a[j] + f * (b[j] - a[j])));
  }

  function fill(id, items) {  // a <select>'s options from [value, text] pairs
    const sel = document.getElementById(id);
    for (const [v, t] of items) { const o = document.createElement("option"); o.value = String(v); o.textContent = t; sel.appendChild(o); }
  }

  function shade(t) { const [r, g, b] = color(t); return "rgb(" + r + "," + g + "," + b + ")"; }

  // A heatmap as a table: rows down the side, columns along the top (written upwards), cell (r, c) coloured by
  // value(r, c) in 0..1; the active row in bold, a click on a row's cell calls onRow(r).
  function heatTable(table, rows, cols, value, active, onRow) {
    table.innerHTML = "";
    const top = document.createElement("tr");
    top.appendChild(document.createElement("th"));
    for (const w of cols) { const th = document.createElement("th"); th.className = "col"; th.textContent = w; top.appendChild(th); }
    table.appendChild(top);
    rows.forEach((w, r) => {
      const tr = document.createElement("tr");
      if (r === active) tr.className = "active";
      const th = document.createElement("th"); th.textContent = w; tr.appendChild(th);
      cols.forEach((_, c) => {
        const v = value(r, c), td = document.createElement("td");
        td.style.background = shade(v); td.title = v.toFixed(3);
        if (onRow) td.addEventListener("click", () => onRow(r));
        tr.appendChild(td);
      });
      table.appendChild(tr);
    });
  }

  const imgs = D.images.map(im => { const e = new Image(); e.src = im.src; return e; });
  function whenImagesDecoded(render) { Promise.all(imgs.map(im => im.decode ? im.decode().catch(() => {}) : null)).then(render); }
"""
