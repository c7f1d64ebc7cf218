// The specfleet console: plain JavaScript over the gateway's own endpoints.
//
// Reads: one EventSource on /console/api/stream (fleet snapshots and fleet events, open like
// /metrics); with the API key, fetch-read SSE streams of the caller's batches and of a
// playground job's events. Actions: the gateway's /v1 API with the key the user typed (kept in
// sessionStorage), so the console has no way of its own to change anything.
"use strict";
(() => {
  const KEY = "specfleet.apiKey";
  const HISTORY = 600; // samples kept per worker (one a second: ten minutes)
  const COLORS = ["#2e6fdb", "#e8590c", "#12b76a", "#9e3fd6", "#d92d20", "#0e9384", "#b54708"];
  const KIND_ORDER = ["replay", "fallback", "lost", "requeue", "redis", "refusal"];
  const ORIGIN = { d: "drafted and accepted", f: "forced by the grammar", t: "the verify's own token" };
  const TERMINAL = new Set(["completed", "failed", "expired", "cancelled"]);

  const state = {
    fleet: null, keysRequired: false, events: [], history: {}, queued: {}, batches: [],
    tab: "fleet", worker: "", batchStream: null,
    silent: new Set(), // live in the last snapshot, but its registration has run out since
  };
  const expiries = {}; // worker -> the timer set for when its registration runs out
  const charts = {};

  // -- small helpers -------------------------------------------------------------------------
  const $ = (selector) => document.querySelector(selector);
  function el(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props)) {
      if (value === undefined || value === null) continue;
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else if (name.startsWith("data-")) node.setAttribute(name, String(value));
      else node[name] = value;
    }
    for (const child of children) node.append(child);
    return node;
  }
  // A table cell holding a raw figure (data-value: what tests compare) shown formatted.
  const cell = (field, value, shown, numeric = true) =>
    el("td", { "data-field": field, "data-value": value, class: numeric ? "num" : "", text: shown });
  const fixed = (v, digits = 2) => (typeof v === "number" && isFinite(v) ? v.toFixed(digits) : "-");
  const percent = (v) => (typeof v === "number" ? `${(v * 100).toFixed(0)}%` : "-");
  const clock = (unix) => new Date(unix * 1000).toLocaleTimeString();
  const unixOf = (iso) => Date.parse(iso) / 1000;
  function bytes(n) {
    if (typeof n !== "number") return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  }
  function fillBody(table, rows) {
    const body = table.tBodies[0];
    body.replaceChildren(...rows);
  }
  function setLive(text, kind) {
    const live = $("#live");
    live.textContent = text;
    live.className = `live ${kind}`;
  }
  function note(selector, text, bad = false) {
    const node = $(selector);
    node.textContent = text;
    node.classList.toggle("bad", bad);
  }

  // -- the key -------------------------------------------------------------------------------
  const apiKey = () => sessionStorage.getItem(KEY) || "";
  const authHeaders = () => (apiKey() ? { Authorization: `Bearer ${apiKey()}` } : {});
  const mayCall = () => !state.keysRequired || apiKey() !== "";
  function showKeyState() {
    $("#key-state").textContent = apiKey() ? "key in use (this tab only)"
      : state.keysRequired ? "read-only: no key" : "open gateway (no keys configured)";
  }
  async function failure(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not JSON: the status says it */ }
    const error = new Error(message);
    error.status = response.status;
    return error;
  }

  // Reads an SSE response with fetch (EventSource cannot send the key): calls onEvent(name,
  // data) for each event until the stream ends; rejects with the gateway's own error.
  async function readSSE(url, init, onEvent) {
    const response = await fetch(url, init);
    if (!response.ok) throw await failure(response);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let name = "message";
    let data = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, end).replace(/\r$/, "");
        buffer = buffer.slice(end + 1);
        if (line === "") {
          if (data.length) onEvent(name, data.join("\n"));
          name = "message";
          data = [];
        } else if (line.startsWith(":")) {
          continue; // a keep-alive
        } else if (line.startsWith("event:")) {
          name = line.slice(6).trim();
        } else if (line.startsWith("data:")) {
          data.push(line.slice(5).replace(/^ /, ""));
        }
      }
    }
  }

  // -- charts (uPlot) ------------------------------------------------------------------------
  function chart(id, series, data, extra = {}) {
    const host = document.getElementById(id);
    const signature = JSON.stringify([series.map((s) => s.label), extra.kind || ""]);
    const existing = charts[id];
    if (existing && existing.signature === signature) {
      existing.plot.setData(data);
      return;
    }
    if (existing) existing.plot.destroy();
    host.replaceChildren();
    const width = host.classList.contains("wide") ? 960 : 460;
    const opts = {
      width, height: 180, legend: { live: false },
      scales: extra.scales || { x: { time: true } },
      axes: extra.axes,
      series: [{}, ...series],
    };
    charts[id] = { signature, plot: new uPlot(opts, data, host) };
  }
  // Samples over time, on an axis a minute long at least (a first sample is a point on it,
  // not a range of years): an empty sample a minute before the first when they span less.
  function overTime(times, ...series) {
    if (!times.length || times[times.length - 1] - times[0] >= 60) return [times, ...series];
    return [[times[times.length - 1] - 60, ...times], ...series.map((values) => [null, ...values])];
  }
  const line = (label, i) => ({ label, stroke: COLORS[i % COLORS.length], width: 1.5 });
  const bars = (label, i) => ({
    label, stroke: COLORS[i % COLORS.length], fill: `${COLORS[i % COLORS.length]}99`,
    paths: uPlot.paths.bars({ size: [0.6, 60] }), points: { show: false },
  });

  // -- the fleet -----------------------------------------------------------------------------
  function onFleet(fleet) {
    state.fleet = fleet;
    const now = fleet.taken_at;
    for (const w of fleet.workers) {
      const samples = (state.history[w.name] = state.history[w.name] || []);
      samples.push({ t: now, row: w });
      if (samples.length > HISTORY) samples.shift();
    }
    for (const model of new Set(fleet.queues.map((q) => q.model))) {
      const samples = (state.queued[model] = state.queued[model] || []);
      const depth = fleet.queues.filter((q) => q.model === model).reduce((n, q) => n + q.depth, 0);
      samples.push({ t: now, depth });
      if (samples.length > HISTORY) samples.shift();
    }
    watchHeartbeats(fleet);
    setLive(`live · ${clock(now)}`, "ok");
    renderModels();
    renderWorkerSelect();
    if (state.tab === "fleet") renderFleet();
    if (state.tab === "worker") renderWorker();
  }

  // A worker is lost the moment its registration runs out (a TTL after its last heartbeat),
  // not at the next snapshot: each snapshot sets a timer for that moment, which the next one
  // moves on while the worker beats. A worker gone from a snapshot without lapsing left.
  function watchHeartbeats(fleet) {
    const live = new Set(fleet.workers.map((w) => w.name));
    for (const name of Object.keys(expiries)) {
      if (live.has(name) || fleet.lapsed.includes(name)) continue;
      clearTimeout(expiries[name]);
      delete expiries[name];
      state.silent.delete(name);
    }
    for (const w of fleet.workers) {
      clearTimeout(expiries[w.name]);
      state.silent.delete(w.name);
      const left = fleet.worker_ttl_seconds - w.heartbeat_age_seconds;
      expiries[w.name] = setTimeout(() => {
        state.silent.add(w.name);
        if (state.tab === "fleet") renderFleet();
      }, Math.max(0, 1000 * left));
    }
  }

  // The checkpoint storage in force, and why it is the host's when the device's failed at
  // start-up (a fallback before any generation: no job's telemetry, so no count, has it).
  function checkpoints(w) {
    const fit = ((state.fleet.details[w.name] || {}).fit || {}).details || {};
    const mode = w.checkpoint_mode || fit.checkpoint_mode || "-";
    return fit.checkpoint_fallback ? `${mode} (start-up fallback: ${fit.checkpoint_fallback})` : mode;
  }

  function renderFleet() {
    const fleet = state.fleet;
    if (!fleet) return;
    fillBody($("#workers"), fleet.workers.map((w) => {
      const t = w.telemetry || {};
      const link = el("a", { href: `#worker/${encodeURIComponent(w.name)}`, text: w.name });
      return el("tr", { "data-worker": w.name, "data-slots": w.slots },
        el("td", { "data-field": "name", "data-value": w.name }, link),
        cell("model", w.model, w.model, false),
        cell("device", w.device, w.device, false),
        cell("n_ctx", w.n_ctx, String(w.n_ctx)),
        cell("busy_slots", w.busy_slots, `${w.busy_slots} busy / ${w.slots - w.busy_slots} free`),
        el("td", { "data-field": "checkpoint_mode", "data-value": w.checkpoint_mode || "",
          class: "wrap", text: checkpoints(w) }),
        cell("host_fallbacks", w.host_fallbacks, String(w.host_fallbacks)),
        cell("prefix_hit_rate", w.prefix_hit_rate, percent(w.prefix_hit_rate)),
        cell("acceptance", w.acceptance, fixed(w.acceptance, 3)),
        cell("tokens_per_verify", t.tokens_per_verify ?? 0, fixed(t.tokens_per_verify ?? 0)),
        cell("tokens_per_second", w.tokens_per_second, fixed(w.tokens_per_second, 1)),
        cell("generated_tokens", w.generated_tokens, String(w.generated_tokens)),
        cell("heartbeat_age_seconds", w.heartbeat_age_seconds,
          `${fixed(w.heartbeat_age_seconds, 1)} s`));
    }));
    fillBody($("#queues"), fleet.queues.map((q) => {
      const high = q.tier === "high" || q.tier.endsWith(":high");
      const tier = q.tier === "normal" || q.tier === "high" ? "shared" : q.tier.replace(/:high$/, "");
      return el("tr", { "data-queue": `${q.model}|${q.tier}` },
        cell("model", q.model, q.model, false),
        cell("tier", q.tier, tier, false),
        cell("priority", high ? "high" : "normal", high ? "high" : "normal", false),
        cell("depth", q.depth, String(q.depth)),
        cell("oldest_wait_seconds", q.oldest_wait_seconds, `${fixed(q.oldest_wait_seconds, 1)} s`));
    }));
    const lapsed = [...new Set([...fleet.lapsed, ...state.silent])].sort()
      .filter((name) => !fleet.lost.some((l) => l.worker === name));
    fillBody($("#lost"), [
      ...lapsed.map((name) => el("tr", { "data-lost": name, "data-state": "lapsed", class: "lost" },
        el("td", { text: name }), el("td", { text: "-" }),
        el("td", { text: `no heartbeat for a TTL (${fleet.worker_ttl_seconds} s); recovery pending` }),
        el("td", { text: "-" }), el("td", { text: "-" }), el("td", { text: "-" }), el("td", { text: "-" }))),
      ...fleet.lost.map((l) => el("tr", { "data-lost": l.worker, "data-state": "lost", class: "lost" },
        el("td", { text: l.worker }), el("td", { text: l.model || "-" }),
        el("td", { text: "declared lost" }),
        cell("jobs", l.jobs.length, String(l.jobs.length)),
        cell("requeued", l.requeued.length, String(l.requeued.length)),
        el("td", { text: l.by || "a client" }), el("td", { text: l.timestamp }))),
    ]);
    const names = fleet.workers.map((w) => w.name);
    const times = (state.history[names[0]] || []).map((s) => s.t);
    chart("chart-tps", names.map(line), overTime(times, ...names.map((n) => {
      const samples = state.history[n] || [];
      return times.map((t) => (samples.find((s) => s.t === t) || { row: {} }).row.tokens_per_second ?? null);
    })));
    const models = Object.keys(state.queued).sort();
    const qtimes = (state.queued[models[0]] || []).map((s) => s.t);
    chart("chart-queued", models.map(line), overTime(qtimes, ...models.map((m) =>
      qtimes.map((t) => (state.queued[m].find((s) => s.t === t) || {}).depth ?? null))));
  }

  function renderModels() {
    const select = $("#pg-model");
    const models = [...new Set(state.fleet.workers.map((w) => w.model))].sort();
    const current = [...select.options].map((o) => o.value);
    if (JSON.stringify(current) === JSON.stringify(models)) return;
    const chosen = select.value;
    select.replaceChildren(...models.map((m) => el("option", { value: m, text: m })));
    if (models.includes(chosen)) select.value = chosen;
  }

  // -- a worker ------------------------------------------------------------------------------
  function renderWorkerSelect() {
    const select = $("#worker-select");
    const names = state.fleet.workers.map((w) => w.name);
    if (state.worker && !names.includes(state.worker)) names.push(state.worker);
    const current = [...select.options].map((o) => o.value);
    if (JSON.stringify(current) !== JSON.stringify(names)) {
      select.replaceChildren(...names.map((n) => el("option", { value: n, text: n })));
    }
    if (!state.worker && names.length) state.worker = names[0];
    select.value = state.worker;
  }

  function renderWorker() {
    const fleet = state.fleet;
    if (!fleet) return;
    const w = fleet.workers.find((x) => x.name === state.worker);
    if (!w) {
      $("#worker-summary").textContent = state.worker ? `${state.worker}: not live` : "no worker";
      return;
    }
    const t = w.telemetry || {};
    const details = fleet.details[w.name] || {};
    $("#worker-summary").textContent = `${w.name} · ${w.model} on ${w.device} · ` +
      `${t.spec_method || "-"} (N=${t.draft_max ?? "-"}) · checkpoints ${checkpoints(w)} · ` +
      `acceptance ${fixed(w.acceptance, 3)} · ${fixed(t.tokens_per_verify ?? 0)} tokens/verify · ` +
      `${t.replay_events ?? 0} replays (${t.replay_tokens ?? 0} tokens) · ` +
      `${w.host_fallbacks} host fallbacks in generations · ${fixed(w.tokens_per_second, 1)} tok/s`;
    const drafted = t.drafted_per_position || [];
    const accepted = t.accepted_per_position || [];
    chart("chart-positions", [bars("acceptance", 0)],
      [drafted.map((_, i) => i + 1), drafted.map((d, i) => (d ? (accepted[i] || 0) / d : 0))],
      { kind: "positions", scales: { x: { time: false }, y: { range: [0, 1] } } });
    const samples = state.history[w.name] || [];
    const times = samples.map((s) => s.t);
    const tel = (s, field) => ((s.row.telemetry || {})[field] ?? 0);
    chart("chart-verify", [line("tokens/verify", 0), line("acceptance", 1)],
      overTime(times, samples.map((s) => tel(s, "tokens_per_verify")), samples.map((s) => s.row.acceptance)));
    chart("chart-replays", [line("replay events", 0), line("replayed tokens", 1), line("host fallbacks", 4)],
      overTime(times, samples.map((s) => tel(s, "replay_events")), samples.map((s) => tel(s, "replay_tokens")),
        samples.map((s) => s.row.host_fallbacks)));
    const per = (seconds) => (t.generated_tokens ? (1000 * seconds) / t.generated_tokens : 0);
    const drafting = per(t.draft_seconds || 0);
    const host = Math.max(0, per(t.host_seconds || 0) - drafting);
    chart("chart-split", [bars("ms per token", 0)], [[1, 2, 3], [per(t.decode_seconds || 0), drafting, host]], {
      kind: "split", scales: { x: { time: false, range: [0.5, 3.5] }, y: { range: (_, min, max) => [0, max] } },
      axes: [{ splits: () => [1, 2, 3], values: (_, ticks) => ticks.map((v) => ["", "decode", "drafting", "host, other"][v] || "") }, {}],
    });
    renderFit(w, details);
  }

  function renderFit(w, details) {
    const fit = details.fit;
    const rows = [];
    const row = (name, value) => rows.push(el("tr", { "data-fit": name },
      el("th", { text: name }), el("td", { text: value })));
    if (!fit) {
      row("fit", "no fit report (a fixed --ctx)");
    } else {
      row("model file", fit.model_path);
      row("context (fitted / trained)", `${fit.n_ctx} / ${fit.n_ctx_train}`);
      row("slots", String(fit.slots));
      row("speculation", `${fit.spec_method}, N=${fit.draft_max}, D=${fit.rollback_depth ?? "-"}`);
      row("budget / total", `${bytes(fit.budget_bytes)} / ${bytes(fit.total_bytes)}`);
      for (const [name, value] of Object.entries(fit.components)) row(name, bytes(value));
      for (const d of fit.devices) {
        row(`device ${d.device}`, `total ${bytes(d.total_bytes)}, free ${bytes(d.free_bytes)}, ` +
          `margin ${bytes(d.margin_bytes)}`);
        for (const [name, value] of Object.entries(d.components)) row(`  ${d.device} ${name}`, bytes(value));
      }
      for (const [name, value] of Object.entries(fit.details)) {
        row(name, typeof value === "object" ? JSON.stringify(value) : String(value));
      }
    }
    row("capacity", details.capacity ? JSON.stringify(details.capacity) : "-");
    row("chat template", details.chat_template || "-");
    row("version", details.version || "-");
    fillBody($("#fit"), rows);
  }

  // -- the fleet's events --------------------------------------------------------------------
  function onEvents(entries) {
    const known = new Set(state.events.map((e) => e.id));
    for (const e of entries) if (!known.has(e.id)) state.events.push(e);
    state.events.sort((a, b) => unixOf(a.timestamp) - unixOf(b.timestamp));
    if (state.events.length > 2000) state.events.splice(0, state.events.length - 2000);
    renderFilters();
    if (state.tab === "events") renderEvents();
  }

  function renderFilters() {
    const options = (field) => [...new Set(state.events.map((e) => e[field]).filter(Boolean))].sort();
    for (const [id, values] of [["#filter-worker", options("worker")], ["#filter-model", options("model")],
      ["#filter-kind", KIND_ORDER]]) {
      const select = $(id);
      const current = [...select.options].map((o) => o.value).slice(1);
      if (JSON.stringify(current) === JSON.stringify(values)) continue;
      const chosen = select.value;
      select.replaceChildren(el("option", { value: "", text: "all" }),
        ...values.map((v) => el("option", { value: v, text: v })));
      select.value = values.includes(chosen) ? chosen : "";
    }
  }

  function describe(e) {
    switch (e.kind) {
      case "lost": return `declared lost by ${e.by || "a client"}: held ${(e.jobs || []).length} job(s), requeued ${(e.requeued || []).length}`;
      case "requeue": return `job ${e.job_id || "?"} requeued (${e.reason}${e.count > 1 ? `, ${e.count} jobs` : ""})`;
      case "fallback": return `checkpoints moved to the host (${e.phase}${e.reason ? `: ${e.reason}` : ""})${e.job_id ? ` in job ${e.job_id}` : ""}`;
      case "replay": return `job ${e.job_id}: ${e.replay_events} replay(s), ${e.replay_tokens} token(s) re-decoded`;
      case "redis": return `Redis ${e.fault} during ${e.operation} for ${fixed(e.seconds, 1)} s`;
      case "refusal": return `job ${e.job_id || "?"} ${e.outcome}${e.reason ? `: ${e.reason}` : ""}`;
      default: return e.event;
    }
  }

  function renderEvents() {
    const worker = $("#filter-worker").value;
    const model = $("#filter-model").value;
    const kind = $("#filter-kind").value;
    const shown = state.events.filter((e) => (!worker || e.worker === worker)
      && (!model || e.model === model) && (!kind || e.kind === kind));
    $("#events-count").textContent = `${shown.length} of ${state.events.length} events`;
    fillBody($("#events"), shown.slice().reverse().map((e) => el("tr",
      { "data-kind": e.kind, "data-worker": e.worker || "", "data-model": e.model || "" },
      el("td", { text: new Date(unixOf(e.timestamp) * 1000).toLocaleString() }),
      el("td", { class: `kind kind-${e.kind}`, text: e.kind }),
      el("td", { text: e.worker || "-" }), el("td", { text: e.model || "-" }),
      el("td", { text: describe(e) }))));
    const kinds = KIND_ORDER.filter((k) => shown.some((e) => e.kind === k));
    const times = [...new Set(shown.map((e) => unixOf(e.timestamp)))].sort((a, b) => a - b);
    chart("chart-timeline", kinds.map((k) => ({
      label: k, stroke: COLORS[KIND_ORDER.indexOf(k)], paths: () => null,
      points: { show: true, size: 9, fill: COLORS[KIND_ORDER.indexOf(k)] },
    })), overTime(times, ...kinds.map((k) => times.map((t) =>
      (shown.some((e) => e.kind === k && unixOf(e.timestamp) === t) ? KIND_ORDER.indexOf(k) + 1 : null)))), {
      kind: "timeline",
      scales: { x: { time: true }, y: { range: [0.5, KIND_ORDER.length + 0.5] } },
      axes: [{}, { size: 70, splits: () => KIND_ORDER.map((_, i) => i + 1),
        values: (_, ticks) => ticks.map((v) => KIND_ORDER[v - 1] || "") }],
    });
  }

  // -- batches -------------------------------------------------------------------------------
  function startBatches() {
    if (state.batchStream) state.batchStream.abort();
    state.batchStream = null;
    if (!mayCall()) {
      note("#batches-note", "Enter the API key to see your batches (they belong to a key).");
      return;
    }
    const controller = new AbortController();
    state.batchStream = controller;
    note("#batches-note", apiKey() ? "Your key's batches (an admin key: everyone's)." : "");
    readSSE("/console/api/batches/stream", { headers: authHeaders(), signal: controller.signal },
      (name, data) => {
        if (name === "batches") onBatches(JSON.parse(data));
        if (name === "failure") note("#batches-note", `batches: ${JSON.parse(data).message}`, true);
      })
      .catch((error) => {
        if (error.name !== "AbortError") note("#batches-note", `batches: ${error.message}`, true);
      });
  }

  function onBatches(listing) {
    state.batches = listing.data;
    state.batchesAt = listing.taken_at;
    if (state.tab === "batches") renderBatches();
  }

  function renderBatches() {
    const now = state.batchesAt || Date.now() / 1000;
    fillBody($("#batches"), state.batches.map((b) => {
      const c = b.request_counts;
      const done = c.completed + c.failed;
      const fraction = c.total ? done / c.total : 0;
      const started = b.in_progress_at;
      // the batch's timestamps are whole seconds: a batch done within one is one line a second
      const rate = started && done ? done / Math.max(1, (b.completed_at || now) - started) : 0;
      const eta = TERMINAL.has(b.status) ? "-" : rate ? `${fixed((c.total - done) / rate, 0)} s` : "-";
      const open = el("a", { href: `#batches/${encodeURIComponent(b.id)}`, text: b.id });
      const cancel = TERMINAL.has(b.status) || b.status === "cancelling" ? ""
        : el("button", { class: "cancel", "data-batch": b.id, text: "Cancel", onclick: () => cancelBatch(b.id) });
      return el("tr", { "data-batch": b.id, "data-status": b.status },
        el("td", {}, open), cell("status", b.status, b.status, false),
        el("td", { "data-field": "progress", "data-value": (100 * fraction).toFixed(1) },
          el("progress", { max: 100, value: 100 * fraction }), ` ${(100 * fraction).toFixed(0)}%`),
        cell("counts", `${c.completed}/${c.failed}/${c.total}`, `${c.completed} / ${c.failed} / ${c.total}`),
        cell("rate", rate, rate ? `${fixed(rate, 2)} lines/s` : "-"),
        cell("eta", eta, eta),
        el("td", { text: clock(b.created_at) }),
        el("td", {}, cancel));
    }));
  }

  async function cancelBatch(id) {
    note("#batch-message", `cancelling ${id}…`);
    const response = await fetch(`/v1/batches/${encodeURIComponent(id)}/cancel`,
      { method: "POST", headers: authHeaders() });
    if (!response.ok) {
      const error = await failure(response);
      note("#batch-message", `cancel of ${id} refused (${error.status}): ${error.message}`, true);
      return;
    }
    const batch = await response.json();
    note("#batch-message", `batch ${id}: ${batch.status}`);
  }

  async function openBatch(id) {
    $("#batch-detail").hidden = false;
    $("#batch-detail-id").textContent = id;
    fillBody($("#batch-errors"), []);
    if (!mayCall()) {
      note("#batch-message", "Enter the API key to open a batch.", true);
      return;
    }
    const response = await fetch(`/console/api/batches/${encodeURIComponent(id)}/errors`,
      { headers: authHeaders() });
    if (!response.ok) {
      const error = await failure(response);
      note("#batch-message", `batch ${id}: ${error.message}`, true);
      return;
    }
    const lines = (await response.json()).data;
    fillBody($("#batch-errors"), lines.length ? lines.map((l) => el("tr", { "data-line": l.line },
      el("td", { text: String(l.line) }), el("td", { text: l.custom_id || "-" }),
      el("td", { text: (l.error || {}).code || "-" }), el("td", { text: (l.error || {}).message || "-" })))
      : [el("tr", {}, el("td", { colSpan: 4, text: "no failed line" }))]);
  }

  // -- the playground ------------------------------------------------------------------------
  function telemetryTable(t, marks) {
    const rows = [
      ["method", `${t.spec_method} (N=${t.draft_max})`],
      ["generated tokens", t.generated_tokens],
      ["drafted / accepted", `${t.drafted} / ${t.accepted}`],
      ["acceptance", fixed(t.acceptance, 3)],
      ["mean acceptance length", fixed(t.mean_acceptance_length)],
      ["tokens per verify", fixed(t.tokens_per_verify)],
      ["verifies", t.target_decodes],
      ["forced by the grammar", t.forced_tokens],
      ["replays (tokens)", `${t.replay_events} (${t.replay_tokens})`],
      ["host fallbacks", t.host_fallbacks],
      ["prefix cache", `${t.cached_tokens} of ${t.prompt_tokens} prompt tokens`],
      ["tok/s (wall)", fixed(t.effective_tokens_per_second, 1)],
      ["marked drafted / verify / forced", `${marks.d} / ${marks.t} / ${marks.f}`],
    ];
    fillBody($("#pg-telemetry"), rows.map(([k, v]) => el("tr", { "data-telemetry": k },
      el("th", { text: k }), el("td", { text: String(v) }))));
  }

  // The job's own events: each token marked by how it was produced (its text from the
  // token's logprob entry, asked for by the request), the telemetry when it ends.
  function followJob(jobId) {
    const tokens = $("#pg-tokens");
    const marks = { d: 0, f: 0, t: 0 };
    let attempt = 0;
    return readSSE(`/console/api/jobs/${encodeURIComponent(jobId)}/events`, { headers: authHeaders() },
      (name, data) => {
        const event = JSON.parse(data);
        if (event.attempt > attempt) { // a re-run (a lost worker's job) starts over
          attempt = event.attempt;
          tokens.replaceChildren();
          marks.d = marks.f = marks.t = 0;
        }
        if (name === "token") {
          event.tokens.forEach((id, i) => {
            const origin = (event.origin || "")[i] || "";
            const text = event.logprobs ? event.logprobs[i].text : (i === 0 ? event.text : "");
            if (origin) marks[origin] += 1;
            tokens.append(el("span", { class: `tok ${origin}`, "data-origin": origin, "data-token": id,
              title: `token ${id}: ${ORIGIN[origin] || "origin not reported"}`, text }));
          });
        } else if (name === "final" && event.telemetry) {
          telemetryTable(event.telemetry, marks);
          tokens.dataset.done = "true";
        } else if (name === "final") {
          note("#pg-note", `the job ended ${event.status}: ${event.error || ""}`, true);
        }
      });
  }

  async function send(event) {
    event.preventDefault();
    if (!mayCall()) {
      note("#pg-note", "Enter the API key first: the playground calls /v1/chat/completions with it.", true);
      return;
    }
    const reply = $("#pg-reply");
    reply.textContent = "";
    reply.dataset.done = "";
    $("#pg-tokens").replaceChildren();
    $("#pg-tokens").dataset.done = "";
    fillBody($("#pg-telemetry"), []);
    note("#pg-note", "streaming…");
    const body = {
      model: $("#pg-model").value, stream: true, logprobs: true,
      max_tokens: Number($("#pg-max").value) || 64,
      temperature: Number($("#pg-temp").value) || 0,
      messages: [{ role: "user", content: $("#pg-prompt").value }],
    };
    let job = null;
    try {
      await readSSE("/v1/chat/completions", {
        method: "POST", body: JSON.stringify(body),
        headers: { ...authHeaders(), "Content-Type": "application/json" },
      }, (name, data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (!job && chunk.id) {
          job = followJob(chunk.id.replace(/^chatcmpl-/, ""));
          reply.dataset.job = chunk.id.replace(/^chatcmpl-/, "");
        }
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) reply.textContent += delta.content;
      });
      if (job) await job;
      reply.dataset.done = "true";
      note("#pg-note", "");
    } catch (error) {
      note("#pg-note", `refused: ${error.message}`, true);
    }
  }

  // -- tabs and start ------------------------------------------------------------------------
  function route() {
    const [tab, arg] = location.hash.replace(/^#/, "").split("/");
    state.tab = ["fleet", "worker", "events", "batches", "playground"].includes(tab) ? tab : "fleet";
    for (const section of document.querySelectorAll(".tab")) section.hidden = section.id !== `tab-${state.tab}`;
    for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.tab === state.tab);
    if (state.tab === "worker" && arg) state.worker = decodeURIComponent(arg);
    if (state.tab === "batches" && arg) openBatch(decodeURIComponent(arg));
    if (state.tab === "fleet") renderFleet();
    if (state.tab === "worker" && state.fleet) { renderWorkerSelect(); renderWorker(); }
    if (state.tab === "events") renderEvents();
    if (state.tab === "batches") renderBatches();
  }

  function connect() {
    const source = new EventSource("/console/api/stream");
    source.addEventListener("fleet", (e) => onFleet(JSON.parse(e.data)));
    source.addEventListener("events", (e) => onEvents(JSON.parse(e.data)));
    source.addEventListener("failure", (e) => setLive(`Redis: ${JSON.parse(e.data).message}`, "bad"));
    source.addEventListener("error", () => setLive("reconnecting…", "bad"));
  }

  async function start() {
    const response = await fetch("/console/api/settings");
    state.keysRequired = response.ok && (await response.json()).keys_required;
    $("#key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const key = $("#api-key").value.trim();
      if (key) sessionStorage.setItem(KEY, key);
      $("#api-key").value = "";
      showKeyState();
      startBatches();
    });
    $("#key-forget").addEventListener("click", () => {
      sessionStorage.removeItem(KEY);
      showKeyState();
      if (state.batchStream) state.batchStream.abort();
      state.batchStream = null;
      note("#batches-note", "Read-only: no key. The list is as it was; actions are refused without a key.");
    });
    $("#worker-select").addEventListener("change", (e) => { location.hash = `#worker/${encodeURIComponent(e.target.value)}`; });
    for (const id of ["#filter-worker", "#filter-model", "#filter-kind"]) $(id).addEventListener("change", renderEvents);
    $("#pg-form").addEventListener("submit", send);
    window.addEventListener("hashchange", route);
    showKeyState();
    route();
    connect();
    startBatches();
  }

  start();
})();
