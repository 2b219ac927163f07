# ruff: noqa: E501  (HTML and JavaScript read better unwrapped)
"""What the sequence explorers share (captions.html, translations.html): an item picker (an image or a
sentence), a layer and a head picker, the generated words as buttons, one state, and each word's attention
averaged over the chosen layers and heads. Each explorer keeps only what it draws.

Its data names its items: `item` ("image" or "sentence") and the list under that name plus "s", each entry
with `words` and `weights`, base64 float16 (T, L, H, N) (L = H = 1 for an RNN); `num_layers`, `num_heads`.
A page's own script runs after this one, defines `render()` and calls `startExplorer(label, api)`.

    render_page(title=..., data=data, css=SEQUENCE_CSS + CSS, body=sequence_body("image", "Image", ...),
                script=SEQUENCE_SCRIPT + SCRIPT)
"""

from __future__ import annotations

SEQUENCE_CSS = """  .words { font-size: 18px; max-width: 640px; margin: 4px 0 10px; }
  .words button { font: inherit; border: 1px solid transparent; background: none; padding: 1px 3px; margin: 1px; cursor: pointer; border-radius: 4px; }
  .words button:hover { border-color: #999; }
  .words button.active { background: #333; color: #fff; }
  .words button.wrong { color: #c00; }
  #info { font-size: 12px; color: #444; max-width: 320px; }
  .controls select { max-width: 380px; }
"""


def sequence_body(item: str, label: str, content: str, *, controls: str = "", before: str = "") -> str:
    """The controls (the item picker, layer, head, then `controls`), `before` (what stands above the words),
    the words' line (id "words") and the page's `content`."""
    return (f'<div class="controls">\n'
            f'  <span><label for="{item}">{label}</label> <select id="{item}"></select></span>\n'
            f'  <span><label for="layer">Layer</label> <select id="layer"></select></span>\n'
            f'  <span><label for="head">Head</label> <select id="head"></select></span>\n'
            f"{controls}</div>\n{before}"
            f'<div class="words" id="words"></div>\n{content}')


SEQUENCE_SCRIPT = r"""  const L = D.num_layers, H = D.num_heads, ITEM = D.item, ITEMS = D[ITEM + "s"], FIXED = L === 1 && H === 1;
  const W = ITEMS.map(it => decodeHalf(it.weights));  // per item (T, L, H, N)
  const state = { [ITEM]: 0, word: 0, layer: "mean", head: "mean" };

  function weight(t, k, N) {  // word t's attention to token k of N, averaged over the chosen layers and heads
    const w = W[state[ITEM]];
    const ls = state.layer === "mean" ? [...Array(L).keys()] : [state.layer];
    const hs = state.head === "mean" ? [...Array(H).keys()] : [state.head];
    let s = 0;
    for (const l of ls) for (const h of hs) s += w[((t * L + l) * H + h) * N + k];
    return s / (ls.length * hs.length);
  }
  function peakOf(row) { let p = 0; for (let k = 1; k < row.length; k++) if (row[k] > row[p]) p = k; return p; }
  function chosen(fixedText) {  // what the map averages, in words
    return FIXED ? fixedText : (state.layer === "mean" ? "mean of layers" : "layer " + state.layer)
      + ", " + (state.head === "mean" ? "mean of heads" : "head " + state.head);
  }

  function renderWords(extraClass) {  // the generated words as buttons; a click shows that word's attention
    const box = document.getElementById("words"), words = ITEMS[state[ITEM]].words;
    box.innerHTML = "";
    words.forEach((w, t) => {
      const b = document.createElement("button");
      b.textContent = w; b.dataset.word = t;
      b.className = (t === state.word ? "active" : "") + (extraClass ? extraClass(t, w) : "");
      b.addEventListener("click", () => setState({ word: t }));
      box.appendChild(b);
    });
  }

  function setState(change) {
    Object.assign(state, change);
    state.word = Math.min(state.word, ITEMS[state[ITEM]].words.length - 1);
    for (const id of [ITEM, "layer", "head"]) document.getElementById(id).value = String(state[id]);
    render();
    document.body.dataset.state = JSON.stringify({ [ITEM]: state[ITEM], word: state.word, layer: state.layer, head: state.head });
  }

  function startExplorer(itemText, api) {  // fill the pickers, listen, draw; `api` joins window.vitscope
    fill(ITEM, ITEMS.map((it, i) => [i, itemText(it, i)]));
    fill("layer", [["mean", "mean of layers"]].concat(Array.from({ length: L }, (_, l) => [l, "layer " + l])));
    fill("head", [["mean", "mean of heads"]].concat(Array.from({ length: H }, (_, h) => [h, "head " + h])));
    document.getElementById("layer").disabled = FIXED;
    document.getElementById("head").disabled = FIXED;
    const num = v => v === "mean" ? "mean" : +v;
    document.getElementById(ITEM).addEventListener("change", e => setState({ [ITEM]: +e.target.value, word: 0 }));
    document.getElementById("layer").addEventListener("change", e => setState({ layer: num(e.target.value) }));
    document.getElementById("head").addEventListener("change", e => setState({ head: num(e.target.value) }));
    setState({});
    window.vitscope = Object.assign(window.vitscope || {}, { data: D, state: state, setState: setState, ready: true }, api);
  }
"""
