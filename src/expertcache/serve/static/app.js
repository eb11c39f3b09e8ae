// expertcache live view: plain JS, no build step, talks only to the server that served it.
// Streams: /v1/completions (stream: true) for the text, /v1/expertcache/events for the cache frames
// (schema in docs/SERVE.md, "Live view"); controls: /v1/expertcache/config; replay: /v1/expertcache/replay.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  mode: "live", config: null, model: null, cells: [], N: 0, L: 0,
  pending: null, drawn: 0, frames: 0, dropped: 0, abort: null,
  replay: null, replayPos: 0, replayTimer: null,
  errors: { live: "", replay: "" },  // each tab keeps its own error line
  accepted: null,                     // the control values last accepted (refused ones reset to these)
  events: null,
  live: null,                         // the newest live frame's layers, totals and shadow (repainted on return)
};
const MAX_COLS = 64;  // experts per grid line; more wrap onto further lines (the layer label stays)

// ---- the API key (a server started with --api-key): kept for this tab only ------------------
const KEY_STORE = "expertcache-api-key";
const auth = { key: sessionStorage.getItem(KEY_STORE) || "" };
function api(url, opts = {}) {  // fetch with the key as the OpenAI clients send it
  const headers = Object.assign({}, opts.headers || {});
  if (auth.key) headers["Authorization"] = "Bearer " + auth.key;
  return fetch(url, Object.assign({}, opts, { headers }));
}
function askKey(message) {  // resolves once a key is entered
  $("auth").classList.remove("hidden"); $("auth-msg").textContent = message;
  $("api-key").focus();
  return new Promise((resolve) => {
    $("auth-form").onsubmit = (ev) => {
      ev.preventDefault();
      auth.key = $("api-key").value.trim(); sessionStorage.setItem(KEY_STORE, auth.key);
      $("auth").classList.add("hidden"); resolve();
    };
  });
}
async function apiJSON(url) {  // GET with the key; asks for it while the server answers 401
  for (;;) {
    const r = await api(url);
    if (r.status !== 401) return r.json();
    await askKey(auth.key ? "That API key was refused; enter the server's --api-key:" :
      "This server needs an API key (its --api-key):");
  }
}
function setError(mode, msg) {
  state.errors[mode] = msg || "";
  if (state.mode === mode) $("config-error").textContent = state.errors[mode];
}
const STRENGTH_RANGE = {  // [min, max, step] of each policy's strength parameter
  lam: [0, 1, 0.05], p: [0, 1, 0.05], alpha: [0, 1, 0.05], beta: [0, 5, 0.1], m: [0, 8, 1], h: [1, 8, 1],
};

function fmtBytes(b) {
  if (b == null || !isFinite(b)) return "–";
  const u = ["B", "KiB", "MiB", "GiB"]; let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return (i ? b.toFixed(1) : Math.round(b)) + " " + u[i];
}
const pct = (x) => (x == null ? "–" : (100 * x).toFixed(1) + "%");

// ---- the grid ------------------------------------------------------------------------------
function buildGrid(L, N) {
  if (L === state.L && N === state.N) return;
  state.L = L; state.N = N; state.cells = [];
  const grid = $("grid"); grid.textContent = "";
  for (let l = 0; l < L; l++) {
    const row = document.createElement("div"); row.className = "layer";
    const name = document.createElement("span"); name.className = "name"; name.textContent = "layer " + l;
    const cells = document.createElement("div"); cells.className = "cells";
    cells.style.setProperty("--cols", Math.min(N, MAX_COLS));
    const arr = [];
    for (let e = 0; e < N; e++) {
      const c = document.createElement("i"); c.className = "cell"; c.title = `layer ${l}, expert ${e}`;
      c.dataset.layer = l; c.dataset.expert = e; cells.appendChild(c); arr.push(c);
    }
    row.appendChild(name); row.appendChild(cells); grid.appendChild(row); state.cells.push(arr);
  }
}

function paintLayers(layers) {
  layers.forEach((ly, l) => {
    const arr = state.cells[l]; if (!arr) return;
    const cls = new Array(arr.length).fill("cell");
    for (const e of ly.resident || []) cls[e] = "cell c-res";
    for (const e of ly.evicted || []) cls[e] = "cell c-evict";
    for (const e of ly.prefetched || []) cls[e] = "cell c-pre";
    for (const e of ly.miss || []) cls[e] = "cell c-miss";
    for (const e of ly.low || []) cls[e] = "cell c-low";
    for (const e of ly.hit || []) cls[e] = "cell c-hit";
    for (let e = 0; e < arr.length; e++) if (arr[e].className !== cls[e]) arr[e].className = cls[e];
  });
}

function paintTotals(t, live) {
  if (!t) return;
  $("hit-rate").textContent = pct(t.hit_rate);
  if (live) {
    $("tok-s").textContent = t.tok_s == null ? "–" : t.tok_s.toFixed(1);
    $("bytes-tok").textContent = fmtBytes(t.bytes_per_token);
  }
}

function draw() {  // at most once per animation frame: the newest frame wins, none queue up here
  const f = state.pending; state.pending = null;
  if (!f || state.mode !== "live") return;
  paintLive(f);
  state.drawn++; document.body.dataset.drawn = state.drawn;
}

function paintLive(f) {  // a live frame (or the hello's residency) with the live counters
  paintLayers(f.layers); paintTotals(f.totals, true);
  if (!f.totals) { $("hit-rate").textContent = $("tok-s").textContent = $("bytes-tok").textContent = "–"; }
  const o = f.original;  // cache-aware policy: policy vs original routing on the same tokens (shadow cache)
  $("orig-box").classList.toggle("hidden", !o);
  if (o) {
    $("orig-rate").textContent = pct(o.hit_rate);
    $("orig-label").textContent = `original routing, same tokens (policy: ${pct(o.policy_hit_rate)})`;
    $("orig-box").title = `since frame ${o.since_seq}: this policy ${pct(o.policy_hit_rate)}, original top-K ` +
      `${pct(o.hit_rate)} (a shadow cache of the same size and eviction fed the original selections)`;
  }
  $("step-no").textContent = state.frames; $("dropped").textContent = state.dropped;
}

// ---- events from the server ----------------------------------------------------------------
function connectEvents() {
  if (state.events) state.events.close();
  const es = new EventSource("/v1/expertcache/events" + (auth.key ? "?api_key=" + encodeURIComponent(auth.key) : ""));
  state.events = es;
  es.onopen = () => { $("conn").textContent = "live"; $("conn").className = "badge ok"; };
  es.onerror = () => { $("conn").textContent = "reconnecting…"; $("conn").className = "badge bad"; };
  es.onmessage = (ev) => {
    const f = JSON.parse(ev.data);
    if (f.type === "hello") {
      state.live = { layers: f.layers, totals: f.totals && f.totals.forwards ? f.totals : null, original: null };
      showConfig(f.config);
      if (state.mode === "live") { buildGrid(f.config.moe_layers, f.config.num_experts); paintLayers(f.layers); }
    } else if (f.type === "config") {
      showConfig(f.config);
    } else if (f.type === "step") {
      state.frames++; state.dropped = f.dropped || 0;
      state.live = { layers: f.layers, totals: f.totals, original: f.original };
      if (!state.pending) requestAnimationFrame(draw);
      state.pending = f;
    }
  };
}

// ---- configuration -------------------------------------------------------------------------
function fillSelect(sel, values, current) {
  if (sel.options.length !== values.length) {
    sel.textContent = "";
    for (const v of values) { const o = document.createElement("option"); o.value = o.textContent = v; sel.appendChild(o); }
  }
  if (current != null) sel.value = current;
}

function strengthName(policy) {  // the server's registry (config.choices.strength), else the papers' policies
  const c = state.config && state.config.choices && state.config.choices.strength;
  return c && policy in c ? c[policy] : STRENGTH_NAMES[policy];
}

function setStrengthControl(policy, routing, topK) {
  const name = strengthName(policy);
  const s = $("strength");
  $("strength-name").textContent = name ? (name === "lam" ? "λ" : name) : "strength";
  s.disabled = !name;
  if (!name) { $("strength-value").textContent = "–"; return; }
  const [lo, hi, step] = STRENGTH_RANGE[name];
  s.min = lo; s.max = (name === "m" || name === "h") ? topK : hi; s.step = step;
  const v = routing && routing.policy === policy ? routing[name] : null;
  s.value = v == null ? (name === "h" ? topK : lo) : v;
  $("strength-value").textContent = s.value;
}
const STRENGTH_NAMES = { original: null, prune: "h", "max-rank": "m", cumsum: "p", "cache-prior": "lam",
  "eras-threshold": "alpha", "eras-bias": "beta" };

function resetControls(v) {  // the controls show ``v`` (values the server accepted)
  if (!v) return;
  if ([...$("policy").options].some((o) => o.value === v.policy)) $("policy").value = v.policy;
  setStrengthControl(v.policy, v.routing, v.top_k);
  $("top-j").value = v.top_j; $("eviction").value = v.eviction; $("capacity").value = v.capacity;
}

function acceptedFrom(c) {
  return { policy: c.routing.policy, routing: c.routing, top_j: c.routing.top_j, eviction: c.eviction,
    capacity: c.capacity, top_k: c.top_k };
}

function showConfig(c) {
  state.config = c;
  $("config").textContent = JSON.stringify({ label: c.label, routing: c.routing, eviction: c.eviction,
    gamma: c.gamma, capacity: c.capacity, num_experts: c.num_experts, top_k: c.top_k, moe_layers: c.moe_layers,
    expert_bytes: c.expert_bytes, version: c.version, pending: c.pending }, null, 1);
  document.body.dataset.configVersion = c.version;
  if (state.mode !== "live") return;
  fillSelect($("policy"), c.choices.policy, c.routing.policy);
  fillSelect($("eviction"), c.choices.eviction, c.eviction);
  setStrengthControl(c.routing.policy, c.routing, c.top_k);
  $("top-j").value = c.routing.top_j; $("top-j").max = c.top_k;
  $("capacity").value = c.capacity; $("capacity").max = c.num_experts;
  state.accepted = acceptedFrom(c);
}

class FieldError extends Error {
  constructor(id, message) { super(message); this.id = id; }
}
function numberField(id, label) {  // the number typed in ``id``; an empty or non-numeric field is refused here
  const text = $(id).value.trim();  // (Number("") is 0: an emptied field would silently send 0)
  if (text === "" || !isFinite(Number(text))) throw new FieldError(id, `${label}: enter a number`);
  return Number(text);
}

function controlBody() {
  const policy = $("policy").value;
  const body = { policy, top_j: numberField("top-j", "top_j"), eviction: $("eviction").value,
    capacity: numberField("capacity", "capacity") };
  const name = strengthName(policy);
  if (name) body[name] = Number($("strength").value);
  return body;
}

async function postConfig() {
  if (state.mode !== "live") return;
  setError("live", "");
  let body;
  try { body = controlBody(); } catch (err) {  // nothing sent: the field goes back to what the server uses
    setError("live", err.message); resetControls(state.accepted); return;
  }
  const r = await api("/v1/expertcache/config", { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body) });
  const j = await r.json().catch(() => ({}));
  if (!r.ok) {  // refused: nothing changed on the server, so the controls go back to what it uses
    setError("live", j.error ? j.error.message : "error " + r.status);
    resetControls(state.accepted);
    return;
  }
  showConfig(j);
}

// ---- the prompt ----------------------------------------------------------------------------
async function generate() {
  if (!state.model) return;
  $("output").textContent = ""; $("gen-status").textContent = "generating…"; $("client-tok-s").textContent = "–";
  $("generate").disabled = true; $("stop").disabled = false;
  document.body.dataset.generating = "1";
  const ctl = new AbortController(); state.abort = ctl;
  try {
    const t0 = performance.now(); let tFirst = null, pieces = 0;
    const r = await api("/v1/completions", { method: "POST", signal: ctl.signal,
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: state.model, prompt: $("prompt").value, stream: true,
        max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value) }) });
    if (!r.ok) {
      const j = await r.json().catch(() => ({}));
      $("gen-status").textContent = (j.error && j.error.message) || ("error " + r.status); return;
    }
    const reader = r.body.getReader(); const dec = new TextDecoder(); let buf = "";
    for (;;) {
      const { value, done } = await reader.read(); if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, i); buf = buf.slice(i + 2);
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6); if (data === "[DONE]") continue;
        const j = JSON.parse(data);
        if (j.error) { $("gen-status").textContent = j.error.message; continue; }
        const ch = j.choices && j.choices[0];
        if (ch && ch.text) {
          $("output").textContent += ch.text;
          const now = performance.now();
          if (tFirst == null) tFirst = now; else pieces++;  // tokens after the first, over the time since it
          if (now > tFirst) $("client-tok-s").textContent = (1000 * pieces / (now - tFirst)).toFixed(1);
        }
        if (j.expertcache) {
          const n = j.usage.completion_tokens, now = performance.now();  // exact count at the end
          if (tFirst != null && n > 1 && now > tFirst) $("client-tok-s").textContent = (1000 * (n - 1) / (now - tFirst)).toFixed(1);
          document.body.dataset.clientTokS = $("client-tok-s").textContent;
          document.body.dataset.ttftMs = tFirst == null ? "" : String(Math.round(tFirst - t0));
          const e = j.expertcache;
          $("gen-status").textContent = `${j.usage.completion_tokens} tokens · ${ch.finish_reason} · this request: ` +
            `hit rate ${pct(e.hit_rate)}, ${fmtBytes(e.bytes_read)} read · ${e.policy}+${e.eviction}, C=${e.capacity}`;
        }
      }
    }
  } catch (err) {
    if (err.name !== "AbortError") $("gen-status").textContent = String(err);
    else $("gen-status").textContent = "stopped";
  } finally {
    $("generate").disabled = false; $("stop").disabled = true; state.abort = null;
    document.body.dataset.generating = "0";
  }
}

// ---- replay --------------------------------------------------------------------------------
async function loadTraces() {
  const j = await apiJSON("/v1/expertcache/traces");
  fillSelect($("trace-select"), j.traces.map((t) => t.name), null);
}

async function replayLoad() {
  replayPause();
  setError("replay", "");
  let body;
  try {
    body = Object.assign(controlBody(), { trace: $("trace-select").value,
      start: numberField("replay-start", "start"), steps: numberField("replay-steps", "steps") });
  } catch (err) {  // an emptied field: said here, reset to the last accepted replay's value, nothing sent
    setError("replay", err.message);
    const a = state.replayAccepted;
    if (err.id === "replay-start") $("replay-start").value = a ? a.start : 0;
    else if (err.id === "replay-steps") $("replay-steps").value = a ? a.steps : 128;
    else resetControls(a ? a.controls : state.accepted);
    return;
  }
  $("replay-status").textContent = "simulating…";
  const r = await api("/v1/expertcache/replay", { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body) });
  const j = await r.json().catch(() => ({}));
  if (!r.ok) {  // the refused value goes back to the last accepted one: the next Load works
    $("replay-status").textContent = "";
    setError("replay", j.error ? j.error.message : "error " + r.status);
    const p = j.error && j.error.param;
    if (p === "start") $("replay-start").value = state.replayAccepted ? state.replayAccepted.start : 0;
    else if (p === "steps") $("replay-steps").value = state.replayAccepted ? state.replayAccepted.steps : 128;
    else if (p !== "trace") resetControls(state.replayAccepted ? state.replayAccepted.controls : state.accepted);
    return;
  }
  state.replayAccepted = { start: body.start, steps: body.steps, controls: { policy: body.policy,
    routing: Object.assign({ policy: body.policy }, j.config.routing), top_j: body.top_j, eviction: body.eviction,
    capacity: body.capacity, top_k: j.trace.top_k } };
  state.replay = j; state.replayPos = 0;
  buildGrid(j.trace.num_layers, j.trace.num_experts);
  $("replay-pos").max = j.frames.length - 1; $("replay-pos").disabled = false;
  $("replay-play").disabled = $("replay-next").disabled = false;
  $("replay-status").textContent = `${j.trace.model} trace, tokens ${j.config.start}…${j.config.start + j.config.steps - 1}` +
    ` under ${j.config.label}+${j.config.eviction}, C=${j.config.capacity}: simulator miss rate ${pct(j.result.miss_rate)}`;
  $("bytes-tok").textContent = "–"; $("tok-s").textContent = "–";
  showReplayFrame(0);
  replayPlay();
}

function showReplayFrame(i) {
  const fr = state.replay.frames[i]; if (!fr) return;
  state.replayPos = i; $("replay-pos").value = i;
  paintLayers(fr.layers); paintTotals(fr.totals, false);
  $("step-no").textContent = `${i + 1}/${state.replay.frames.length}`;
  document.body.dataset.replayStep = i;
}

function replayPlay() {
  if (!state.replay) return;
  replayPause();
  $("replay-play").textContent = "Pause";
  const tick = () => {
    if (state.replayPos >= state.replay.frames.length - 1) { replayPause(); return; }
    showReplayFrame(state.replayPos + 1);
    state.replayTimer = setTimeout(tick, 1000 / Number($("replay-speed").value));
  };
  state.replayTimer = setTimeout(tick, 1000 / Number($("replay-speed").value));
}
function replayPause() {
  if (state.replayTimer) clearTimeout(state.replayTimer);
  state.replayTimer = null; $("replay-play").textContent = "Play";
}

function setMode(mode) {
  state.mode = mode;
  $("config-error").textContent = state.errors[mode];
  for (const b of document.querySelectorAll(".tab")) b.classList.toggle("active", b.dataset.mode === mode);
  $("pane-live").classList.toggle("hidden", mode !== "live");
  $("pane-replay").classList.toggle("hidden", mode !== "replay");
  $("step-label").textContent = mode === "live" ? "frames" : "replay step";
  $("hit-label").textContent = mode === "live" ? "hit rate since start" : "hit rate, replay so far";
  $("orig-box").classList.add("hidden");  // live: the next frame shows it again for a cache-aware policy
  const evs = mode === "live" ? (state.config ? state.config.choices.eviction : [])
    : (state.config && state.config.choices.replay_eviction) || ["lru", "lfu", "gamma", "gamma-admit", "belady"];
  fillSelect($("eviction"), evs, $("eviction").value);
  if (mode === "live") {  // back to what the server does now: its grid, counters and configuration
    replayPause();
    if (state.config) { buildGrid(state.config.moe_layers, state.config.num_experts); showConfig(state.config); }
    paintLive(state.live || { layers: [], totals: null, original: null });
    if (!state.live) for (const arr of state.cells) for (const c of arr) c.className = "cell";
  } else if (state.replay) {
    $("orig-box").classList.add("hidden");
    showReplayFrame(state.replayPos);
  }
}

// ---- wiring --------------------------------------------------------------------------------
async function init() {
  $("tab-live").onclick = () => setMode("live");
  $("tab-replay").onclick = () => setMode("replay");
  $("generate").onclick = generate;
  $("stop").onclick = () => state.abort && state.abort.abort();
  $("policy").onchange = () => {
    setStrengthControl($("policy").value, state.config && state.config.routing, state.config ? state.config.top_k : 8);
    postConfig();
  };
  $("strength").oninput = () => { $("strength-value").textContent = $("strength").value; };
  $("strength").onchange = postConfig;
  $("top-j").onchange = postConfig;
  $("eviction").onchange = postConfig;
  $("capacity").onchange = postConfig;
  $("replay-load").onclick = replayLoad;
  $("replay-play").onclick = () => (state.replayTimer ? replayPause() : replayPlay());
  $("replay-next").onclick = () => { replayPause(); if (state.replay) showReplayFrame(Math.min(state.replayPos + 1, state.replay.frames.length - 1)); };
  $("replay-pos").oninput = () => { replayPause(); showReplayFrame(Number($("replay-pos").value)); };
  const models = await apiJSON("/v1/models");  // asks for the API key first if the server needs one
  const config = await apiJSON("/v1/expertcache/config");
  state.model = models.data[0].id;
  $("model").textContent = `${state.model} · ${config.moe_layers} MoE layers × ${config.num_experts} experts, K=${config.top_k}`;
  showConfig(config);
  buildGrid(config.moe_layers, config.num_experts);
  connectEvents();
  await loadTraces();
  document.body.dataset.ready = "1";
}

init().catch((err) => { $("gen-status").textContent = "failed to start: " + err; });
