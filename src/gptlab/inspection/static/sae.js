"use strict";
const data = JSON.parse(document.getElementById("data").textContent);
const byId = (id) => document.getElementById(id);
const body = byId("features").tBodies[0];
let selected = null;

// White for no activation to deep orange for the feature's largest.
function colour(share) {
  const s = Math.max(0, Math.min(1, share));
  return `rgb(255, ${Math.round(255 - 140 * s)}, ${Math.round(255 - 230 * s)})`;
}

function percent(share) {
  return share >= 0.001 || share === 0 ? `${(100 * share).toFixed(1)}%` : `${(100 * share).toPrecision(1)}%`;
}

function list() {
  const order = byId("order").value;
  const rows = data.features.slice();
  if (order !== "id") rows.sort((a, b) => b[order] - a[order] || a.id - b.id);
  body.replaceChildren();
  rows.forEach((feature) => {
    const row = body.insertRow();
    row.dataset.id = String(feature.id);
    if (feature.frequency === 0) row.className = "dead";
    [String(feature.id), percent(feature.frequency), feature.max.toFixed(2)].forEach((text) => {
      row.insertCell().textContent = text;
    });
    row.addEventListener("click", () => show(feature.id));
  });
  if (selected !== null) mark();
}

function mark() {
  Array.from(body.rows).forEach((row) => row.classList.toggle("selected", Number(row.dataset.id) === selected));
}

function show(id) {
  const feature = data.features[id];
  if (!feature) return;
  selected = id;
  mark();
  byId("feature").textContent = `feature ${id}`;
  byId("stats").textContent = feature.frequency === 0
    ? "never active on these tokens (a dead feature)"
    : `active on ${percent(feature.frequency)} of ${data.tokens.toLocaleString()} held-out tokens; ` +
      `largest activation ${feature.max.toFixed(3)}`;
  const raises = byId("promotes");
  raises.replaceChildren("raises: ");
  feature.promotes.forEach(([label, value]) => {
    const code = document.createElement("code");
    code.textContent = `${label} ${value >= 0 ? "+" : ""}${value.toFixed(2)}`;
    raises.appendChild(code);
  });
  const contexts = byId("contexts");
  contexts.replaceChildren();
  feature.contexts.forEach((context) => {
    const line = document.createElement("div");
    context.ids.forEach((token, i) => {
      const span = document.createElement("span");
      span.textContent = data.labels[String(token)];
      span.style.background = colour(context.acts[i] / (feature.max || 1));
      span.title = `activation ${context.acts[i]}`;
      if (i === context.at) span.className = "peak";
      line.appendChild(span);
    });
    contexts.appendChild(line);
  });
}

byId("title").textContent = data.title;
byId("summary").textContent = `${data.features.length} features at ${data.site}, ${data.k} active per token; ` +
  `measured on ${data.tokens.toLocaleString()} held-out tokens.`;
byId("order").addEventListener("change", list);
byId("search").addEventListener("change", (event) => show(Number(event.target.value)));
list();
show(Number(body.rows[0].dataset.id));
