// pagedllm's web page: a streaming chat over /v1/chat/completions and a live view of the engine
// (GET /stats, polled). Plain JavaScript, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, messages: [], controller: null, rates: [], last: null, images: [] };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    state.model = body.data[0].id;
    $("model-name").textContent = state.model;
  } catch (e) {
    $("model-name").textContent = "no model (" + e + ")";
  }
}

// ---- chat ---------------------------------------------------------------------------------------

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.dataset.role = role;
  const body = document.createElement("div");
  body.className = "content";
  body.textContent = text || "";
  div.appendChild(body);
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function assistantView(div) {
  // reasoning folded above the answer, tool calls as blocks below it, counts and speed last
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  reasoning.innerHTML = "<summary>Reasoning</summary><div class='text'></div>";
  div.prepend(reasoning);
  const tools = document.createElement("div");
  tools.className = "tool-calls";
  div.appendChild(tools);
  const meta = document.createElement("span");
  meta.className = "meta";
  div.appendChild(meta);
  return { reasoning, content: div.querySelector(".content"), tools, meta, toolCalls: [] };
}

function renderToolCalls(view) {
  view.tools.innerHTML = "";
  for (const call of view.toolCalls) {
    const block = document.createElement("div");
    block.className = "tool-call";
    const name = document.createElement("b");
    name.textContent = call.name || "(tool)";
    const args = document.createElement("pre");
    let text = call.arguments;
    try { text = JSON.stringify(JSON.parse(call.arguments), null, 2); } catch (e) { /* still streaming */ }
    args.textContent = text;
    block.append(name, args);
    view.tools.appendChild(block);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !state.messages.some((m) => m.role === "assistant");
}

function requestMessages() {
  const sys = $("system-prompt").value.trim();
  return (sys ? [{ role: "system", content: sys }] : []).concat(state.messages);
}

async function complete() {
  const div = addMessage("assistant", "");
  const view = assistantView(div);
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const body = {
    model: state.model, messages: requestMessages(), stream: true,
    stream_options: { include_usage: true },
    temperature: parseFloat($("temperature").value), top_p: parseFloat($("top-p").value),
    max_tokens: parseInt($("max-tokens").value, 10),
  };
  let content = "", reasoning = "", usage = null, finish = null, first = null, chunks = 0;
  const start = performance.now();
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || ("HTTP " + r.status));
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, nl).trim();
        buffer = buffer.slice(nl + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const d = choice.delta || {};
          if (d.content || d.reasoning_content || d.tool_calls) {
            chunks += 1;
            if (first === null) first = performance.now();
          }
          if (d.reasoning_content) {
            reasoning += d.reasoning_content;
            view.reasoning.hidden = false;
            view.reasoning.querySelector(".text").textContent = reasoning;
          }
          if (d.content) {
            content += d.content;
            view.content.textContent = content;
          }
          for (const tc of d.tool_calls || []) {
            const call = view.toolCalls[tc.index] || (view.toolCalls[tc.index] = { id: tc.id, name: "", arguments: "" });
            if (tc.function && tc.function.name) call.name = tc.function.name;
            if (tc.function && tc.function.arguments) call.arguments += tc.function.arguments;
            renderToolCalls(view);
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        div.scrollIntoView({ block: "end" });
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      finish = "stopped";
    } else {
      const p = document.createElement("p");
      p.className = "error";
      p.textContent = String(e.message || e);
      div.appendChild(p);
      finish = "error";
    }
  } finally {
    state.controller = null;
  }
  const end = performance.now();
  const tokens = usage ? usage.completion_tokens : chunks;
  const decodeSeconds = first !== null && tokens > 1 ? (end - first) / 1000 : null;
  const parts = [];
  if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
  else parts.push(`${tokens} tokens`);
  if (first !== null) parts.push(`TTFT ${((first - start) / 1000).toFixed(2)} s`);
  if (decodeSeconds) parts.push(`${((tokens - 1) / decodeSeconds).toFixed(1)} tokens/s`);
  if (finish) parts.push(finish);
  view.meta.textContent = parts.join(" · ");
  div.dataset.finish = finish || "";
  const message = { role: "assistant", content };
  if (view.toolCalls.length) {
    message.tool_calls = view.toolCalls.map((c, i) => ({
      id: c.id || "call_" + i, type: "function", function: { name: c.name, arguments: c.arguments } }));
  }
  state.messages.push(message);
  setBusy(false);
  div.scrollIntoView({ block: "end" });
}

function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if ((!text && !state.images.length) || state.controller) return;
  $("prompt").value = "";
  const images = state.images.splice(0);
  renderAttachments();
  // images as OpenAI image_url parts (data URLs) before the text; a text-only model answers a 400
  const content = images.length
    ? images.map((url) => ({ type: "image_url", image_url: { url } })).concat([{ type: "text", text }])
    : text;
  state.messages.push({ role: "user", content });
  const div = addMessage("user", text);
  for (const url of images) {
    const img = document.createElement("img");
    img.className = "thumb";
    img.src = url;
    div.prepend(img);
  }
  complete();
}

// ---- images: attached from a file or pasted, sent as data URLs ----------------------------------

function renderAttachments() {
  const box = $("attachments");
  box.innerHTML = "";
  state.images.forEach((url, i) => {
    const img = document.createElement("img");
    img.className = "thumb";
    img.src = url;
    img.title = "click to remove";
    img.addEventListener("click", () => { state.images.splice(i, 1); renderAttachments(); });
    box.appendChild(img);
  });
}

function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => { state.images.push(reader.result); renderAttachments(); };
    reader.readAsDataURL(file);
  }
}

function regenerate() {
  if (state.controller) return;
  const i = state.messages.map((m) => m.role).lastIndexOf("assistant");
  if (i < 0) return;
  state.messages.splice(i, 1);
  const views = $("messages").querySelectorAll(".msg.assistant");
  views[views.length - 1].remove();
  complete();
}

// ---- the engine view ----------------------------------------------------------------------------

const COLORS = { "0": "#e5e7eb", "1": "#2f6fdb", "2": "#f0a431" };

function drawBlocks(states) {
  const canvas = $("block-map");
  const ctx = canvas.getContext("2d");
  const n = states.length;
  const cols = Math.max(1, Math.ceil(Math.sqrt(n * canvas.width / canvas.height)));
  const size = Math.max(1, Math.floor(canvas.width / cols));
  const rows = Math.ceil(n / cols);
  if (canvas.height < rows * size) canvas.height = rows * size;
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const counts = { "0": 0, "1": 0, "2": 0 };
  for (let i = 0; i < n; i++) {
    const s = states[i];
    counts[s] = (counts[s] || 0) + 1;
    ctx.fillStyle = COLORS[s] || "#000";
    ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, Math.max(1, size - 1), Math.max(1, size - 1));
  }
  canvas.dataset.free = counts["0"];
  canvas.dataset.used = counts["1"];
  canvas.dataset.cached = counts["2"];
  canvas.dataset.states = states;
  $("block-counts").textContent = `${n} blocks: ${counts["1"]} in use, ${counts["2"]} cached, ${counts["0"]} free`;
}

function drawRates() {
  const canvas = $("rate-chart");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const pts = state.rates;
  if (pts.length < 2) return;
  const max = Math.max(1, ...pts.map((p) => p.rate));
  const t0 = pts[pts.length - 1].t - 120;
  ctx.strokeStyle = "#2f6fdb";
  ctx.beginPath();
  pts.forEach((p, i) => {
    const x = ((p.t - t0) / 120) * canvas.width;
    const y = canvas.height - (p.rate / max) * (canvas.height - 12) - 2;
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = "#6b7280";
  ctx.fillText(`max ${max.toFixed(0)}`, 4, 10);
}

function showTimings(t) {
  const rows = [["schedule", t.mean_schedule_s], ["prepare", t.mean_prepare_s], ["execute", t.mean_execute_s],
                ["sample", t.mean_sample_s], ["update", t.mean_update_s], ["idle between steps", t.mean_idle_s]];
  $("timings").tBodies[0].innerHTML = rows.map(([k, v]) => `<tr><td>${k}</td><td>${(v * 1000).toFixed(2)}</td></tr>`)
    .join("") + `<tr><td>steps</td><td>${t.steps}</td></tr>`;
}

// a request holds a few blocks of a pool of thousands: rounded to whole percent it read "0%"
function kvPercent(usage) {
  const pct = 100 * usage;
  if (pct === 0) return "0%";
  if (pct < 0.1) return "<0.1%";
  return (pct < 10 ? pct.toFixed(1) : pct.toFixed(0)) + "%";
}

async function poll() {
  try {
    const s = await (await fetch("/stats")).json();
    const now = performance.now() / 1000;
    $("num-running").textContent = s.num_running;
    $("num-waiting").textContent = s.num_waiting;
    $("kv-usage").textContent = kvPercent(s.kv_cache_usage);
    $("kv-usage").title = `${s.num_blocks - s.num_free_blocks} of ${s.num_blocks} KV blocks held`;
    if (state.last) {
      const rate = (s.num_generation_tokens - state.last.tokens) / Math.max(1e-3, now - state.last.t);
      state.rates.push({ t: now, rate: Math.max(0, rate) });
      state.rates = state.rates.filter((p) => p.t >= now - 120);
      $("gen-rate").textContent = rate.toFixed(0);
    }
    state.last = { t: now, tokens: s.num_generation_tokens };
    drawBlocks(s.block_states || "");
    drawRates();
    showTimings(s.step_timings);
    $("engine-error").hidden = true;
  } catch (e) {
    $("engine-error").hidden = false;
    $("engine-error").textContent = "stats unavailable: " + e;
  }
}

// ---- wiring -------------------------------------------------------------------------------------

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) send(e);
});
$("image").addEventListener("change", (e) => { attach(e.target.files); e.target.value = ""; });
$("prompt").addEventListener("paste", (e) => {
  const files = [...(e.clipboardData ? e.clipboardData.files : [])];
  if (files.length) { e.preventDefault(); attach(files); }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("regenerate").addEventListener("click", regenerate);
$("clear").addEventListener("click", () => {
  if (state.controller) return;
  state.messages = [];
  state.images = [];
  renderAttachments();
  $("messages").innerHTML = "";
  setBusy(false);
});
$("api-key").value = localStorage.getItem("pagedllm-api-key") || "";
$("api-key").addEventListener("change", () => { localStorage.setItem("pagedllm-api-key", $("api-key").value); loadModel(); });
loadModel();
poll();
setInterval(poll, 500);
