"""The HTML page of `gptlab attention FILE.html`: one file with its style, script and data inline.

Nothing is fetched (no CDN, no fonts, no network), so the page works offline and from an e-mail.
`attention_view.save_attention_html` fills __TITLE__ (escaped text) and __DATA__ (JSON with every "<"
escaped): the prompt, token labels, the layers and heads shown, their weights (L', H', T, T) and the
top next-token predictions at each position. The element ids (layer, head, map, tokens, focus,
predictions) are what the browser test drives.
"""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
  .controls { margin-bottom: 1em; }
  .controls select { font-size: 14px; margin-right: 1em; }
  #tokens { font-family: monospace; font-size: 16px; line-height: 2; margin-bottom: 1em; }
  #tokens span { padding: 2px 3px; margin-right: 1px; border: 1px solid #ccc; border-radius: 3px;
                 cursor: default; white-space: pre; }
  #tokens span.focused { outline: 2px solid #d33; }
  .layout { display: flex; gap: 2em; align-items: flex-start; }
  #map { border-collapse: collapse; font-family: monospace; font-size: 10px; }
  #map td { width: 12px; height: 12px; padding: 0; border: 1px solid #f4f4f4; }
  #map th { font-weight: normal; padding: 0 3px; white-space: pre; }
  #map thead th { writing-mode: vertical-rl; transform: rotate(180deg); text-align: left; }
  #map tbody th { text-align: right; }
  #map tr.focused th { color: #d33; font-weight: bold; }
  #predictions li { font-family: monospace; white-space: pre; }
  .note { color: #666; max-width: 40em; }
</style>
</head>
<body>
<h2 id="title"></h2>
<div class="controls">
  <label>layer <select id="layer"></select></label>
  <label>head <select id="head"></select></label>
  <span id="caption"></span>
</div>
<div id="tokens"></div>
<div class="layout">
  <table id="map"></table>
  <div>
    <div id="focus"></div>
    <p>the model's next token after this position:</p>
    <ol id="predictions"></ol>
    <p class="note">Hover a token (above, or a row of the map) to see where it attends: the darker a
    token, the more weight this head gives it. Rows are queries, columns keys. A large weight shows
    routing, not yet a cause of the prediction (handout &sect;2.2): test that with
    <code>gptlab ablate</code> and <code>gptlab intervene</code>.</p>
  </div>
</div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("data").textContent);
const T = data.labels.length;
const byId = (id) => document.getElementById(id);
const layerSelect = byId("layer"), headSelect = byId("head"), map = byId("map"), strip = byId("tokens");
let focused = T - 1;

// White for weight 0 to dark blue for weight 1.
function colour(w) {
  const r = Math.round(255 - 230 * w), g = Math.round(255 - 180 * w), b = Math.round(255 - 90 * w);
  return `rgb(${r}, ${g}, ${b})`;
}

function fillSelect(select, values, word) {
  values.forEach((value, i) => select.add(new Option(`${word} ${value}`, String(i))));
}

function header(text, className) {
  const th = document.createElement("th");
  th.textContent = text;
  th.className = className;
  return th;
}

function build() {
  byId("title").textContent = "attention for " + JSON.stringify(data.prompt);
  fillSelect(layerSelect, data.layers, "layer");
  fillSelect(headSelect, data.heads, "head");
  const top = map.createTHead().insertRow();
  top.appendChild(header("", "corner"));
  data.labels.forEach((label) => top.appendChild(header(label, "key")));
  const body = map.createTBody();
  data.labels.forEach((label, i) => {
    const row = body.insertRow();
    row.dataset.pos = String(i);
    row.appendChild(header(label, "query"));
    for (let j = 0; j < T; j++) row.insertCell();
  });
  data.labels.forEach((label, i) => {
    const span = document.createElement("span");
    span.textContent = label;
    span.dataset.pos = String(i);
    strip.appendChild(span);
  });
}

function current() {
  return data.weights[Number(layerSelect.value)][Number(headSelect.value)];
}

function draw() {
  const weights = current();
  const layer = data.layers[Number(layerSelect.value)], head = data.heads[Number(headSelect.value)];
  map.dataset.layer = String(layer);
  map.dataset.head = String(head);
  byId("caption").textContent = `layer ${layer}, head ${head}: rows are queries, columns keys`;
  Array.from(map.tBodies[0].rows).forEach((row, i) => {
    Array.from(row.cells).slice(1).forEach((cell, j) => {
      const w = weights[i][j];
      cell.style.background = colour(w);
      cell.dataset.weight = String(w);
      cell.title = `${data.labels[i]} \\u2192 ${data.labels[j]}: ${w.toFixed(4)}`;
    });
  });
  focus(focused);
}

function focus(i) {
  focused = i;
  const row = current()[i];
  Array.from(strip.children).forEach((span, j) => {
    span.style.background = colour(row[j]);
    span.title = `weight ${row[j].toFixed(4)}`;
    span.classList.toggle("focused", j === i);
  });
  Array.from(map.tBodies[0].rows).forEach((tr, j) => tr.classList.toggle("focused", j === i));
  const strongest = row.indexOf(Math.max(...row));
  byId("focus").textContent = `position ${i} (${data.labels[i]}) attends most to position ` +
    `${strongest} (${data.labels[strongest]}), weight ${row[strongest].toFixed(3)}`;
  const list = byId("predictions");
  list.replaceChildren(...data.predictions[i].map(([label, p]) => {
    const item = document.createElement("li");
    item.textContent = `${label}  ${(100 * p).toFixed(1)}%`;
    return item;
  }));
}

function hovered(event) {
  const holder = event.target.closest("[data-pos]");
  if (holder) focus(Number(holder.dataset.pos));
}

build();
layerSelect.addEventListener("change", draw);
headSelect.addEventListener("change", draw);
strip.addEventListener("mouseover", hovered);
map.addEventListener("mouseover", hovered);
draw();
</script>
</body>
</html>
"""
