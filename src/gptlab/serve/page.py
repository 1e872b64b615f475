"""The playground page served at `/`: one self-contained HTML file (inline style and script, no fetches
but the server's own API), filled with the model's shape when it is served.

It streams `/v1/completions` (stream=true, logprobs=5) with fetch and a ReadableStream, shades every
token by its probability under the model (the less likely, the stronger the orange), and on a click
lists the five likeliest tokens at that position and asks `/v1/attention` where the query that chose
the token attends, in the layer and head picked, shading the text by the weights.

Tokens that are pieces of one character (a byte tokenizer's "é" is two tokens, which the API writes as
`bytes:\\xc3` and `bytes:\\xa9`) are shown joined, as the character: its shade is the product of the
pieces' probabilities (the probability of the whole character), its attention weight their sum.
"""

from __future__ import annotations

import html
import json
import re

from gptlab.config import ModelConfig


def playground(config: ModelConfig, name: str, max_tokens: int, needs_key: bool) -> str:
    """The page for a model of this shape; `needs_key` adds an API-key field."""
    info = {"name": name, "n_layer": config.n_layer, "n_head": config.n_head,
            "block_size": config.block_size, "max_tokens": max_tokens}
    key_field = ('<label>API key <input id="api-key" type="password" autocomplete="off"></label>'
                 if needs_key else "")
    inline = json.dumps(info).replace("<", "\\u003c")  # no "</script>" can end the block early
    parts = {"NAME": html.escape(name), "KEY": key_field, "INFO": inline}
    return re.sub("__(NAME|KEY|INFO)__", lambda m: parts[m.group(1)], PAGE)  # one pass: none is rescanned


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>gptlab playground: __NAME__</title>
<style>
  body { font: 15px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 70em; padding: 0 1em;
         color: #222; }
  h1 { font-size: 1.3em; margin: 0 0 .6em; }
  h1 small { font-weight: normal; color: #666; }
  textarea { width: 100%; box-sizing: border-box; font: 14px/1.4 ui-monospace, monospace; }
  .controls { display: flex; flex-wrap: wrap; gap: .5em 1.2em; align-items: center; margin: .6em 0; }
  .controls input[type=number] { width: 5.5em; }
  .controls input#stop { width: 7em; }
  button { font-size: 1em; padding: .3em 1.2em; }
  #output { white-space: pre-wrap; font: 15px/1.7 ui-monospace, monospace; border: 1px solid #ccc;
            border-radius: 4px; padding: .6em; min-height: 6em; }
  #output .prompt { color: #777; }
  #output .tok { cursor: pointer; border-radius: 2px; }
  #output .tok.selected { outline: 2px solid #1a5fb4; }
  #status { color: #555; margin: .4em 0; min-height: 1.4em; }
  .details { display: grid; grid-template-columns: 16em 1fr; gap: 1.5em; margin-top: 1em; }
  #alternatives { font-family: ui-monospace, monospace; padding-left: 1.6em; margin: .3em 0; }
  #alternatives li.chosen { font-weight: bold; }
  #attention { white-space: pre-wrap; font: 14px/1.8 ui-monospace, monospace; border: 1px solid #ddd;
               padding: .5em; min-height: 3em; }
  #attention .query { outline: 2px solid #1a5fb4; }
  .legend { color: #666; font-size: .9em; }
</style>
</head>
<body>
<h1>gptlab playground <small>__NAME__</small></h1>
<textarea id="prompt" rows="4" placeholder="Type a prompt">ROMEO:</textarea>
<div class="controls">
  <label>max tokens <input id="max-tokens" type="number" min="0" value="120"></label>
  <label>temperature <input id="temperature" type="number" min="0" step="0.1" value="0.8"></label>
  <label>top-p <input id="top-p" type="number" min="0.01" max="1" step="0.05" value="1"></label>
  <label>top-k <input id="top-k" type="number" min="1" placeholder="all"></label>
  <label>seed <input id="seed" type="number" min="0" placeholder="random"></label>
  <label>stop <input id="stop" type="text" placeholder="e.g. \\n\\n"></label>
  __KEY__
  <button id="generate">Generate</button>
</div>
<div id="status"></div>
<div id="output" data-state="empty"></div>
<p class="legend">Each token is shaded by the probability the model gave it: the less likely, the stronger the
  orange. Click a token for the alternatives and for where the model was looking when it chose it.</p>
<div class="details">
  <div>
    <strong>Five likeliest tokens</strong>
    <ol id="alternatives"></ol>
  </div>
  <div>
    <strong>Attention</strong> layer <select id="layer"></select> head <select id="head"></select>
    <div id="focus" class="legend">Click a generated token.</div>
    <div id="attention"></div>
  </div>
</div>
<script type="application/json" id="info">__INFO__</script>
<script>
"use strict";
const INFO = JSON.parse(document.getElementById("info").textContent);
const $ = (id) => document.getElementById(id);
let prompt = "", tokens = [], selected = -1, group = null;

for (const [id, count] of [["layer", INFO.n_layer], ["head", INFO.n_head]]) {
  for (let i = 0; i < count; i++) $(id).add(new Option(String(i), String(i)));
  $(id).addEventListener("change", showAttention);
}
$("max-tokens").max = INFO.max_tokens;

function visible(text) {  // whitespace made visible, as gptlab's inspection labels show it
  return text.replace(/ /g, "\\u2423").replace(/\\n/g, "\\\\n").replace(/\\t/g, "\\\\t") || "\\u2205";
}

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key");
  if (key && key.value) h["Authorization"] = "Bearer " + key.value;
  return h;
}

function request() {
  const body = {prompt: $("prompt").value, max_tokens: Number($("max-tokens").value),
                temperature: Number($("temperature").value), top_p: Number($("top-p").value),
                logprobs: 5, stream: true};
  if ($("top-k").value !== "") body.top_k = Number($("top-k").value);
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("stop").value !== "") body.stop = [$("stop").value.replace(/\\\\n/g, "\\n").replace(/\\\\t/g, "\\t")];
  return body;
}

function pieceBytes(label) {  // a token's bytes: OpenAI writes a piece of a character as bytes:\\xNN
  if (!label.startsWith("bytes:")) return Array.from(new TextEncoder().encode(label));
  return label.slice(6).split("\\\\x").filter((h) => h).map((h) => parseInt(h, 16));
}

function utf8State(bytes) {  // "whole" characters, a "partial" one still to come, or "invalid" bytes
  const strict = new TextDecoder("utf-8", {fatal: true}), data = new Uint8Array(bytes);
  try { strict.decode(data); return "whole"; } catch (err) { /* not whole: partial or invalid */ }
  try { new TextDecoder("utf-8", {fatal: true}).decode(data, {stream: true}); return "partial"; }
  catch (err) { return "invalid"; }
}

function joined(pieces) {  // [{bytes, ...}] -> groups of consecutive pieces that make whole characters
  const groups = [];
  let open = null;
  pieces.forEach((piece, i) => {
    open = open || {first: i, bytes: [], pieces: []};
    open.bytes.push(...piece.bytes);
    open.pieces.push(piece);
    if (utf8State(open.bytes) !== "partial" || open.bytes.length >= 4) { groups.push(open); open = null; }
  });
  if (open) groups.push(open);
  for (const g of groups) g.text = new TextDecoder().decode(new Uint8Array(g.bytes));
  return groups;
}

function addToken(logprobs) {
  const label = logprobs.tokens[0], p = Math.exp(logprobs.token_logprobs[0]);
  const top = Object.entries(logprobs.top_logprobs[0]).map(([t, lp]) => [t, Math.exp(lp)]);
  tokens.push({label, bytes: pieceBytes(label), p, top});
  showTokens(false);
}

function showTokens(final) {  // the spans of whole characters; a piece waits for the rest of its character
  const groups = joined(tokens), shown = $("output").querySelectorAll(".tok").length;
  const last = groups[groups.length - 1];
  const ready = final || utf8State(last.bytes) !== "partial" ? groups.length : groups.length - 1;
  for (const g of groups.slice(shown, ready)) {
    const p = g.pieces.reduce((product, piece) => product * piece.p, 1);
    const span = document.createElement("span");
    span.className = "tok";
    span.textContent = g.text;
    span.dataset.i = g.first;
    span.dataset.pieces = g.pieces.length;
    span.dataset.prob = p.toFixed(4);
    span.title = "p = " + (100 * p).toFixed(1) + "%" + (g.pieces.length > 1 ? " (" + g.pieces.length +
                 " tokens)" : "");
    span.style.background = "rgba(240, 120, 20, " + (0.85 * (1 - p)).toFixed(3) + ")";
    span.addEventListener("click", () => select(g.first));
    $("output").appendChild(span);
  }
}

function trimTo(text) {  // a stop string is never shown: cut the token spans to the completion's text
  let shown = 0;
  for (const span of Array.from($("output").querySelectorAll(".tok"))) {
    const room = text.length - shown;
    if (room <= 0) { span.remove(); continue; }
    if (span.textContent.length > room) span.textContent = span.textContent.slice(0, room);
    shown += span.textContent.length;
  }
}

async function generate() {
  const body = request();
  prompt = body.prompt; tokens = []; selected = -1;
  $("output").textContent = ""; $("alternatives").textContent = ""; $("attention").textContent = "";
  $("output").dataset.state = "streaming";
  const promptSpan = document.createElement("span");
  promptSpan.className = "prompt";
  promptSpan.textContent = prompt;
  $("output").appendChild(promptSpan);
  $("status").textContent = "generating\\u2026";
  $("generate").disabled = true;
  let text = "", finish = null, usage = null, failure = null;
  try {
    const res = await fetch("/v1/completions",
                            {method: "POST", headers: headers(), body: JSON.stringify(body)});
    if (!res.ok) {
      failure = (await res.json()).error.message;
      return;
    }
    const reader = res.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\\n\\n")) >= 0) {
        const line = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) { failure = chunk.error.message; return; }
        for (const choice of chunk.choices) {
          text += choice.text;
          if (choice.logprobs) addToken(choice.logprobs);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        if (chunk.usage) usage = chunk.usage;
      }
    }
    if (tokens.length) showTokens(true);
    trimTo(text);
  } catch (err) {
    failure = String(err);
  } finally {
    $("generate").disabled = false;
    $("output").dataset.state = failure ? "error" : "done";
    $("status").textContent = failure ? "error: " + failure :
      (usage ? usage.completion_tokens : tokens.length) + " tokens, finish_reason " + finish;
  }
}

function select(i) {
  selected = i;
  for (const span of $("output").querySelectorAll(".tok")) {
    span.classList.toggle("selected", Number(span.dataset.i) === i);
  }
  const alternatives = $("alternatives");
  alternatives.textContent = "";
  for (const [t, p] of tokens[i].top) {
    const li = document.createElement("li");
    li.textContent = visible(t) + "  " + (100 * p).toFixed(1) + "%";
    if (t === tokens[i].label) li.className = "chosen";
    alternatives.appendChild(li);
  }
  showAttention();
}

async function showAttention() {
  if (selected < 0) return;
  const i = selected, layer = Number($("layer").value), head = Number($("head").value);
  const before = tokens.slice(0, i).flatMap((t) => t.bytes);  // whole characters: i starts one
  const context = prompt + new TextDecoder().decode(new Uint8Array(before));
  const res = await fetch("/v1/attention", {method: "POST", headers: headers(),
                                            body: JSON.stringify({text: context, layer, head})});
  const reply = await res.json();
  if (i !== selected || layer !== Number($("layer").value) || head !== Number($("head").value)) return;
  const box = $("attention");
  box.textContent = "";
  if (!res.ok) { $("focus").textContent = "error: " + reply.error.message; return; }
  const groups = joined(reply.bytes.map((bytes, j) => ({bytes, weight: reply.weights[j]})));
  groups.forEach((g, j) => {
    const span = document.createElement("span");
    const w = g.pieces.reduce((sum, piece) => sum + piece.weight, 0);
    span.textContent = visible(g.text);
    span.title = "weight " + w.toFixed(4);
    span.dataset.weight = w;
    span.dataset.pieces = g.pieces.length;
    span.style.background = "rgba(30, 95, 200, " + Math.min(1, w).toFixed(3) + ")";
    if (j === groups.length - 1) span.className = "query";
    box.appendChild(span);
  });
  $("focus").textContent = "Choosing " + visible(tokens[i].label) +
    ", the last token (outlined) attends over " +
    (reply.dropped ? "the last " + reply.tokens.length + " tokens" : "the text") +
    " in layer " + layer + ", head " + head + ":";
}

$("generate").addEventListener("click", generate);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) generate();
});
</script>
</body>
</html>
"""
