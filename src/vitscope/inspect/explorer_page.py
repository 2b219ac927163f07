# ruff: noqa: E501  (HTML and JavaScript read better unwrapped)
"""The explorer's page: its own styles, markup and script (the parts every page shares: vitscope.inspect.page).

`explorer.py` fills in the title and the data. Tests and scripts can read the shown map through
`window.vitscope.currentMap()` or the canvases' `data-values` attributes.
"""

CSS = """  button { font: inherit; padding: 2px 6px; }
  .modes button { border: 1px solid #888; background: #fff; cursor: pointer; }
  .modes button.active { background: #333; color: #fff; }
  canvas.map { cursor: crosshair; }
  .scale { display: flex; align-items: center; gap: 6px; font-size: 12px; margin-top: 4px; }
  .scale canvas { border: 1px solid #ccc; }
  #info { font-size: 12px; color: #444; min-height: 2.8em; max-width: 620px; }
  table { border-collapse: collapse; font-size: 12px; }
  th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: right; }
  th { background: #f0f0f0; }
  tr.selected td { background: #ffe9a8; }
  tbody tr { cursor: pointer; }
  .bar { display: inline-block; height: 9px; background: #4a7ebb; vertical-align: middle; }
  #predictions td:first-child { text-align: left; }
"""

BODY = """<div class="controls">
  <span><label for="image">Image</label> <select id="image"></select></span>
  <span><label for="layer">Layer</label> <select id="layer"></select></span>
  <span><label for="head">Head</label> <select id="head"></select></span>
  <span class="modes" id="modes">
    <button id="mode-patch" data-mode="patch">Patch (hover)</button>
    <button id="mode-cls" data-mode="cls">CLS map</button>
    <button id="mode-rollout" data-mode="rollout">Rollout</button>
  </span>
  <span><label for="opacity">Map opacity</label> <input id="opacity" type="range" min="0" max="100" value="62"></span>
</div>
<div class="panels">
  <div class="panel">
    <h2 id="title-row">Where it looks</h2>
    <canvas id="map-row" class="map"></canvas>
    <div class="scale"><span id="row-min">0</span><canvas id="scale-row" width="120" height="10"></canvas><span id="row-max">1</span></div>
  </div>
  <div class="panel">
    <h2 id="title-col">What looks at it</h2>
    <canvas id="map-col" class="map"></canvas>
    <div class="scale"><span id="col-min">0</span><canvas id="scale-col" width="120" height="10"></canvas><span id="col-max">1</span></div>
  </div>
  <div class="panel">
    <h2>Prediction</h2>
    <table id="predictions"><tbody></tbody></table>
    <div id="label" class="muted"></div>
  </div>
</div>
<p id="info"></p>
<div class="panel">
  <h2 id="stats-title">Head statistics</h2>
  <table id="stats"><thead></thead><tbody></tbody></table>
  <p class="muted">Distance: mean attention distance in pixels between patch centres (patch rows,
  re-normalised over patches). Entropy in nats. Region columns: share of the row set's attention.
  Click a row to show that head. Each map's colours run from 0 to its own maximum (the number under it).</p>
</div>
"""

SCRIPT = r"""  const P = D.layout.num_prefix_tokens, GH = D.layout.grid[0], GW = D.layout.grid[1];
  const N = P + GH * GW, L = D.num_layers, H = D.num_heads, B = D.images.length;

  const W = decodeHalf(D.weights);   // (B, L, H, N, N)
  const R = decodeHalf(D.rollout);   // (B, N, N)

  const state = { opacity: 0.62, image: 0, layer: L - 1, head: "mean", mode: P > 0 ? "cls" : "patch",
                  token: P + Math.floor(GH / 2) * GW + Math.floor(GW / 2) };

  function att(q, k) {
    const b = state.image;
    if (state.mode === "rollout") return R[(b * N + q) * N + k];
    const base = (b * L + state.layer) * H;
    if (state.head === "mean") {
      let s = 0;
      for (let h = 0; h < H; h++) s += W[((base + h) * N + q) * N + k];
      return s / H;
    }
    return W[((base + state.head) * N + q) * N + k];
  }
  function query() { return state.mode === "cls" ? 0 : state.token; }

  function currentMap() {
    const q = query(), row = [], col = [];
    for (let p = 0; p < GH * GW; p++) { row.push(att(q, P + p)); col.push(att(P + p, q)); }
    const toPrefix = [], fromPrefix = [];
    for (let p = 0; p < P; p++) { toPrefix.push(att(q, p)); fromPrefix.push(att(p, q)); }
    return { image: state.image, layer: state.layer, head: state.head, mode: state.mode, token: q,
             grid: [GH, GW], row: row, col: col, rowPrefix: toPrefix, colPrefix: fromPrefix };
  }

  const SCALE = Math.max(1, Math.floor(300 / Math.max(D.layout.image_size[0], D.layout.image_size[1])));
  const CH = D.layout.image_size[0] * SCALE, CW = D.layout.image_size[1] * SCALE;
  const cellH = CH / GH, cellW = CW / GW;

  function draw(id, values, highlight) {
    const cv = document.getElementById(id), ctx = cv.getContext("2d");
    cv.width = CW; cv.height = CH;
    ctx.imageSmoothingEnabled = false;
    const im = imgs[state.image];
    if (im.complete) ctx.drawImage(im, 0, 0, CW, CH);
    let mx = 0, mn = Infinity;
    for (const v of values) { mx = Math.max(mx, v); mn = Math.min(mn, v); }
    for (let r = 0; r < GH; r++) for (let c = 0; c < GW; c++) {
      // 0 .. max, not min .. max: a nearly uniform map should look nearly uniform
      const [cr, cg, cb] = color(mx > 0 ? values[r * GW + c] / mx : 0);
      ctx.fillStyle = "rgba(" + cr + "," + cg + "," + cb + "," + state.opacity + ")";
      ctx.fillRect(c * cellW, r * cellH, cellW, cellH);
    }
    if (highlight !== null) {
      const r = Math.floor(highlight / GW), c = highlight % GW;
      ctx.strokeStyle = "#00e5ff"; ctx.lineWidth = 2;
      ctx.strokeRect(c * cellW + 1, r * cellH + 1, cellW - 2, cellH - 2);
    }
    cv.dataset.values = JSON.stringify(values.map(v => +v.toPrecision(6)));
    cv.dataset.max = String(mx);
    cv.dataset.min = String(mn);
    const which = id === "map-row" ? "row" : "col";
    document.getElementById(which + "-min").textContent = "0";
    document.getElementById(which + "-max").title = "smallest value shown: " + mn.toPrecision(3);
    document.getElementById(which + "-max").textContent = mx.toPrecision(3);
  }
  function drawScale(id) {
    const cv = document.getElementById(id), ctx = cv.getContext("2d");
    for (let x = 0; x < cv.width; x++) { const [r, g, b] = color(x / (cv.width - 1)); ctx.fillStyle = "rgb(" + r + "," + g + "," + b + ")"; ctx.fillRect(x, 0, 1, cv.height); }
  }

  function tokenName(t) {
    if (t < P) return P === 1 ? "CLS" : "prefix token " + t;
    const p = t - P;
    return "patch (row " + Math.floor(p / GW) + ", col " + (p % GW) + ")";
  }
  const pct = v => (100 * v).toFixed(1) + "%";

  function render() {
    const m = currentMap(), q = m.token;
    const hl = q >= P ? q - P : null;
    draw("map-row", m.row, hl);
    draw("map-col", m.col, hl);
    const src = state.mode === "rollout" ? "rollout through all layers"
      : "layer " + state.layer + ", " + (state.head === "mean" ? "mean of heads" : "head " + state.head);
    document.getElementById("title-row").textContent = "Where " + tokenName(q) + " looks";
    document.getElementById("title-col").textContent = "What looks at " + tokenName(q);
    const pre = m.rowPrefix.reduce((a, b) => a + b, 0), preIn = m.colPrefix.reduce((a, b) => a + b, 0);
    document.getElementById("info").textContent = src + ". " + tokenName(q) + " gives " + pct(pre)
      + " of its attention to prefix tokens" + (P ? " (not drawn); prefix tokens give it " + pct(preIn) + "." : ".")
      + (state.mode === "cls" ? " Hover a patch to see its own row and column." : "");
    for (const b of document.querySelectorAll("#modes button")) b.classList.toggle("active", b.dataset.mode === state.mode);
    document.getElementById("layer").disabled = state.mode === "rollout";
    document.getElementById("head").disabled = state.mode === "rollout";
    renderPrediction();
    renderStats();
    document.body.dataset.state = JSON.stringify({ image: state.image, layer: state.layer, head: state.head, mode: state.mode, token: q });
  }

  function renderPrediction() {
    const im = D.images[state.image], tb = document.querySelector("#predictions tbody");
    tb.innerHTML = "";
    for (const [name, p] of im.top) {
      const tr = document.createElement("tr");
      tr.innerHTML = "<td></td><td>" + pct(p) + "</td><td><span class='bar' style='width:" + Math.max(1, Math.round(120 * p)) + "px'></span></td>";
      tr.firstChild.textContent = name;
      tb.appendChild(tr);
    }
    document.getElementById("label").textContent = im.label !== null && im.label !== undefined ? "true label: " + im.label : "";
  }

  function renderStats() {
    const S = D.stats, I = D.importance, l = state.layer;
    const cols = [["head", null], ["distance (px)", h => S.distance[l][h].toFixed(2)], ["entropy", h => S.entropy[l][h].toFixed(3)]];
    if (P) { cols.push(["CLS→CLS", h => pct(S.regions.cls_cls[l][h])]); cols.push(["CLS→patches", h => pct(S.regions.cls_patch[l][h])]); cols.push(["patches→CLS", h => pct(S.regions.patch_cls[l][h])]); }
    cols.push(["patches→patches", h => pct(S.regions.patch_patch[l][h])]);
    if (I && I.ablation) { cols.push(["Δloss removed", h => I.ablation.delta_loss[l][h].toFixed(4)]); cols.push(["Δacc removed (pts)", h => (100 * I.ablation.delta_accuracy[l][h]).toFixed(1)]); }
    if (I && I.gradient) cols.push(["|∂loss/∂head|", h => I.gradient.score[l][h].toPrecision(3)]);
    document.getElementById("stats-title").textContent = "Head statistics, layer " + l + " (" + D.names[l] + ")";
    const thead = document.querySelector("#stats thead"), tbody = document.querySelector("#stats tbody");
    thead.innerHTML = "<tr>" + cols.map(c => "<th>" + c[0] + "</th>").join("") + "</tr>";
    tbody.innerHTML = "";
    for (let h = 0; h < H; h++) {
      const tr = document.createElement("tr");
      tr.dataset.head = h;
      if (state.head === h) tr.className = "selected";
      tr.innerHTML = cols.map(c => "<td>" + (c[1] ? c[1](h) : h) + "</td>").join("");
      tr.addEventListener("click", () => { setState({ head: h, mode: state.mode === "rollout" ? "patch" : state.mode }); });
      tbody.appendChild(tr);
    }
  }

  function setState(change) {
    Object.assign(state, change);
    document.getElementById("image").value = String(state.image);
    document.getElementById("layer").value = String(state.layer);
    document.getElementById("head").value = String(state.head);
    render();
  }

  fill("image", D.images.map((im, i) => [i, "image " + i + (im.name ? " — " + im.name : "")]));
  fill("layer", D.names.map((n, i) => [i, i + " (" + n + ")"]));
  fill("head", [["mean", "mean of heads"]].concat(Array.from({ length: H }, (_, h) => [h, "head " + h])));
  document.getElementById("opacity").addEventListener("input", e => setState({ opacity: +e.target.value / 100 }));
  document.getElementById("image").addEventListener("change", e => setState({ image: +e.target.value }));
  document.getElementById("layer").addEventListener("change", e => setState({ layer: +e.target.value }));
  document.getElementById("head").addEventListener("change", e => setState({ head: e.target.value === "mean" ? "mean" : +e.target.value }));
  for (const b of document.querySelectorAll("#modes button")) {
    b.addEventListener("click", () => {
      const mode = b.dataset.mode;
      setState({ mode: mode, token: mode === "rollout" && P ? 0 : state.token < P ? P : state.token });
    });
  }
  if (!P) document.getElementById("mode-cls").disabled = true;
  for (const id of ["map-row", "map-col"]) {
    document.getElementById(id).addEventListener("mousemove", e => {
      const rect = e.target.getBoundingClientRect();
      const c = Math.min(GW - 1, Math.floor((e.clientX - rect.left) / rect.width * GW));
      const r = Math.min(GH - 1, Math.floor((e.clientY - rect.top) / rect.height * GH));
      const token = P + r * GW + c;
      if (token !== state.token || state.mode === "cls") setState({ token: token, mode: state.mode === "cls" ? "patch" : state.mode });
    });
  }
  drawScale("scale-row"); drawScale("scale-col");
  whenImagesDecoded(render);
  setState({});
  window.vitscope = { data: D, state: state, currentMap: currentMap, setState: setState, ready: true };
"""
