# ruff: noqa: E501  (HTML and JavaScript read better unwrapped)
"""The explorer's translation mode: one self-contained HTML page (the parts every page shares:
vitscope.inspect.page; the parts it shares with the caption explorer: .sequence_page; the "Over training"
slider: .probes_page).

A person picks a sentence, reads its translation, clicks a target word and sees where it looked: a bar over each
source word, the peak marked, the gold source word (where known) underlined; and the whole heatmap of the
sentence below, rows the target words, columns the source words. For a transformer a layer and a head (or
their mean) are chosen.

    data = translate_explorer_data(sources, translations, attentions, gold=..., references=...)
    write_translate_page(data, "translations.html")
    translate_explorer_data(..., probes=read_probes(run_dir))  # with a slider over the run's training steps

Each sentence's attention travels as base64 float16, (T, L, H, N) (L = H = 1 for the RNN). Tests read the
shown row through `window.vitscope.currentRow()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from vitscope.inspect.page import DEFAULT_MAX_PAGE_BYTES, Page, check_size, half_b64, render_page
from vitscope.inspect.probes import Probes
from vitscope.inspect.probes_page import data_bytes, over_training, probes_data
from vitscope.inspect.sequence_page import SEQUENCE_CSS, SEQUENCE_SCRIPT, sequence_body


def translate_explorer_data(sources: Sequence[Sequence[str]], translations: Sequence[Sequence[str]],
                            attentions: Sequence[Tensor], *, gold: Sequence[Sequence[int]] | None = None,
                            references: Sequence[Sequence[str]] | None = None, probes: Probes | None = None,
                            max_bytes: int = DEFAULT_MAX_PAGE_BYTES) -> dict:
    """What the page shows, JSON-ready. attentions[i] (T, N) or (T, L, H, N), row t for translation word t.
    With a run's `probes` the page adds "Over training", a slider over the steps the run kept. A page past
    `max_bytes` is refused (a ConfigError that says how to shrink it)."""
    if not (len(sources) == len(translations) == len(attentions)):
        raise ValueError(f"{len(sources)} sentences, {len(translations)} translations and {len(attentions)} "
                         f"attention maps; give one of each per sentence")
    entries, shape, size = [], None, 0
    for i, (src, words, att) in enumerate(zip(sources, translations, attentions)):
        att = att.detach().float().cpu()
        att = att[:, None, None] if att.ndim == 2 else att  # (T, L, H, N)
        if shape is not None and att.shape[1:3] != shape:
            raise ValueError(f"sentence {i}'s attention has {tuple(att.shape[1:3])} layers x heads, sentence 0's "
                             f"{tuple(shape)}")
        shape = att.shape[1:3]
        att = att[: len(words), :, :, : len(src)].contiguous()
        size += att.numel() * 2 * 4 // 3
        entries.append({"source": list(src), "words": list(words), "weights": half_b64(att),
                        "gold": list(gold[i]) if gold is not None else None,
                        "reference": list(references[i]) if references is not None else None})
    layers, heads = (int(shape[0]), int(shape[1])) if shape is not None else (1, 1)
    over = probes_data(probes) if probes is not None else None
    check_size(size + data_bytes(over), max_bytes, fewer="sentences")
    return {"num_layers": layers, "num_heads": heads, "item": "sentence", "images": [], "sentences": entries,
            "probes": over}


def translate_page(data: dict, *, title: str = "vitscope translations") -> Page:
    """The page for `translate_explorer_data`'s data: a notebook shows it inline, `.save(path)` writes it."""
    css, body, script = over_training(data)
    return Page(render_page(title=title, data=data, css=SEQUENCE_CSS + CSS + css, body=BODY + body,
                            script=SEQUENCE_SCRIPT + SCRIPT + script), height=900 if body else 760)


def write_translate_page(data: dict, out_path: str | Path, *, title: str = "vitscope translations") -> Path:
    """The page for `translate_explorer_data`'s data, written to `out_path` (.html)."""
    return translate_page(data, title=title).save(out_path)


CSS = """  #bars { display: flex; gap: 4px; align-items: flex-end; height: 140px; }
  #bars .bar { display: flex; flex-direction: column; align-items: center; justify-content: flex-end; height: 100%; min-width: 42px; }
  #bars .fill { width: 28px; }
  #bars .w { font-size: 13px; margin-top: 4px; }
  #bars .gold .w { text-decoration: underline; font-weight: 700; }
  #bars .peak .fill { outline: 2px solid #00b8d4; }
"""

BODY = sequence_body("sentence", "Sentence", """<div class="panels">
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
""", before="""<p class="muted">Source: <span id="source"></span></p>
<p class="muted">Reference: <span id="reference"></span></p>
""")

SCRIPT = r"""  function currentRow() {
    const s = D.sentences[state.sentence], N = s.source.length, row = s.source.map((_, k) => weight(state.word, k, N));
    const gold = s.gold && state.word < s.gold.length ? s.gold[state.word] : null;
    return { sentence: state.sentence, word: state.word, text: s.words[state.word], row: row, peak: peakOf(row), gold: gold };
  }

  function render() {
    const s = D.sentences[state.sentence], m = currentRow(), N = s.source.length;
    document.getElementById("source").textContent = s.source.join(" ");
    document.getElementById("reference").textContent = s.reference ? s.reference.join(" ") : "(none)";
    renderWords((t, w) => s.reference && s.reference[t] !== w ? " wrong" : "");
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
    document.getElementById("info").textContent = chosen("the alignment") + ". Peak on \u201c" + s.source[m.peak] + "\u201d ("
      + (100 * m.row[m.peak]).toFixed(1) + "%)" + (m.gold !== null ? "; it translates \u201c" + s.source[m.gold] + "\u201d (underlined)." : ".");
    heatTable(document.getElementById("heat"), s.words, s.source, (t, k) => weight(t, k, N), state.word, t => setState({ word: t }));
  }

  startExplorer((s, i) => i + ": " + s.source.join(" "), { currentRow: currentRow });
"""
