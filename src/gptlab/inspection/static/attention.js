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
      cell.title = `${data.labels[i]} \u2192 ${data.labels[j]}: ${w.toFixed(4)}`;
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
