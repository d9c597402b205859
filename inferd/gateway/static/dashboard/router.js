// inferd router page: reads /v1/dashboard/events (SSE over fetch) and draws the replica table
// and routing cards with plain DOM. Needs common.js only.
"use strict";

const OUTCOME_COLORS = {
  cache_hit: "#66c2a5", spill: "#fc8d62", cold: "#8da0cb", least_load: "#1f78b4",
  power_of_two: "#e78ac3", round_robin: "#a6d854", passthrough: "#b3b3b3",
};

const ms = (s) => (s === null || s === undefined ? "–" : (s * 1000).toFixed(s < 0.01 ? 3 : 1) + " ms");

function onOverview(o) {
  $("#policy").textContent = "policy " + o.policy;
  $("#window").textContent = `window ${o.window_s} s (covering ${o.span_s.toFixed(0)} s)`;
  drawCards(o);
  drawOutcomes(o.outcomes);
  drawReplicas(o.replicas);
}

function setCard(id, label, value) {
  let box = document.getElementById(id);
  if (!box) {
    box = el("div", { class: "card", id });
    box.append(el("div", { class: "label" }, label), el("div", { class: "value", "data-testid": id }));
    $("#cards").append(box);
  }
  box.querySelector(".value").textContent = value;
}

function drawCards(o) {
  const retries = Object.values(o.retries).reduce((a, b) => a + b, 0);
  setCard("r-rps", "requests/s", o.rps.toFixed(2));
  setCard("r-ready", "replicas in rotation", `${o.replicas_ready} / ${o.replicas.length}`);
  setCard("r-decision", "decision p50 / p99", `${ms(o.decision.p50)} / ${ms(o.decision.p99)}`);
  setCard("r-retries", "retries (window)", String(retries));
  setCard("r-noreplica", "503 no replica (window)", String(o.no_replica));
}

function drawOutcomes(outcomes) {
  const total = Object.values(outcomes).reduce((a, b) => a + b, 0);
  const stack = $("#outcomes");
  const legend = $("#outcomes-legend");
  stack.replaceChildren();
  legend.replaceChildren();
  for (const [name, n] of Object.entries(outcomes)) {
    const color = OUTCOME_COLORS[name] || "#ddd";
    const seg = el("span", { class: "seg", title: `${name}: ${n}` });
    seg.style.width = (100 * n) / total + "%";
    seg.style.background = color;
    stack.append(seg);
    const item = el("span", {}, `${name} ${n} (${pct(n / total)})`);
    const swatch = el("i");
    swatch.style.background = color;
    item.prepend(swatch);
    legend.append(item);
  }
  if (!total) legend.append(el("span", { class: "muted" }, "no requests in the window"));
}

function bar(fraction, cls, title) {
  const box = el("div", { class: "bar " + cls, title });
  const fill = el("i");
  fill.style.width = Math.min(Math.max(fraction || 0, 0), 1) * 100 + "%";
  box.append(fill);
  return box;
}

function drawReplicas(replicas) {
  const maxLoad = Math.max(1, ...replicas.map((r) => r.load_tokens));
  const body = $("#replicas tbody");
  body.replaceChildren();
  for (const r of replicas) {
    const tr = el("tr", { "data-replica": r.url });
    const link = el("a", { href: r.dashboard, target: "_blank", rel: "noopener" }, r.url);
    const state = el("td", { class: "state-" + r.state, title: r.reason || "" }, r.state);
    const rl = r.router_load;
    const rep = r.reported_load;
    const load = el("td", {
      title: `router: ${rl.prefill_tokens} prefill tokens pending, ${rl.in_flight} in flight; ` +
        `replica: ${rep.running} running, ${rep.waiting} waiting, ${rep.queued_prompt_tokens} queued prompt tokens`,
    }, String(r.load_tokens));
    load.append(bar(r.load_tokens / maxLoad, "load", "load relative to the busiest replica"));
    const hits = el("td", {}, `${pct(r.replica_hit_rate)} / ${pct(r.estimated_hit_rate)}`);
    hits.append(bar(r.replica_hit_rate, "hit", "replica-reported prefix-cache hit rate"),
      bar(r.estimated_hit_rate, "est", "the router's estimated hit rate"));
    const routed = el("td", { title: `${r.routed_total} since the router started` }, String(r.routed));
    const cell = el("td");
    cell.append(link);
    tr.append(cell, state, el("td", {}, String(r.in_flight)), load, routed, hits,
      el("td", {}, pct(rep.kv_cache_usage)), el("td", {}, String(r.index_blocks)),
      el("td", {}, String(r.ejections_total)));
    body.append(tr);
  }
}

streamEvents("/v1/dashboard/events", () => ({}), onOverview, () => setConn("closed", "unauthorized"));
