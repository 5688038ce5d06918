// The operator page: reads /v1/status once a second and draws it.
// Every string from the server goes in as text (textContent), never as HTML.
"use strict";

(function () {
  const KEY_STORE = "mlxserve-api-key";
  const POLL_MS = 1000;
  const ERRORS_SHOWN = 8;
  const SPAN_S = 15 * 60;
  const SVG = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);

  let samples = [];
  let lastT = 0;
  let timer = null;

  // -- numbers for people ----------------------------------------------------
  function count(n) {
    if (n === null || n === undefined) return "–";
    const a = Math.abs(n);
    if (a >= 1e9) return (n / 1e9).toFixed(1) + "G";
    if (a >= 1e6) return (n / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return Math.round(n / 1e3) + "k";
    if (a >= 1e3) return (n / 1e3).toFixed(1) + "k";
    if (a >= 100 || Number.isInteger(n)) return String(Math.round(n));
    return n.toFixed(1);
  }
  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
    return (i === 0 ? String(n) : n.toFixed(n >= 100 ? 0 : 1)) + " " + units[i];
  }
  function seconds(s) {
    if (s === null || s === undefined) return "–";
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
    if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
    return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
  }
  function ago(s) { return s < 1 ? "just now" : seconds(s) + " ago"; }
  function percent(x) { return x === null || x === undefined ? "–" : Math.round(x * 100) + "%"; }
  function rate(x) { return x === null || x === undefined ? "–" : count(x) + " tok/s"; }

  // -- DOM helpers (text only) -----------------------------------------------
  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }
  function setText(id, text) { $(id).textContent = text; }

  // -- fetching --------------------------------------------------------------
  function headers() {
    const key = sessionStorage.getItem(KEY_STORE);
    return key ? { Authorization: "Bearer " + key } : {};
  }

  async function poll() {
    timer = null;
    let response;
    try {
      response = await fetch("/v1/status?since=" + lastT, { headers: headers(), cache: "no-store" });
    } catch (e) {
      showHealth("unreachable", "unreachable");
      schedule();
      return;
    }
    if (response.status === 401) {
      askKey(sessionStorage.getItem(KEY_STORE) ? "That key was refused." : "");
      return;
    }
    if (!response.ok) {
      showHealth("unreachable", "HTTP " + response.status);
      schedule();
      return;
    }
    const doc = await response.json();
    $("key-form").hidden = true;
    $("main").hidden = false;
    $("forget-key").hidden = !sessionStorage.getItem(KEY_STORE);
    render(doc);
    schedule();
  }

  function schedule() {
    if (timer === null) timer = setTimeout(poll, POLL_MS);
  }

  function askKey(message) {
    $("main").hidden = true;
    $("models").replaceChildren();
    setText("uptime", "");
    setText("updated", "");
    showHealth("", "locked");
    $("key-form").hidden = false;
    setText("key-error", message);
    $("key-input").focus();
  }

  // -- rendering -------------------------------------------------------------
  function showHealth(cls, text) {
    const badge = $("health");
    badge.className = "badge " + cls;
    badge.textContent = text;
  }

  function render(doc) {
    const health = doc.health || { status: "ok" };
    let text = health.status;
    if (health.status === "loading" && health.progress !== undefined) text += " " + percent(health.progress);
    if (health.error) text += ": " + health.error;
    showHealth(health.status, text);
    setText("uptime", "up " + seconds(doc.uptime_s));
    setText("updated", "updated " + new Date(doc.time * 1000).toLocaleTimeString());
    renderModels(doc.models || []);
    renderTiles(doc);
    renderRequests(doc.requests || []);
    renderErrors(doc.errors || [], doc.time, doc.errors_total || 0);
    const history = doc.history;
    if (history && history.samples.length) {
      samples = samples.concat(history.samples).filter((s) => s.t > doc.time - SPAN_S);
      lastT = samples[samples.length - 1].t;
    }
    renderCharts(doc.time);
  }

  function renderModels(models) {
    const items = models.map((m) => {
      const li = el("li");
      li.append(el("span", m.name, "name"));
      const parts = [m.family, quantText(m.quantization), m.weight_bytes ? bytes(m.weight_bytes) : null];
      if (m.state !== "ok") parts.push(m.state);
      if (m.aliases && m.aliases.length) parts.push("also " + m.aliases.join(", "));
      li.append(el("span", " " + parts.filter(Boolean).join(" · "), "muted"));
      return li;
    });
    $("models").replaceChildren(...items);
  }

  function quantText(q) {
    if (!q) return null;
    return (q.bits ? q.bits + "-bit" : "quantized") + (q.mode ? " " + q.mode : "");
  }

  function renderTiles(doc) {
    const engine = doc.engine || {};
    const memory = doc.memory || {};
    const cache = doc.prefix_cache || {};
    const spec = doc.speculation || {};
    setText("t-rate", rate(engine.tokens_per_s));
    setText("t-flight", count((doc.requests || []).length));
    setText("t-waiting", count(engine.queue_length));
    setText("t-kv", bytes(memory.kv_used_bytes));
    setText("t-kv-budget", "of " + bytes(memory.kv_budget_bytes) + " (" + percent(memory.kv_used_ratio) + ")");
    setText("t-hits", cache.enabled ? percent(cache.hit_ratio) : "off");
    setText("t-step", engine.step_ms ? engine.step_ms.toFixed(1) + " ms" : "–");
    setText("t-spec", spec.enabled ? percent(spec.acceptance) + " accepted" : "off");
  }

  function renderRequests(requests) {
    const rows = requests
      .slice()
      .sort((a, b) => b.age_s - a.age_s)
      .map((r) => {
        const tr = el("tr");
        tr.dataset.id = r.id;
        tr.dataset.state = r.state;
        const id = el("td", r.id.length > 18 ? r.id.slice(0, 17) + "…" : r.id, "id");
        id.title = r.id;
        tr.append(id);
        const state = el("td");
        state.append(el("span", r.state, "state " + r.state));
        if (r.prefill && r.state === "prefilling") {
          const bar = el("progress");
          bar.max = 1;
          bar.value = r.prefill.fraction;
          bar.setAttribute("aria-label", "prefill progress");
          state.append(bar, el("span", " " + percent(r.prefill.fraction), "muted prefill-text"));
        }
        tr.append(state);
        tr.append(el("td", count(r.prompt_tokens), "num"));
        tr.append(el("td", count(r.cached_tokens), "num"));
        tr.append(el("td", count(r.generated_tokens), "num"));
        tr.append(el("td", seconds(r.ttft_s), "num"));
        tr.append(el("td", rate(r.tokens_per_s), "num"));
        tr.append(el("td", seconds(r.age_s), "num"));
        tr.append(el("td", r.model));
        tr.append(el("td", r.dialect, "muted"));
        const agent = el("td", r.user_agent || "–", "agent");
        agent.title = r.user_agent || "";
        tr.append(agent);
        return tr;
      });
    $("requests").tBodies[0].replaceChildren(...rows);
    $("requests-empty").hidden = rows.length > 0;
    setText("requests-count", rows.length ? "(" + rows.length + ")" : "");
  }

  function renderErrors(errors, now, total) {
    const rows = errors.slice(0, ERRORS_SHOWN).map((e) => {
      const tr = el("tr");
      tr.append(el("td", ago(now - e.time)));
      tr.append(el("td", e.route));
      tr.append(el("td", e.status, "num status-" + String(e.status)[0]));
      tr.append(el("td", e.message, "wrap"));
      return tr;
    });
    $("errors").tBodies[0].replaceChildren(...rows);
    $("errors-empty").hidden = rows.length > 0;
    const shown = rows.length < total ? "latest " + rows.length + " of " + count(total) : count(total);
    setText("errors-count", total ? "(" + shown + " since start)" : "");
  }

  // -- charts: hand-made SVG ---------------------------------------------------
  function renderCharts(now) {
    const pick = (key) => samples.map((s) => [s.t, s[key]]);
    chart("c-rate", now, [pick("tokens_per_s")], { format: count });
    chart("c-load", now, [pick("in_flight"), pick("waiting")], { format: count });
    chart("c-hits", now, [pick("hit_ratio")], { format: percent, max: 1 });
    chart("c-kv", now, [pick("kv_used_bytes"), pick("kv_budget_bytes")], { format: bytes, dashed: true });
    chart("c-ttft", now, [pick("ttft_p50_s"), pick("ttft_p95_s")], { format: seconds });
  }

  function chart(id, now, series, opts) {
    const svg = $(id);
    const W = 320, H = 130, left = 46, right = 6, top = 8, bottom = 18;
    const values = series.flat().map((p) => p[1]).filter((v) => v !== null && v !== undefined);
    let max = opts.max || Math.max(0, ...values);
    if (!opts.max) max = max > 0 ? max * 1.1 : 1;
    const x = (t) => left + ((t - (now - SPAN_S)) / SPAN_S) * (W - left - right);
    const y = (v) => top + (1 - v / max) * (H - top - bottom);
    const nodes = [];
    for (const frac of [0, 0.5, 1]) {
      const line = document.createElementNS(SVG, "line");
      line.setAttribute("x1", left); line.setAttribute("x2", W - right);
      line.setAttribute("y1", y(max * frac)); line.setAttribute("y2", y(max * frac));
      line.setAttribute("class", "grid");
      nodes.push(line, label(opts.format(max * frac), left - 4, y(max * frac) + 3, "end"));
    }
    nodes.push(label("15 min ago", left, H - 4, "start"), label("now", W - right, H - 4, "end"));
    series.forEach((data, i) => {
      for (const run of runs(data)) {
        const line = document.createElementNS(SVG, "polyline");
        line.setAttribute("points", run.map(([t, v]) => x(t).toFixed(1) + "," + y(v).toFixed(1)).join(" "));
        line.setAttribute("class", "s" + i + (i === 1 && opts.dashed ? " dashed" : ""));
        nodes.push(line);
      }
    });
    svg.replaceChildren(...nodes);
    const first = series[0].filter((p) => p[1] !== null && p[1] !== undefined);
    svg.dataset.points = String(first.length);
    if (!svg.dataset.title) svg.dataset.title = svg.getAttribute("aria-label");
    const latest = first.length ? opts.format(first[first.length - 1][1]) : "no data yet";
    svg.setAttribute("aria-label", svg.dataset.title + ": latest " + latest);
  }

  // Consecutive non-null points (a null value breaks the line).
  function runs(data) {
    const out = [];
    let current = [];
    for (const p of data) {
      if (p[1] === null || p[1] === undefined) {
        if (current.length) out.push(current);
        current = [];
      } else {
        current.push(p);
      }
    }
    if (current.length) out.push(current);
    return out.map((r) => (r.length === 1 ? [r[0], [r[0][0] + 0.5, r[0][1]]] : r));
  }

  function label(text, x, y, anchor) {
    const node = document.createElementNS(SVG, "text");
    node.setAttribute("x", x);
    node.setAttribute("y", y);
    node.setAttribute("text-anchor", anchor);
    node.setAttribute("class", "axis");
    node.textContent = text;
    return node;
  }

  // -- the key ---------------------------------------------------------------
  function start() {
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY_STORE, $("key-input").value);
      $("key-input").value = "";
      setText("key-error", "");
      if (timer !== null) { clearTimeout(timer); timer = null; }
      poll();
    });
    $("forget-key").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_STORE);
      if (timer !== null) { clearTimeout(timer); timer = null; }
      poll();
    });
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
