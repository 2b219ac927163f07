# ruff: noqa: E501  (HTML and JavaScript read better unwrapped)
""""Over training": a slider over the steps a run kept its probes at, showing the probed attention at that step.
Every explorer (explorer.html, captions.html, translations.html) carries it when its data holds `probes`;
`probes_page` is the section alone.

    explore(model, images, probes=read_probes(run))   # the explorer with its "Over training" section
    probes_page(read_probes(run))                     # the section alone, inline in a notebook

At each step the page shows what probes_figure draws: a translation's alignment (target words over source
words), a caption's words each with its map over the image, a classifier's class-token map over each probed
image beside each head's mean attention distance. A transformer's maps are its last layer, heads averaged.
Tests read the shown step through `window.vitscope.training.current()`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vitscope.inspect.page import Page, half_b64, png_data_url, render_page
from vitscope.inspect.probes import Probes, heads_mean


def probes_data(probes: Probes) -> dict:
    """What the section reads: per probe its words or image, and per step its attention as base64 float16,
    reduced as probes_figure reduces it: (K, T, N) for translate and caption (N the image's patches), (K, P)
    for classify, beside each head's mean attention distance (L, H)."""
    out = {"kind": probes.kind, "steps": probes.steps, "epochs": probes.epochs, "inputs": probes.inputs,
           "grid": list(probes.grid) if probes.grid else None, "images": []}
    if probes.images is not None:
        out["images"] = [{"src": png_data_url(im)} for im in probes.images]
    frames, distances = [], []
    for s in probes.steps:
        att = probes.attention(s)
        if probes.kind == "classify":
            maps = att[:, -1].mean(1)  # (K, L, H, P) -> (K, P): the last layer, heads averaged
            distances.append({"shape": list(probes.distance(s).shape), "data": half_b64(probes.distance(s))})
        else:
            rows = [heads_mean(a) for a in att]  # K x (T, N)
            if probes.kind == "caption":
                rows = [r[:, probes.num_prefix_tokens:] for r in rows]
            maps = torch.stack(rows)
        frames.append({"shape": list(maps.shape), "data": half_b64(maps)})
    out["frames"] = frames
    if distances:
        out["distances"] = distances
    return out


def data_bytes(data: dict | None) -> int:
    """How much `data` adds to a page, as JSON."""
    return 0 if data is None else len(json.dumps(data, separators=(",", ":")))


def over_training(data: dict) -> tuple[str, str, str]:
    """The section's (css, body, script) for a page whose `data` holds `probes`; empty strings where it does not."""
    if not data.get("probes"):
        return "", "", ""
    return CSS, BODY, SCRIPT


def probes_page(probes: Probes, *, title: str = "vitscope: attention over training") -> Page:
    """The "Over training" section alone, as a page: choose a probe, move the slider over the training steps and
    watch its attention change. A notebook shows it inline; `.save(path)` writes it."""
    return Page(render_page(title=title, data={"images": [], "probes": probes_data(probes)}, css=CSS, body=BODY,
                            script=SCRIPT))


def write_probes_page(probes: Probes, out_path: str | Path, **kw) -> Path:
    return probes_page(probes, **kw).save(out_path)


CSS = """  #over-training { margin-top: 18px; }
  #over-training input[type=range] { width: 420px; vertical-align: middle; }
  #probe-view .cell { display: inline-block; margin: 4px; text-align: center; font-size: 12px; vertical-align: top; }
  #probe-view .cell canvas { display: block; margin-bottom: 2px; }
  table.dist { border-collapse: collapse; font-size: 12px; margin-top: 6px; }
  table.dist td, table.dist th { border: 1px solid #ddd; padding: 2px 6px; text-align: right; min-width: 34px; }
  table.dist th { background: #f0f0f0; font-weight: 600; }
"""

BODY = """<div class="panel" id="over-training">
  <h2>Over training</h2>
  <div class="controls">
    <span id="probe-pick"><label for="probe-input">Input</label> <select id="probe-input"></select></span>
    <span><label for="probe-step">Step</label> <input id="probe-step" type="range" min="0" max="0" step="1" value="0" list="probe-ticks"></span>
    <datalist id="probe-ticks"></datalist>
    <span id="probe-step-text"></span>
  </div>
  <div id="probe-view"></div>
  <p class="muted" id="probe-note">The run kept these inputs' attention before its first step and at every evaluation;
  the slider moves through them. A transformer's view is its last layer, heads averaged.</p>
</div>
"""

SCRIPT = r"""
  (function () {  // "Over training": its own scope, beside the page's
    const T = D.probes;
    const frames = T.frames.map(f => ({ shape: f.shape, values: decodeHalf(f.data) }));
    const dists = (T.distances || []).map(f => ({ shape: f.shape, values: decodeHalf(f.data) }));
    // a head's distance coloured within the run's range (all steps, all heads): how far it moved, not how far it is
    const distLo = Math.min(...dists.map(f => Math.min(...f.values))), distHi = Math.max(...dists.map(f => Math.max(...f.values)));
    const pics = T.images.map(im => { const e = new Image(); e.src = im.src; return e; });
    const slider = document.getElementById("probe-step"), pick = document.getElementById("probe-input");
    const view = document.getElementById("probe-view");
    slider.max = String(T.steps.length - 1);
    slider.value = slider.max;
    for (const s of T.steps.keys()) { const o = document.createElement("option"); o.value = String(s); document.getElementById("probe-ticks").appendChild(o); }
    fill("probe-input", T.inputs.map((p, i) => [i, p.label || (p.words || p.target || []).join(" ") || String(i)]));
    if (T.kind === "classify") document.getElementById("probe-pick").style.display = "none";  // every image at once

    function mapCanvas(img, values, offset) {  // an image with its patch map on top, 0 .. the map's maximum
      const [gh, gw] = T.grid, size = 112, cv = document.createElement("canvas");
      cv.width = size; cv.height = size; cv.className = "map";
      const g = cv.getContext("2d");
      g.imageSmoothingEnabled = false;
      g.drawImage(img, 0, 0, size, size);
      let max = 1e-12;
      for (let i = 0; i < gh * gw; i++) max = Math.max(max, values[offset + i]);
      g.globalAlpha = 0.6;
      for (let y = 0; y < gh; y++) for (let x = 0; x < gw; x++) {
        g.fillStyle = shade(values[offset + y * gw + x] / max);
        g.fillRect(x * size / gw, y * size / gh, Math.ceil(size / gw), Math.ceil(size / gh));
      }
      return cv;
    }
    function cell(canvas, text) {
      const c = document.createElement("div"); c.className = "cell";
      c.appendChild(canvas); c.appendChild(document.createTextNode(text)); view.appendChild(c);
    }
    function distanceTable(f) {  // rows layers, columns heads
      const [nl, nh] = f.shape, tbl = document.createElement("table");
      tbl.className = "dist";
      tbl.innerHTML = "<tr><th>mean distance (px)</th>" + Array.from({ length: nh }, (_, h) => "<th>head " + h + "</th>").join("") + "</tr>";
      for (let l = 0; l < nl; l++) {
        const tr = document.createElement("tr");
        tr.innerHTML = "<th>layer " + l + "</th>";
        for (let h = 0; h < nh; h++) {
          const v = f.values[l * nh + h], td = document.createElement("td"), t = (v - distLo) / Math.max(distHi - distLo, 1e-6);
          td.textContent = v.toFixed(2); td.style.background = shade(t); td.style.color = t > 0.6 ? "#000" : "#fff";
          tr.appendChild(td);
        }
        tbl.appendChild(tr);
      }
      return tbl;
    }

    function current() {
      const i = +slider.value, k = +pick.value, f = frames[i];
      return { index: i, step: T.steps[i], epoch: T.epochs[i], input: k, shape: f.shape, values: Array.from(f.values),
               distance: dists.length ? Array.from(dists[i].values) : null };
    }
    function render() {
      const i = +slider.value, k = +pick.value, f = frames[i], p = T.inputs[k];
      document.getElementById("probe-step-text").textContent = "step " + T.steps[i] + " (epoch " + +(+T.epochs[i]).toFixed(2) + "), "
        + (i + 1) + " of " + T.steps.length;
      view.innerHTML = "";
      if (T.kind === "translate") {
        const [, TT, N] = f.shape, tbl = document.createElement("table");
        tbl.className = "heat";
        heatTable(tbl, p.target, p.source, (t, n) => f.values[(k * TT + t) * N + n], -1, null);
        view.appendChild(tbl);
      } else if (T.kind === "caption") {
        const [, TT, P] = f.shape;
        p.words.forEach((w, t) => cell(mapCanvas(pics[k], f.values, (k * TT + t) * P), w));
      } else {
        const [, P] = f.shape;
        T.inputs.forEach((q, j) => cell(mapCanvas(pics[j], f.values, j * P), q.label));
        if (dists.length) {
          view.appendChild(distanceTable(dists[i]));
          const note = document.createElement("p");
          note.className = "muted";
          note.textContent = "Each head's mean attention distance at this step; colours run over the run's range, "
            + distLo.toFixed(2) + " px (dark) to " + distHi.toFixed(2) + " px (bright).";
          view.appendChild(note);
        }
      }
      document.getElementById("over-training").dataset.step = String(T.steps[i]);
    }
    function setStep(i) { slider.value = String(i); render(); }
    slider.addEventListener("input", render);
    pick.addEventListener("change", render);
    Promise.all(pics.map(im => im.decode ? im.decode().catch(() => {}) : null)).then(render);
    render();
    window.vitscope = Object.assign(window.vitscope || {}, { training: { current: current, setStep: setStep, ready: true } });
  })();
"""
