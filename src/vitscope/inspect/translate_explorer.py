# ruff: noqa: E501  (HTML and JavaScript read better unwrapped)
"""The explorer's translation mode: one self-contained HTML page (the parts every page shares:
vitscope.inspect.page).

A person picks a sentence, reads its translation, clicks a target word and sees where it looked: a bar over each
source word, the peak marked, the gold source word (where known) underlined; and the whole heatmap of the
sentence below, rows the target words, columns the source words. For a transformer a layer and a head (or
their mean) are chosen.

    data = translate_explorer_data(sources, translations, attentions, gold=..., references=...)
    write_translate_page(data, "translations.html")

Each sentence's attention travels as base64 float16, (T, L, H, N) (L = H = 1 for the RNN). Tests read the
shown row through `window.vitscope.currentRow()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from vitscope.inspect.page import Page, half_b64, render_page


def translate_explorer_data(sources: Sequence[Sequence[str]], translations: Sequence[Sequence[str]],
                            attentions: Sequence[Tensor], *, gold: Sequence[Sequence[int]] | None = None,
                            references: Sequence[Sequence[str]] | None = None) -> dict:
    """What the page shows, JSON-ready. attentions[i] (T, N) or (T, L, H, N), row t for translation word t."""
    if not (len(sources) == len(translations) == len(attentions)):
        raise ValueError(f"{len(sources)} sentences, {len(translations)} translations and {len(attentions)} "
                         f"attention maps; give one of each per sentence")
    entries, shape = [], None
    for i, (src, words, att) in enumerate(zip(sources, translations, attentions)):
        att = att.detach().float().cpu()
        att = att[:, None, None] if att.ndim == 2 else att  # (T, L, H, N)
        if shape is not None and att.shape[1:3] != shape:
            raise ValueError(f"sentence {i}'s attention has {tuple(att.shape[1:3])} layers x heads, sentence 0's "
                             f"{tuple(shape)}")
        shape = att.shape[1:3]
        att = att[: len(words), :, :, : len(src)].contiguous()
        entries.append({"source": list(src), "words": list(words), "weights": half_b64(att),
                        "gold": list(gold[i]) if gold is not None else None,
                        "reference": list(references[i]) if references is not None else None})
    layers, heads = (int(shape[0]), int(shape[1])) if shape is not None else (1, 1)
    return {"num_layers": layers, "num_heads": heads, "images": [], "sentences": entries}


def translate_page(data: dict, *, title: str = "vitscope translations") -> Page:
    """The page for `translate_explorer_data`'s data: a notebook shows it inline, `.save(path)` writes it."""
    return Page(render_page(title=title, data=data, css=CSS, body=BODY, script=SCRIPT))


def write_translate_page(data: dict, out_path: str | Path, *, title: str = "vitscope translations") -> Path:
    """The page for `translate_explorer_data`'s data, written to `out_path` (.html)."""
    return translate_page(data, title=title).save(out_path)


CSS = """  .words { font-size: 18px; margin: 4px 0 10px; }
  .words button { font: inherit; border: 1px solid transparent; background: none; padding: 1px 3px; margin: 1px; cursor: pointer; border-radius: 4px; }
  .words button:hover { border-color: #999; }
  .words button.active { background: #333; color: #fff; }
  .words button.wrong { color: #c00; }
  #bars { display: flex; gap: 4px; align-items: flex-end; height: 140px; }
  #bars .bar { display: flex; flex-direction: column; align-items: center; justify-content: flex-end; height: 100%; min-width: 42px; }
  #bars .fill { width: 28px; }
  #bars .w { font-size: 13px; margin-top: 4px; }
  #bars .gold .w { text-decoration: underline; font-weight: 700; }
  #bars .peak .fill { outline: 2px solid #00b8d4; }
  table.heat { border-collapse: collapse; font-size: 12px; }
  table.heat td { width: 26px; height: 20px; border: 1px solid #eee; }
  table.heat th { font-weight: 400; padding: 0 4px; }
  table.heat th.col { writing-mode: vertical-rl; transform: rotate(180deg); height: 64px; }
  table.heat tr.active th { font-weight: 700; }
"""

BODY = """<div class="controls">
  <span><label for="sentence">Sentence</label> <select id="sentence"></select></span>
  <span><label for="layer">Layer</label> <select id="layer"></select></span>
  <span><label for="head">Head</label> <select id="head"></select></span>
</div>
<p class="muted">Source: <span id="source"></span></p>
<p class="muted">Reference: <span id="reference"></span></p>
<div class="words" id="translation"></div>
<div class="panels">
  <div class="panel">
    <h2 id="row-title">Where the word looked</h2>
    <div id="bars"></div>
    <p id="info" class="muted"></p>
  </div>
  <div class="panel">
    <h2>The whole sentence</h2>
    <table class="heat" id="heat"></table>
    <p class="muted">Rows: the translation's words; columns: the source words; brighter is more attention.</p>
  </div>
</div>
"""

SCRIPT = r"""  const L = D.num_layers, H = D.num_heads;
  const W = D.sentences.map(s => decodeHalf(s.weights));  // per sentence (T, L, H, N)
  const state = { sentence: 0, word: 0, layer: "mean", head: "mean" };

  function value(t, k) {
    const s = D.sentences[state.sentence], N = s.source.length, w = W[state.sentence];
    const ls = state.layer === "mean" ? [...Array(L).keys()] : [state.layer];
    const hs = state.head === "mean" ? [...Array(H).keys()] : [state.head];
    let v = 0;
    for (const l of ls) for (const h of hs) v += w[((t * L + l) * H + h) * N + k];
    return v / (ls.length * hs.length);
  }
  function currentRow() {
    const s = D.sentences[state.sentence], row = s.source.map((_, k) => value(state.word, k));
    let peak = 0;
    for (let k = 1; k < row.length; k++) if (row[k] > row[peak]) peak = k;
    const gold = s.gold && state.word < s.gold.length ? s.gold[state.word] : null;
    return { sentence: state.sentence, word: state.word, text: s.words[state.word], row: row, peak: peak, gold: gold };
  }
  function shade(v) { const [r, g, b] = color(v); return "rgb(" + r + "," + g + "," + b + ")"; }

  function render() {
    const s = D.sentences[state.sentence], m = currentRow();
    document.getElementById("source").textContent = s.source.join(" ");
    document.getElementById("reference").textContent = s.reference ? s.reference.join(" ") : "(none)";
    const tr = document.getElementById("translation");
    tr.innerHTML = "";
    s.words.forEach((w, t) => {
      const b = document.createElement("button");
      b.textContent = w; b.dataset.word = t;
      const wrong = s.reference && s.reference[t] !== w;
      b.className = (t === state.word ? "active" : "") + (wrong ? " wrong" : "");
      b.addEventListener("click", () => setState({ word: t }));
      tr.appendChild(b);
    });
    const bars = document.getElementById("bars");
    bars.innerHTML = "";
    s.source.forEach((w, k) => {
      const d = document.createElement("div");
      d.className = "bar" + (k === m.peak ? " peak" : "") + (k === m.gold ? " gold" : "");
      const f = document.createElement("div");
      f.className = "fill"; f.style.height = Math.round(110 * m.row[k]) + "px"; f.style.background = shade(0.25 + 0.7 * m.row[k]);
      const label = document.createElement("div");
      label.className = "w"; label.textContent = w;
      d.appendChild(f); d.appendChild(label); bars.appendChild(d);
    });
    document.getElementById("row-title").textContent = "Where \u201c" + m.text + "\u201d looked";
    document.getElementById("info").textContent = "Peak on \u201c" + s.source[m.peak] + "\u201d (" + (100 * m.row[m.peak]).toFixed(1)
      + "%)" + (m.gold !== null ? "; it translates \u201c" + s.source[m.gold] + "\u201d (underlined)." : ".");
    const heat = document.getElementById("heat");
    heat.innerHTML = "";
    const head = document.createElement("tr");
    head.appendChild(document.createElement("th"));
    for (const w of s.source) { const th = document.createElement("th"); th.className = "col"; th.textContent = w; head.appendChild(th); }
    heat.appendChild(head);
    s.words.forEach((w, t) => {
      const tr2 = document.createElement("tr");
      if (t === state.word) tr2.className = "active";
      const th = document.createElement("th"); th.textContent = w; tr2.appendChild(th);
      s.source.forEach((_, k) => {
        const td = document.createElement("td");
        td.style.background = shade(value(t, k));
        td.addEventListener("click", () => setState({ word: t }));
        tr2.appendChild(td);
      });
      heat.appendChild(tr2);
    });
    document.body.dataset.state = JSON.stringify({ sentence: state.sentence, word: state.word, layer: state.layer, head: state.head });
  }

  function setState(change) {
    Object.assign(state, change);
    state.word = Math.min(state.word, D.sentences[state.sentence].words.length - 1);
    document.getElementById("sentence").value = String(state.sentence);
    document.getElementById("layer").value = String(state.layer);
    document.getElementById("head").value = String(state.head);
    render();
  }
  fill("sentence", D.sentences.map((s, i) => [i, i + ": " + s.source.join(" ")]));
  fill("layer", [["mean", "mean of layers"]].concat(Array.from({ length: L }, (_, l) => [l, "layer " + l])));
  fill("head", [["mean", "mean of heads"]].concat(Array.from({ length: H }, (_, h) => [h, "head " + h])));
  document.getElementById("layer").disabled = L === 1 && H === 1;
  document.getElementById("head").disabled = L === 1 && H === 1;
  const num = v => v === "mean" ? "mean" : +v;
  document.getElementById("sentence").addEventListener("change", e => setState({ sentence: +e.target.value, word: 0 }));
  document.getElementById("layer").addEventListener("change", e => setState({ layer: num(e.target.value) }));
  document.getElementById("head").addEventListener("change", e => setState({ head: num(e.target.value) }));
  setState({});
  window.vitscope = { data: D, state: state, currentRow: currentRow, setState: setState, ready: true };
"""
