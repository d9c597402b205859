// inferd dashboard: reads /v1/dashboard/events (SSE over fetch, so an API key can ride along),
// /v1/requests and /v1/requests/{id}; draws with plain DOM and SVG. Needs common.js only.
"use strict";

const COLORS = {
  receive: "#8da0cb", validate: "#a6d854", tokenize: "#e5c494", preprocess: "#e5c494",
  lora_load: "#fdb462", queue: "#fc8d62", grammar: "#b2df8a", batch: "#ffd92f", prefill: "#66c2a5", decode: "#1f78b4",
  compute_input: "#b3b3b3", infer: "#1f78b4", compute_output: "#cab2d6",
  detokenize: "#e78ac3", postprocess: "#e78ac3", stream: "#b15928", other: "#dddddd",
  text_encode: "#e5c494", denoise: "#1f78b4", vae_decode: "#66c2a5", image_encode: "#e78ac3",
};
const LANE_NAMES = { llm: "LLM", classic: "classic", image: "image" };
// The waterfall row whose ticks mark the lane's units: output tokens, denoising steps.
const TICKED = { llm: "decode", image: "denoise" };
const HISTORY_S = 300;  // sparklines: the last five minutes of overview ticks
const history = {};      // card id -> [[t, value]]
let lastTotal = -1;
let openId = null;

const svgEl = (tag, attrs = {}) => {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
};
const ms = (s) => (s === null || s === undefined ? "–" : s < 1 ? (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms" : s.toFixed(2) + " s");
const num = (x, d = 1) => (x === null || x === undefined ? "n/a" : Number(x).toFixed(d));

function headers() {
  const key = sessionStorage.getItem("inferd-key");
  return key ? { Authorization: "Bearer " + key } : {};
}

async function getJSON(url) {
  const res = await fetch(url, { headers: headers() });
  if (res.status === 401) { askKey(); throw new Error("unauthorized"); }
  if (!res.ok) throw new Error(url + ": " + res.status);
  return res.json();
}

function askKey() {
  $("#keyform").hidden = false;
  setConn("closed", "API key needed");
}

// -- the live overview ---------------------------------------------------------------------------

function streamOverview() {
  return streamEvents("/v1/dashboard/events", headers, onOverview, askKey);
}

function onOverview(o) {
  $("#window").textContent = `window ${o.window_s} s · ${o.requests_total} requests seen`;
  if (o.lanes.llm) drawLLM(o.llm, o.time);
  if (o.lanes.classic || o.classic.requests > 0) drawClassic(o.classic, o.time);
  if (o.lanes.image || o.image.requests > 0) drawImage(o.image, o.time);
  drawStages("llm", o.llm);
  drawStages("classic", o.classic);
  drawStages("image", o.image);
  if (o.requests_total !== lastTotal) {
    lastTotal = o.requests_total;
    refreshRequests();
  }
}

// `series`: lines over the server's window (the overview's `series`: rate, or p99 then p50),
// drawn instead of the page's own history of `raw`.
function card(container, id, label, value, raw, t, series) {
  let box = document.getElementById(id);
  if (!box) {
    box = el("div", { class: "card", id });
    box.append(el("div", { class: "label" }, label), el("div", { class: "value", "data-testid": id }),
      svgEl("svg", { class: "spark", viewBox: "0 0 100 24", preserveAspectRatio: "none" }));
    container.append(box);
  }
  box.querySelector(".value").textContent = value;
  const h = (history[id] = history[id] || []);
  if (typeof raw === "number") h.push([t, raw]);
  while (h.length && t - h[0][0] > HISTORY_S) h.shift();
  const spark = box.querySelector(".spark");
  spark.replaceChildren();
  if (series) {
    spark.dataset.series = "window";
    drawSeries(spark, series);
  } else if (h.length > 1) {
    const max = Math.max(...h.map((p) => p[1])) || 1;
    const pts = h.map((p) => `${(100 * (p[0] - h[0][0])) / Math.max(t - h[0][0], 1)},${23 - (22 * p[1]) / max}`);
    spark.append(svgEl("polyline", { points: pts.join(" ") }));
  }
}

function drawSeries(svg, lines) {
  const all = lines.flat().filter((v) => v !== null && v !== undefined);
  if (!all.length) return;
  const max = Math.max(...all) || 1;
  lines.forEach((vals, k) => {
    let pts = [];
    const flush = () => {  // a lone point (one bucket with requests) becomes a short dash
      if (pts.length === 1) pts.push([pts[0][0] + 1.5, pts[0][1]]);
      if (pts.length) svg.append(svgEl("polyline", { points: pts.join(" "), class: k ? "second" : "first" }));
      pts = [];
    };
    vals.forEach((v, i) => {
      if (v === null || v === undefined) { flush(); return; }
      pts.push([(100 * i) / Math.max(vals.length - 1, 1), 23 - (22 * v) / max]);
    });
    flush();
  });
}

// A lane's series as card lines: its rate, and its latency's p99 (dark) over p50 (light).
const rateLine = (s) => s && [s.rate];
const latencyLines = (s) => s && [s.p99, s.p50];

function drawLLM(l, t) {
  $("#llm").hidden = false;
  $("#llm-model").textContent = l.model;
  const c = $("#llm-cards");
  const e = l.engine || {};
  card(c, "llm-rps", "requests/s", num(l.rps, 2), l.rps, t);
  card(c, "llm-tps", "output tokens/s", num(l.output_tps, 1), l.output_tps, t, rateLine(l.series));
  card(c, "llm-ttft", "TTFT p50 / p99", l.ttft ? `${ms(l.ttft.p50)} / ${ms(l.ttft.p99)}` : "–", l.ttft && l.ttft.p99, t,
    latencyLines(l.series));
  card(c, "llm-itl", "ITL p50 / p99", l.itl ? `${ms(l.itl.p50)} / ${ms(l.itl.p99)}` : "–", l.itl && l.itl.p99, t);
  card(c, "llm-e2e", "e2e p50 / p99", l.e2e ? `${ms(l.e2e.p50)} / ${ms(l.e2e.p99)}` : "–", l.e2e && l.e2e.p99, t);
  card(c, "llm-queue", "queue depth", num(e.queue_depth, 0), e.queue_depth, t);
  card(c, "llm-running", "running", num(e.running, 0), e.running, t);
  card(c, "llm-kv", "KV cache used", pct(e.kv_cache_usage), e.kv_cache_usage, t);
  card(c, "llm-prefix", "prefix-cache hits", pct(e.prefix_cache_hit_rate), e.prefix_cache_hit_rate, t);
  card(c, "llm-preempt", "preemptions (total)", num(e.preemptions_total, 0), e.preemptions_total, t);
  const acc = e.spec_decode_acceptance_rate;
  card(c, "llm-spec", "draft tokens accepted", pct(acc), acc, t);
  card(c, "llm-failed", "failed (window)", num(l.failed, 0), l.failed, t);
  $("#llm-bound").textContent = verdict(l.stage_seconds, ["queue", "prefill", "decode"]);
}

function drawClassic(k, t) {
  $("#classic").hidden = false;
  const c = $("#classic-cards");
  card(c, "classic-rps", "requests/s", num(k.rps, 2), k.rps, t, rateLine(k.series));
  card(c, "classic-e2e", "e2e p50 / p99", k.e2e ? `${ms(k.e2e.p50)} / ${ms(k.e2e.p99)}` : "–", k.e2e && k.e2e.p99, t,
    latencyLines(k.series));
  card(c, "classic-failed", "failed (window)", num(k.failed, 0), k.failed, t);
  const body = $("#classic-models tbody");
  body.replaceChildren();
  for (const [name, m] of Object.entries(k.models)) {
    const tr = el("tr", { "data-model": name });
    const split = m.queue_s + m.compute_s;
    const bar = el("div", { class: "split", title: `queue ${ms(m.queue_s)} · compute ${ms(m.compute_s)}` });
    if (split > 0) {
      bar.append(el("span", { class: "q", style: `width:${(100 * m.queue_s) / split}%` }),
        el("span", { class: "c", style: `width:${(100 * m.compute_s) / split}%` }));
    }
    const cells = [name, m.requests, m.failed, ms(m.e2e && m.e2e.p50), ms(m.e2e && m.e2e.p99),
      num(m.batch_rows, 2), pct(m.padding_ratio)];
    for (const v of cells) tr.append(el("td", {}, String(v)));
    const td = el("td");
    td.append(bar);
    tr.append(td);
    body.append(tr);
  }
  $("#classic-bound").textContent = verdict(k.stage_seconds, ["queue", "batch", "infer"]);
}

function drawImage(m, t) {
  $("#image").hidden = false;
  $("#image-models").textContent = m.models.join(", ");
  const c = $("#image-cards");
  const e = m.engine || {};
  const pair = (p) => (p ? `${ms(p.p50)} / ${ms(p.p99)}` : "–");
  card(c, "image-ips", "images/s", num(m.images_per_s, 2), m.images_per_s, t, rateLine(m.series));
  card(c, "image-steps", "denoising steps/s", num(m.steps_per_s, 1), m.steps_per_s, t);
  card(c, "image-rows", "rows per UNet forward", num(m.rows_per_forward, 1), m.rows_per_forward, t);
  card(c, "image-queue", "queue p50 / p99", pair(m.queue), m.queue && m.queue.p99, t);
  card(c, "image-e2e", "e2e p50 / p99", pair(m.e2e), m.e2e && m.e2e.p99, t, latencyLines(m.series));
  card(c, "image-running", "running", num(e.running, 0), e.running, t);
  card(c, "image-waiting", "queue depth", num(e.waiting, 0), e.waiting, t);
  card(c, "image-failed", "failed (window)", num(m.failed, 0), m.failed, t);
  $("#image-bound").textContent = verdict(m.stage_seconds, ["queue", "text_encode", "denoise", "vae_decode", "image_encode"]);
}

function verdict(seconds, candidates) {
  const total = Object.values(seconds).reduce((a, b) => a + b, 0);
  if (!total) return "";
  const top = candidates.reduce((a, b) => ((seconds[b] || 0) > (seconds[a] || 0) ? b : a));
  return `${top}-bound (${((100 * (seconds[top] || 0)) / total).toFixed(0)} % of the time)`;
}

function drawStages(lane, l) {
  const box = document.getElementById("stages-" + lane);
  const total = Object.values(l.stage_seconds).reduce((a, b) => a + b, 0);
  if (!total) return;
  box.hidden = false;
  box.replaceChildren(el("div", { class: "lane-name" }, LANE_NAMES[lane]));
  const bar = el("div", { class: "stack" });
  const legend = el("div", { class: "legend" });
  for (const stage of l.stage_order) {
    const s = l.stage_seconds[stage];
    if (!s) continue;
    const share = (100 * s) / total;
    const help = (l.stage_help || {})[stage] || "time no stage covers";
    bar.append(el("span", { class: "seg", "data-stage": stage, title: `${stage}: ${share.toFixed(1)} % — ${help}`,
      style: `width:${share}%;background:${COLORS[stage] || "#999"}` }));
    const item = el("span", { class: "item", "data-stage": stage, title: help });
    item.append(el("i", { style: `background:${COLORS[stage] || "#999"}` }), `${stage} ${share.toFixed(1)} % (${ms(s)})`);
    legend.append(item);
  }
  box.append(bar, legend);
}

// -- recent requests and the waterfall -----------------------------------------------------------

async function refreshRequests() {
  const q = new URLSearchParams({ limit: "50" });
  if ($("#f-model").value) q.set("model", $("#f-model").value);
  if ($("#f-status").value) q.set("status", $("#f-status").value);
  if ($("#f-order").value) q.set("slowest", "1");
  let rows;
  try { rows = (await getJSON("/v1/requests?" + q)).data; } catch (err) { console.warn(err); return; }
  const models = new Set([...$("#f-model").options].map((o) => o.value));
  const body = $("#req-table tbody");
  body.replaceChildren();
  for (const r of rows) {
    if (!models.has(r.model)) { models.add(r.model); $("#f-model").append(el("option", {}, r.model)); }
    const tr = el("tr", { class: "req" + (r.failed ? " failed" : ""), "data-id": r.request_id, "data-e2e": r.e2e });
    const cells = [r.arrival.slice(11, 23), r.request_id, r.lane, r.model, r.lora || "", r.status, ms(r.e2e), ms(r.ttft),
      r.lane === "image" ? `${r.images} img` : r.output_tokens || "", r.error || ""];
    for (const v of cells) tr.append(el("td", {}, String(v)));
    tr.addEventListener("click", () => openRequest(r.request_id));
    body.append(tr);
  }
}

async function openRequest(id) {
  openId = id;
  let doc;
  try { doc = await getJSON("/v1/requests/" + encodeURIComponent(id)); } catch (err) { console.warn(err); return; }
  const box = $("#waterfall");
  box.hidden = false;
  box.dataset.e2e = doc.e2e;
  box.dataset.lane = doc.lane;
  box.dataset.tokens = doc.output_tokens;
  $("#wf-id").textContent = doc.request_id;
  const meta = [`${doc.lane} · ${doc.model}` + (doc.lora ? ` · ${doc.lane === "image" ? "style" : "adapter"} ${doc.lora}` : ""), `status ${doc.status}`, `e2e ${ms(doc.e2e)}`];
  const own = {};
  for (const p of doc.path) if (p.stage !== "other") own[p.stage] = (own[p.stage] || 0) + p.seconds;
  const top = Object.entries(own).sort((a, b) => b[1] - a[1])[0];
  if (top) meta.push(`mostly ${top[0]} (${((100 * top[1]) / Math.max(doc.e2e, 1e-9)).toFixed(0)} %)`);
  if (doc.ttft !== null) meta.push(`TTFT ${ms(doc.ttft)}`);
  if (doc.lane === "image") meta.push(`${doc.images} images · ${doc.output_tokens} steps`);
  else if (doc.output_tokens) meta.push(`${doc.output_tokens} tokens`);
  if (doc.num_preemptions) meta.push(`${doc.num_preemptions} preemptions`);
  if (doc.batch_size) meta.push(`batch of ${doc.batch_size}`);
  if (doc.trace_id) meta.push(`trace ${doc.trace_id}`);
  $("#wf-meta").textContent = meta.join(" · ");
  const mates = $("#wf-mates");  // classic models: the other requests of its batch, clickable
  const ids = doc.batch_mates || [];
  mates.hidden = ids.length === 0;
  mates.replaceChildren(...(ids.length ? ["batch mates: "] : []));
  ids.forEach((mate, i) => {
    const a = document.createElement("a");
    a.href = "#";
    a.textContent = mate;
    a.addEventListener("click", (ev) => { ev.preventDefault(); openRequest(mate); });
    mates.append(...(i ? [", ", a] : [a]));
  });
  const preview = $("#wf-preview");  // image requests: a thumbnail of the first image
  preview.hidden = !doc.preview;
  if (doc.preview) preview.src = doc.preview; else preview.removeAttribute("src");
  const err = $("#wf-error");
  err.hidden = !doc.error;
  err.textContent = doc.error ? "error: " + doc.error : "";
  drawWaterfall(doc);
  box.scrollIntoView({ block: "nearest" });
}

function drawWaterfall(doc) {
  const svg = $("#wf-svg");
  const W = 900, left = 110, right = 70, rowH = 22, top = 24;
  const rows = doc.stages.length + 1;
  const H = top + rows * rowH + 24;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const span = Math.max(doc.e2e, 1e-9);
  const x = (s) => left + ((W - left - right) * s) / span;
  for (let i = 0; i <= 4; i++) {  // time axis
    const s = (span * i) / 4;
    svg.append(svgEl("line", { x1: x(s), x2: x(s), y1: top - 6, y2: H - 20, class: "axis" }));
    const label = svgEl("text", { x: x(s), y: H - 6, "text-anchor": "middle", class: "tick-label" });
    label.textContent = ms(s);
    svg.append(label);
  }
  const rowLabel = (y, text) => {
    const t = svgEl("text", { x: left - 6, y: y + 15, "text-anchor": "end" });
    t.textContent = text;
    svg.append(t);
  };
  rowLabel(top, "path (e2e)");
  for (const p of doc.path) {
    const r = svgEl("rect", { x: x(p.start), y: top + 3, width: Math.max(x(p.start + p.seconds) - x(p.start), 0.5),
      height: rowH - 6, fill: COLORS[p.stage] || "#999", class: "path-seg", "data-stage": p.stage, "data-seconds": p.seconds });
    r.append(Object.assign(svgEl("title"), { textContent: `${p.stage}: ${ms(p.seconds)}` }));
    svg.append(r);
  }
  doc.stages.forEach((st, i) => {
    const y = top + (i + 1) * rowH;
    rowLabel(y, st.stage);
    const r = svgEl("rect", { x: x(st.start), y: y + 3, width: Math.max(x(st.start + st.seconds) - x(st.start), 1),
      height: rowH - 6, fill: COLORS[st.stage] || "#999", class: "stage-bar", "data-stage": st.stage });
    r.append(Object.assign(svgEl("title"), { textContent: `${st.stage}: ${ms(st.seconds)} at +${ms(st.start)} — ${st.help}` }));
    svg.append(r);
    const v = svgEl("text", { x: Math.min(x(st.start + st.seconds) + 4, W - right + 4), y: y + 15, class: "dur" });
    v.textContent = ms(st.seconds);
    svg.append(v);
    if (st.stage === TICKED[doc.lane]) {
      for (const t of doc.token_ticks) {
        svg.append(svgEl("line", { x1: x(t), x2: x(t), y1: y + 1, y2: y + rowH - 1, class: "token-tick" }));
      }
    }
  });
}

// -- wiring ----------------------------------------------------------------------------------------

$("#keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("inferd-key", $("#key").value);
  $("#keyform").hidden = true;
  streamOverview();
});
for (const id of ["#f-model", "#f-status", "#f-order"]) $(id).addEventListener("change", refreshRequests);
$("#wf-close").addEventListener("click", () => { $("#waterfall").hidden = true; openId = null; });
streamOverview();
