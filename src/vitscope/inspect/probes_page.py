# ruff: noqa: E501  (HTML and JavaScript read better unwrapped)
""""Over training": a slider over the steps a run kept its probes at, showing the probed attention at that step.
Every explorer (explorer.html, captions.html, translations.html) carries it when its data holds `probes`;
`probes_page` is the section alone.

    explore(model, images, probes=read_probes(run))   # the explorer with its "Over training" section
    probes_page(read_probes(run))                     # the section alone, inline in a notebook

At each step the page shows what probes_figure draws: a translation's alignment (target words over source
words), a caption's words each with its map over the image, a classifier's class-token map over each probed
image beside each head's mean attention distance. A transformer's maps carry every layer and head; a layer
picker and a head picker ("mean of heads" or one head) choose the view, which starts at the last layer, heads
averaged. Past `max_bytes` the page keeps only that view and says so. Tests read the shown step, layer and head
through `window.vitscope.training.current()`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from vitscope.inspect.page import Page, half_b64, png_data_url, render_page
from vitscope.inspect.probes import Probes, heads_mean

# Every layer and head of every step: K x L x H x P floats per step for a classifier, K x T x L x H x N for a
# sequence. Past this a page would be slow to open, so it keeps the view it starts on (last layer, heads mean).
DEFAULT_MAX_PROBES_BYTES = 16 * 2**20


def _maps(probes: Probes, step: int) -> Tensor:
    """A step's maps as the page embeds them: (K, L, H, P) for classify, (K, T, L, H, N) for a transformer's
    sequence (a caption's image tokens only), (K, T, N) for an RNN or Show, Attend and Tell."""
    att = probes.attention(step)
    if probes.kind == "caption":
        att = att[..., probes.num_prefix_tokens:]
    return att


def _reduced(maps: Tensor, kind: str) -> Tensor:
    """The view the page starts on, as probes_figure draws it: the last layer, heads averaged."""
    if kind == "classify":
        return maps[:, -1].mean(1)  # (K, L, H, P) -> (K, P)
    return torch.stack([heads_mean(a) for a in maps])  # K x (T, L, H, N) -> (K, T, N); (K, T, N) as it is


def probes_data(probes: Probes, *, max_bytes: int = DEFAULT_MAX_PROBES_BYTES) -> dict:
    """What the section reads: per probe its words or image, and per step its attention as base64 float16:
    (K, L, H, P) for classify and (K, T, L, H, N) for a transformer's sequence (N a caption's image patches),
    with `layers` and `heads` saying how many; (K, T, N) for an RNN, whose attention has neither. Beside a
    classifier's maps, each head's mean attention distance (L, H). Where every layer and head would embed more
    than `max_bytes`, the maps are reduced as probes_figure reduces them (last layer, heads averaged), `layers`
    and `heads` are None and `note` says why."""
    out = {"kind": probes.kind, "steps": probes.steps, "epochs": probes.epochs, "inputs": probes.inputs,
           "grid": list(probes.grid) if probes.grid else None, "images": [], "layers": None, "heads": None,
           "note": None}
    if probes.images is not None:
        out["images"] = [{"src": png_data_url(im)} for im in probes.images]
    maps = [_maps(probes, s) for s in probes.steps]
    per_layer = maps[0].ndim == (4 if probes.kind == "classify" else 5)
    size = sum(m.numel() for m in maps) * 2 * 4 // 3  # float16 in base64
    if per_layer and size > max_bytes:
        out["note"] = (f"Every layer and head would embed {size / 1024:,.0f} KiB, more than the "
                       f"{max_bytes / 1024:,.0f} KiB allowed for them (max_bytes), so this section shows only the "
                       f"last layer, heads averaged.")
        maps, per_layer = [_reduced(m, probes.kind) for m in maps], False
    if per_layer:
        layer_axis = 1 if probes.kind == "classify" else 2
        out["layers"], out["heads"] = maps[0].shape[layer_axis], maps[0].shape[layer_axis + 1]
    out["frames"] = [{"shape": list(m.shape), "data": half_b64(m)} for m in maps]
    if probes.kind == "classify":
        out["distances"] = [{"shape": list(probes.distance(s).shape), "data": half_b64(probes.distance(s))}
                            for s in probes.steps]
    return out


def data_bytes(data: dict | None) -> int:
    """How much `data` adds to a page, as JSON."""
    return 0 if data is None else len(json.dumps(data, separators=(",", ":")))


def over_training(data: dict) -> tuple[str, str, str]:
    """The section's (css, body, script) for a page whose `data` holds `probes`; empty strings where it does not."""
    if not data.get("probes"):
        return "", "", ""
    return CSS, BODY, SCRIPT


def probes_page(probes: Probes, *, title: str = "vitscope: attention over training",
                max_bytes: int = DEFAULT_MAX_PROBES_BYTES) -> Page:
    """The "Over training" section alone, as a page: choose a probe, a layer and a head, move the slider over the
    training steps and watch its attention change. A notebook shows it inline; `.save(path)` writes it."""
    data = {"images": [], "probes": probes_data(probes, max_bytes=max_bytes)}
    return Page(render_page(title=title, data=data, css=CSS, body=BODY, script=SCRIPT))


def write_probes_page(probes: Probes, out_path: str | Path, **kw) -> Path:
    return probes_page(probes, **kw).save(out_path)


CSS = """  #over-training { margin-top: 18px; }
  #over-training input[type=range] { width: 420px; vertical-align: middle; }
  #probe-view .cell { display: inline-block; margin: 4px; text-align: center; font-size: 12px; vertical-align: top; }
  #probe-view .cell canvas { display: block; margin-bottom: 2px; }
  table.dist { border-collapse: collapse; font-size: 12px; margin-top: 6px; }
  table.dist td, table.dist th { border: 1px solid #ddd; padding: 2px 6px; text-align: right; min-width: 34px; }
  table.dist th { background: #f0f0f0; font-weight: 600; }
  table.dist td.picked { box-shadow: inset 0 0 0 2px #fff, inset 0 0 0 4px #000; font-weight: 700; }  /* seen on any shade */
  table.dist.pickable td { cursor: pointer; }
  #probe-note:empty { display: none; }
"""

BODY = """<div class="panel" id="over-training">
  <h2>Over training</h2>
  <div class="controls">
    <span id="probe-pick"><label for="probe-input">Input</label> <select id="probe-input"></select></span>
    <span id="probe-heads"><label for="probe-layer">Layer</label> <select id="probe-layer"></select>
      <label for="probe-head">Head</label> <select id="probe-head"></select></span>
    <span><label for="probe-step">Step</label> <input id="probe-step" type="range" min="0" max="0" step="1" value="0" list="probe-ticks"></span>
    <datalist id="probe-ticks"></datalist>
    <span id="probe-step-text"></span>
  </div>
  <div id="probe-view"></div>
  <p class="muted">The run kept these inputs' attention before its first step and at every evaluation; the slider
  moves through them. A transformer's view starts at its last layer, heads averaged.</p>
  <p class="muted" id="probe-note"></p>
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
    const L = T.layers, H = T.heads;  // null where the maps have neither (an RNN) or were reduced to fit
    const layerPick = document.getElementById("probe-layer"), headPick = document.getElementById("probe-head");
    if (L) {
      fill("probe-layer", Array.from({ length: L }, (_, l) => [l, "layer " + l]));
      fill("probe-head", [["mean", "mean of heads"]].concat(Array.from({ length: H }, (_, h) => [h, "head " + h])));
      layerPick.value = String(L - 1);
    } else {
      document.getElementById("probe-heads").style.display = "none";
    }
    if (T.note) document.getElementById("probe-note").textContent = T.note;

    function chosen() {  // the picked layer and head ("mean" for the heads' mean); null where there are no pickers
      return L ? { layer: +layerPick.value, head: headPick.value === "mean" ? "mean" : +headPick.value } : { layer: null, head: null };
    }
    function shown(i) {  // step i's maps at the picked layer and head: (K, P) or (K, T, N)
      const f = frames[i];
      if (!L) return f;
      const N = f.shape[f.shape.length - 1], outer = f.values.length / (L * H * N), c = chosen();
      const heads = c.head === "mean" ? Array.from({ length: H }, (_, h) => h) : [c.head];
      const out = new Float32Array(outer * N);
      for (let o = 0; o < outer; o++) for (const h of heads) {  // f.values is (outer, L, H, N), outer = K or K x T
        const base = ((o * L + c.layer) * H + h) * N;
        for (let n = 0; n < N; n++) out[o * N + n] += f.values[base + n] / heads.length;
      }
      return { shape: f.shape.slice(0, -3).concat([N]), values: out };
    }

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
    function distanceTable(f) {  // rows layers, columns heads; the shown layer's picked head (or all its heads) outlined
      const [nl, nh] = f.shape, tbl = document.createElement("table"), c = L ? chosen() : { layer: nl - 1, head: "mean" };
      tbl.className = L ? "dist pickable" : "dist";
      tbl.innerHTML = "<tr><th>mean distance (px)</th>" + Array.from({ length: nh }, (_, h) => "<th>head " + h + "</th>").join("") + "</tr>";
      for (let l = 0; l < nl; l++) {
        const tr = document.createElement("tr");
        tr.innerHTML = "<th>layer " + l + "</th>";
        for (let h = 0; h < nh; h++) {
          const v = f.values[l * nh + h], td = document.createElement("td"), t = (v - distLo) / Math.max(distHi - distLo, 1e-6);
          td.textContent = v.toFixed(2); td.style.background = shade(t); td.style.color = t > 0.6 ? "#000" : "#fff";
          if (l === c.layer && (c.head === "mean" || c.head === h)) td.classList.add("picked");
          if (L) td.addEventListener("click", () => { layerPick.value = String(l); headPick.value = String(h); render(); });
          tr.appendChild(td);
        }
        tbl.appendChild(tr);
      }
      return tbl;
    }

    function current() {
      const i = +slider.value, k = +pick.value, f = shown(i), c = chosen();
      return { index: i, step: T.steps[i], epoch: T.epochs[i], input: k, layer: c.layer, head: c.head, shape: f.shape,
               values: Array.from(f.values), distance: dists.length ? Array.from(dists[i].values) : null };
    }
    function render() {
      const i = +slider.value, k = +pick.value, f = shown(i), p = T.inputs[k];
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
    layerPick.addEventListener("change", render);
    headPick.addEventListener("change", render);
    Promise.all(pics.map(im => im.decode ? im.decode().catch(() => {}) : null)).then(render);
    render();
    window.vitscope = Object.assign(window.vitscope || {}, { training: { current: current, setStep: setStep, ready: true } });
  })();
"""
