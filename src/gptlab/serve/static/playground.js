"use strict";
// The playground's script, inlined into the page by gptlab/serve/page.py (the page fetches nothing but
// the server's own API). It is built from parts any mode of the page can reuse: a streamed request
// (postEvents), a transcript of shaded tokens (Transcript), and the details of the token a reader clicks
// (select: its alternatives and where the model was looking). The two modes at the end wire them up:
// completion to the prompt box, chat to a conversation; a token, whatever mode made it, is
// {label, bytes, p, top: [[label, p], ...]}.

const INFO = JSON.parse(document.getElementById("info").textContent);
const $ = (id) => document.getElementById(id);

// Text and bytes. A byte tokenizer cuts "é" into two tokens, which the API writes as bytes:\xc3 and
// bytes:\xa9: the page shows such pieces joined, as the character they make.

function visible(text) {  // whitespace made visible, as gptlab's inspection labels show it
  return text.replace(/ /g, "\u2423").replace(/\n/g, "\\n").replace(/\t/g, "\\t") || "\u2205";
}

function pieceBytes(label) {  // a token's bytes: OpenAI writes a piece of a character as bytes:\xNN
  if (!label.startsWith("bytes:")) return Array.from(new TextEncoder().encode(label));
  return label.slice(6).split("\\x").filter((h) => h).map((h) => parseInt(h, 16));
}

function decode(bytes) {
  return new TextDecoder().decode(new Uint8Array(bytes));
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
  for (const g of groups) g.text = decode(g.bytes);
  return groups;
}

// Talking to the server.

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key");
  if (key && key.value) h["Authorization"] = "Bearer " + key.value;
  return h;
}

async function postEvents(path, body, onChunk) {  // a streamed request: each event's object to onChunk
  const res = await fetch(path, {method: "POST", headers: headers(), body: JSON.stringify(body)});
  if (!res.ok) return (await res.json()).error.message;
  const reader = res.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return null;  // null: no failure
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const chunk = JSON.parse(line.slice(6));
      if (chunk.error) return chunk.error.message;
      onChunk(chunk);
    }
  }
}

// A transcript: the tokens of one generation, shown in a box as spans shaded by their probability.

function shade(p) {  // the less likely, the stronger the orange
  return "rgba(240, 120, 20, " + (0.85 * (1 - p)).toFixed(3) + ")";
}

class Transcript {
  // prefix: the text before the first token, that the model read; in chat, messages: the conversation
  // the server renders with its template before that text
  constructor(box, prefix, messages = null) {
    this.box = box;
    this.prefix = prefix;
    this.messages = messages;
    this.tokens = [];
  }

  add(token) {
    this.tokens.push(token);
    this.show(false);
  }

  show(final) {  // the spans of whole characters; a piece waits for the rest of its character
    const groups = joined(this.tokens), shown = this.box.querySelectorAll(".tok").length;
    if (!groups.length) return;
    const last = groups[groups.length - 1];
    const ready = final || utf8State(last.bytes) !== "partial" ? groups.length : groups.length - 1;
    for (const g of groups.slice(shown, ready)) this.box.appendChild(this.span(g));
  }

  span(g) {
    const p = g.pieces.reduce((product, piece) => product * piece.p, 1);
    const span = document.createElement("span");
    span.className = "tok";
    span.textContent = g.text;
    span.dataset.i = g.first;
    span.dataset.pieces = g.pieces.length;
    span.dataset.prob = p.toFixed(4);
    span.title = "p = " + (100 * p).toFixed(1) + "%" + (g.pieces.length > 1 ? " (" + g.pieces.length +
                 " tokens)" : "");
    span.style.background = shade(p);
    span.addEventListener("click", () => select(this, g.first));
    return span;
  }

  trimTo(text) {  // a stop string is never shown: cut the token spans to the generation's text
    let shown = 0;
    for (const span of Array.from(this.box.querySelectorAll(".tok"))) {
      const room = text.length - shown;
      if (room <= 0) { span.remove(); continue; }
      if (span.textContent.length > room) span.textContent = span.textContent.slice(0, room);
      shown += span.textContent.length;
    }
  }

  contextBefore(i) {  // the text whose last token chose token i (i starts a whole character)
    return this.prefix + decode(this.tokens.slice(0, i).flatMap((t) => t.bytes));
  }
}

// The details of the clicked token: its alternatives, and where the model looked when it chose it.

let selection = null;  // {transcript, i}

function select(transcript, i) {
  selection = {transcript, i};
  for (const span of document.querySelectorAll(".tok")) {
    span.classList.toggle("selected", transcript.box.contains(span) && Number(span.dataset.i) === i);
  }
  showAlternatives(transcript.tokens[i]);
  showAttention();
}

function clearDetails() {
  selection = null;
  $("alternatives").textContent = "";
  $("attention").textContent = "";
}

function showAlternatives(token) {
  const list = $("alternatives");
  list.textContent = "";
  for (const [t, p] of token.top) {
    const li = document.createElement("li");
    li.textContent = visible(t) + "  " + (100 * p).toFixed(1) + "%";
    if (t === token.label) li.className = "chosen";
    list.appendChild(li);
  }
}

async function showAttention() {
  if (!selection) return;
  const asked = selection, layer = Number($("layer").value), head = Number($("head").value);
  const body = {text: asked.transcript.contextBefore(asked.i), layer, head};
  if (asked.transcript.messages) body.messages = asked.transcript.messages;
  const res = await fetch("/v1/attention", {method: "POST", headers: headers(), body: JSON.stringify(body)});
  const reply = await res.json();
  if (asked !== selection || layer !== Number($("layer").value) || head !== Number($("head").value)) return;
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
  $("focus").textContent = "Choosing " + visible(asked.transcript.tokens[asked.i].label) +
    ", the last token (outlined) attends over " +
    (reply.dropped ? "the last " + reply.tokens.length + " tokens" : "the text") +
    " in layer " + layer + ", head " + head + ":";
}

// What both modes send: the sampling controls.

function samplingFields() {
  const body = {max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value),
                top_p: Number($("top-p").value), stream: true};
  if ($("top-k").value !== "") body.top_k = Number($("top-k").value);
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("stop").value !== "") body.stop = [$("stop").value.replace(/\\n/g, "\n").replace(/\\t/g, "\t")];
  return body;
}

async function run(path, body, transcript, readChunk, box) {  // a streamed generation into a transcript
  box.dataset.state = "streaming";
  $("status").textContent = "generating\u2026";
  $("generate").disabled = true;
  const got = {text: "", finish: null, usage: null};
  let failure = null;
  try {
    failure = await postEvents(path, body, (chunk) => {
      for (const choice of chunk.choices) {
        readChunk(choice, got);
        if (choice.finish_reason) got.finish = choice.finish_reason;
      }
      if (chunk.usage) got.usage = chunk.usage;
    });
    if (!failure) {
      transcript.show(true);
      transcript.trimTo(got.text);
    }
  } catch (err) {
    failure = String(err);
  } finally {
    $("generate").disabled = false;
    box.dataset.state = failure ? "error" : "done";
    $("status").textContent = failure ? "error: " + failure :
      (got.usage ? got.usage.completion_tokens : transcript.tokens.length) + " tokens, finish_reason " +
      got.finish;
  }
  return failure ? null : got.text;
}

// The completion mode: the prompt box, streamed through /v1/completions with the five likeliest tokens.

function completionToken(logprobs) {  // a token from a /v1/completions chunk's logprobs
  const label = logprobs.tokens[0];
  const top = Object.entries(logprobs.top_logprobs[0]).map(([t, lp]) => [t, Math.exp(lp)]);
  return {label, bytes: pieceBytes(label), p: Math.exp(logprobs.token_logprobs[0]), top};
}

async function complete() {
  const body = {...samplingFields(), prompt: $("prompt").value, logprobs: 5}, output = $("output");
  clearDetails();
  output.textContent = "";
  const promptSpan = document.createElement("span");
  promptSpan.className = "prompt";
  promptSpan.textContent = body.prompt;
  output.appendChild(promptSpan);
  const transcript = new Transcript(output, body.prompt);
  await run("/v1/completions", body, transcript, (choice, got) => {
    got.text += choice.text;
    if (choice.logprobs) transcript.add(completionToken(choice.logprobs));
  }, output);
}

// The chat mode: a conversation, each reply streamed through /v1/chat/completions and shown as a
// transcript of its own; the server renders the conversation with the model's chat template.

let conversation = [];  // the user and assistant messages so far (the system message is read each time)

function chatToken(entry) {  // a token from a /v1/chat/completions chunk's logprobs.content
  const top = entry.top_logprobs.map((t) => [t.token, Math.exp(t.logprob)]);
  return {label: entry.token, bytes: entry.bytes, p: Math.exp(entry.logprob), top};
}

function turn(role, text) {
  const div = document.createElement("div");
  div.className = "turn " + role;
  div.dataset.role = role;
  div.textContent = text;
  $("chat-log").appendChild(div);
  return div;
}

async function send() {
  const message = {role: "user", content: $("message").value};
  const system = $("system").value ? [{role: "system", content: $("system").value}] : [];
  const messages = [...system, ...conversation, message];
  const body = {...samplingFields(), messages, logprobs: true, top_logprobs: 5};
  clearDetails();
  turn("user", message.content);
  const reply = turn("assistant", "");
  const transcript = new Transcript(reply, "", messages);
  const text = await run("/v1/chat/completions", body, transcript, (choice, got) => {
    if (choice.delta.content) got.text += choice.delta.content;
    for (const entry of (choice.logprobs && choice.logprobs.content) || []) transcript.add(chatToken(entry));
  }, $("chat-log"));
  if (text === null) return;  // the status line says why; the conversation stays as it was
  conversation.push(message, {role: "assistant", content: text});
  $("message").value = "";
}

function resetChat() {
  conversation = [];
  clearDetails();
  $("chat-log").textContent = "";
  $("chat-log").dataset.state = "empty";
  $("status").textContent = "";
}

function mode() {
  return $("mode-chat").checked ? "chat" : "completion";
}

function showMode() {
  const chat = mode() === "chat";
  $("completion-panel").hidden = chat;
  $("output").hidden = chat;
  $("chat-panel").hidden = !chat;
  $("reset").hidden = !chat;
  $("generate").textContent = chat ? "Send" : "Generate";
  clearDetails();
}

for (const [id, count] of [["layer", INFO.n_layer], ["head", INFO.n_head]]) {
  for (let i = 0; i < count; i++) $(id).add(new Option(String(i), String(i)));
  $(id).addEventListener("change", showAttention);
}
$("max-tokens").max = INFO.max_tokens;
$("mode-chat").disabled = $("chat-note").textContent !== "";  // the server says why chat is off
for (const id of ["mode-completion", "mode-chat"]) $(id).addEventListener("change", showMode);
$("generate").addEventListener("click", () => (mode() === "chat" ? send() : complete()));
$("reset").addEventListener("click", resetChat);
for (const [id, action] of [["prompt", complete], ["message", send]]) {
  $(id).addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) action();
  });
}
