// Overview: refreshes the history charts (charts.js), the summary, the kernels and node health
// panels and the rollback banner, all from this console.
(function () {
  "use strict";
  const chartsEl = document.getElementById("charts");
  const intervalMs = Math.max(1, Number(chartsEl.dataset.interval) || 2) * 1000;
  const windowSelect = document.getElementById("window");
  const charts = window.DgppCharts.all();

  const modelSelect = document.getElementById("chart-model");

  // The side models the history holds, as choices beside the main model (the chosen one kept).
  function offerModels(models) {
    const known = Array.from(modelSelect.options).map(function (option) { return option.value; });
    (models || []).forEach(function (name) {
      if (known.indexOf(name) < 0) {
        const option = document.createElement("option");
        option.value = name;
        option.textContent = "side model " + name;
        modelSelect.appendChild(option);
      }
    });
  }

  async function refreshHistory() {
    try {
      const query = "window_s=" + windowSelect.value + "&model=" + encodeURIComponent(modelSelect.value);
      const response = await fetch("/api/history?" + query, { credentials: "same-origin" });
      if (response.status === 401) { window.location.assign("/login?next=%2F"); return; }
      if (response.ok) {
        const history = await response.json();
        offerModels(history.models);
        charts.forEach(function (chart) { chart.draw(history); });
      }
    } catch (err) { /* the next refresh tries again */ }
  }

  function field(data, path) {
    return path.split(".").reduce(function (value, key) { return value == null ? null : value[key]; }, data);
  }

  function text(value) {
    if (value == null) return "unavailable";
    if (Array.isArray(value)) return value.map(function (v) { return typeof v === "number" ? v.toFixed(2) : v; }).join(" ");
    if (typeof value === "number" && !Number.isInteger(value)) return value.toFixed(0);
    return String(value);
  }

  function duration(seconds) {
    if (seconds == null) return "-";
    seconds = Math.floor(seconds);
    const h = Math.floor(seconds / 3600), m = Math.floor((seconds % 3600) / 60), s = seconds % 60;
    return h ? h + "h " + m + "m" : m ? m + "m " + s + "s" : s + "s";
  }

  function cell(row, value, className) {
    const td = document.createElement("td");
    td.textContent = value;
    if (className) td.className = className;
    row.appendChild(td);
  }

  // One row per node, from the summary the console computed (`node_view`).
  function renderNodes(data) {
    document.getElementById("nodes-source").textContent =
      data.nodes_source === "local" ? "This node only: the engine does not answer." : "";
    const body = document.querySelector("#nodes tbody");
    body.replaceChildren();
    data.nodes.forEach(function (node) {
      const s = node.summary, row = document.createElement("tr");
      cell(row, node.rank == null ? "-" : node.rank); cell(row, node.hostname || "-");
      const gpus = document.createElement("td");
      gpus.className = "gpus";
      s.gpus.forEach(function (line) {
        const div = document.createElement("div");
        div.textContent = line;
        if (!(node.gpu && node.gpu.available)) div.className = "unavailable";
        gpus.appendChild(div);
      });
      row.appendChild(gpus);
      cell(row, s.cpu_freq); cell(row, s.governor); cell(row, s.load); cell(row, s.busy);
      cell(row, duration(node.age_s));
      body.appendChild(row);
    });
  }

  function rows(selector, items, build) {
    const body = document.querySelector(selector + " tbody");
    body.replaceChildren();
    items.forEach(function (item) { body.appendChild(build(item)); });
  }

  // Rank 0's kernel self-check and all-reduce figures (`kernels_view`): a fallback's row is a
  // warning with its reason and what it costs.
  function renderKernels(k) {
    document.getElementById("kernels-note").textContent = k.note;
    document.getElementById("kernels").hidden = k.kernels.length === 0;
    rows("#kernels", k.kernels, function (kernel) {
      const row = document.createElement("tr");
      row.className = "kernel-" + kernel.state;
      cell(row, kernel.name); cell(row, kernel.state); cell(row, kernel.reason);
      if (kernel.is_fallback) {
        const hint = document.createElement("div");
        hint.className = "note";
        hint.textContent = k.hint;
        row.lastChild.appendChild(hint);
      }
      return row;
    });
    document.getElementById("kernel-cases").hidden = k.cases.length === 0;
    rows("#kernel-cases", k.cases, function (c) {
      const row = document.createElement("tr");
      if (!c.passed) row.className = "kernel-fallback";
      [c.kernel, c.label, c.dtype, c.seconds, c.error, c.failure].forEach(function (v) { cell(row, v); });
      return row;
    });
    document.getElementById("allreduce").hidden = k.allreduce.length === 0;
    rows("#allreduce", k.allreduce, function (a) {
      const row = document.createElement("tr");
      cell(row, a.size); cell(row, a.time); cell(row, a.bus);
      return row;
    });
  }

  // This node's `dgpp doctor` findings (GET /api/doctor, which keeps them a minute).
  // Requests by priority and the agent sessions (`traffic_view`), as the template draws them.
  function renderTraffic(data) {
    rows("#priorities", data.priorities || [], function (p) {
      const row = document.createElement("tr");
      [p.priority, p.waiting, p.running, p.requests, p.queue, p.ttft, p.itl].forEach(function (v) { cell(row, v); });
      return row;
    });
    document.getElementById("sessions-note").textContent = data.sessions_note || "";
    document.getElementById("sessions").hidden = !(data.sessions || []).length;
    rows("#sessions", data.sessions || [], function (s) {
      const row = document.createElement("tr");
      [s.id, s.seen, s.held, s.requests, s.hit_rate].forEach(function (v) { cell(row, v); });
      return row;
    });
  }

  function renderHealth(report) {
    const failing = report.checks.filter(function (c) { return c.status === "warn" || c.status === "fail"; });
    document.getElementById("node-health-summary").textContent = report.hostname + ": " + report.status +
      (failing.length ? ", " + failing.length + (failing.length === 1 ? " finding" : " findings") + " to act on" : "") + ", checked " +
      new Date(report.time * 1000).toLocaleTimeString();
    document.getElementById("node-health").hidden = false;
    rows("#node-health", report.checks, function (check) {
      const row = document.createElement("tr"), badge = document.createElement("span");
      badge.className = "check check-" + check.status;
      badge.textContent = check.label;
      const status = document.createElement("td");
      status.appendChild(badge);
      row.appendChild(status);
      cell(row, check.name); cell(row, check.detail); cell(row, check.fix);
      return row;
    });
  }

  async function refreshHealth(fresh) {
    try {
      const response = await fetch("/api/doctor" + (fresh ? "?fresh=true" : ""), { credentials: "same-origin" });
      if (response.ok) { renderHealth(await response.json()); }
    } catch (err) { /* the next refresh tries again */ }
  }

  // Shown while the last switch that ended was not kept (`rollback` of /api/overview).
  function renderBanner(rollback) {
    const banner = document.getElementById("rollback-banner");
    banner.hidden = rollback == null;
    if (rollback == null) return;
    banner.querySelector("[data-banner=title]").textContent = rollback.title;
    banner.querySelector("[data-banner=phase]").textContent = rollback.phase;
    banner.querySelector("[data-banner=reason]").textContent = rollback.reason;
  }

  function render(data) {
    renderBanner(data.rollback);
    document.querySelectorAll("[data-field]").forEach(function (el) {
      const value = field(data, el.dataset.field);
      el.textContent = value == null ? (el.dataset.empty || "unavailable") : text(value);
    });
    // A chart's empty caption that depends on the engine (speculative decoding on or off).
    charts.forEach(function (chart) {
      const empty = chart.el.dataset.emptyField ? field(data, chart.el.dataset.emptyField) : null;
      if (empty != null) chart.el.dataset.empty = empty;
    });
    const state = document.getElementById("health-state");
    state.className = "state state-" + data.health.state;
    document.getElementById("health-reason").textContent = data.health.serving ? "" : data.health.reason;
    const body = document.querySelector("#ranks tbody");
    body.replaceChildren();
    data.ranks.forEach(function (rank) {
      const row = document.createElement("tr");
      cell(row, rank.rank); cell(row, rank.state, "state state-" + rank.state);
      cell(row, rank.pid || "-"); cell(row, duration(rank.uptime_s)); cell(row, rank.detail);
      body.appendChild(row);
    });
    renderNodes(data);
    renderKernels(data.kernels);
    renderTraffic(data);
    const warnings = document.getElementById("warnings");
    warnings.replaceChildren();
    data.warnings.forEach(function (message) {
      const p = document.createElement("p");
      p.className = "warning";
      p.textContent = message;
      warnings.appendChild(p);
    });
  }

  async function refreshOverview() {
    try {
      const response = await fetch("/api/overview", { credentials: "same-origin" });
      if (response.ok) { render(await response.json()); }
    } catch (err) { /* the next refresh tries again */ }
  }

  windowSelect.addEventListener("change", refreshHistory);
  modelSelect.addEventListener("change", refreshHistory);
  document.getElementById("node-health-refresh").addEventListener("click", function () { refreshHealth(true); });
  refreshHealth(false);
  setInterval(function () { refreshHealth(false); }, 60000);
  window.addEventListener("resize", function () { charts.forEach(function (chart) { chart.resize(); }); });
  refreshHistory();
  setInterval(refreshHistory, intervalMs);
  setInterval(refreshOverview, Math.max(intervalMs, 3000));
})();
