// History charts (uPlot): one per `.chart` element, configured by its data attributes:
//   data-series / data-labels  the history columns and their legend names
//   data-unit                  appended to legend values; data-percent: fractions shown as %
//   data-range="lo,hi"         a fixed y range; data-log: a log y scale
//   data-scales="y,y2"         each series' y scale; a second scale gets the right-hand axis
//   data-axis-labels           one label per y scale, in the order the scales first appear
//   data-divisor               values are divided by it first (bytes -> GiB)
//   data-pairs                 series come in (p50, p95) pairs: one colour, p50 dashed
//   data-capacity              a column whose latest value the title names (KV token capacity)
// The x axis is the window asked for, [now - window, now], whatever the data covers; the chart
// element carries it as data-x-min / data-x-max (epoch seconds), the number of non-empty values
// as data-points and the switch markers drawn as data-markers.
(function () {
  "use strict";
  const colours = ["#2563eb", "#dc6803", "#067647", "#7a5af8", "#b42318", "#0e9384"];
  const markerColours = { "ready": "#067647", "rolled back": "#b42318", "failed": "#b42318" };

  function list(text) { return text ? text.split(",") : []; }

  function format(chart, v) {
    if (v == null) return "-";
    if (chart.percent) return (v * 100).toFixed(1) + "%";
    const text = Math.abs(v) >= 1000 ? v.toFixed(0) : String(+v.toPrecision(3));
    return chart.unit ? text + " " + chart.unit : text;
  }

  function tick(chart, v) {
    if (v == null) return "";
    return chart.percent ? (v * 100).toFixed(0) + "%" : String(+v.toPrecision(4));
  }

  function colourOf(chart, i) {
    return colours[(chart.pairs ? Math.floor(i / 2) : i) % colours.length];
  }

  // Each switch as a dashed vertical line with its outcome and title at the top.
  function markers(chart) {
    function draw(u) {
      const x = u.scales.x;
      chart.el.dataset.xMin = String(Math.round(x.min));
      chart.el.dataset.xMax = String(Math.round(x.max));
      const ratio = uPlot.pxRatio, ctx = u.ctx, box = u.bbox;
      let drawn = 0;
      ctx.save();
      ctx.font = Math.round(11 * ratio) + "px system-ui, sans-serif";
      ctx.textBaseline = "top";
      chart.events.forEach(function (event) {
        if (x.min == null || event.at < x.min || event.at > x.max) return;
        const pos = Math.round(u.valToPos(event.at, "x", true));
        const colour = markerColours[event.phase] || "#b54708";
        ctx.strokeStyle = ctx.fillStyle = colour;
        ctx.lineWidth = ratio;
        ctx.setLineDash([4 * ratio, 3 * ratio]);
        ctx.beginPath();
        ctx.moveTo(pos, box.top);
        ctx.lineTo(pos, box.top + box.height);
        ctx.stroke();
        const right = pos > box.left + box.width / 2;  // the label stays inside the plot
        // Short labels ("#3 rolled back"; the History page has the rest), on three staggered
        // rows so that switches minutes apart stay readable on a day's axis.
        const label = "#" + event.id + " " + event.phase;
        ctx.textAlign = right ? "right" : "left";
        ctx.fillText(label, pos + (right ? -4 : 4) * ratio, box.top + (2 + 13 * (drawn % 3)) * ratio);
        drawn += 1;
      });
      ctx.restore();
      chart.el.dataset.markers = String(drawn);
    }
    return { hooks: { draw: [draw] } };
  }

  // Legend values: the sample under the cursor while it is over the plot, else the latest one.
  function showLatest(u) {
    const count = u.data[0].length;
    if (count > 0 && u.cursor.left < 0) u.setLegend({ idx: count - 1 }, false);
  }

  function options(chart) {
    const scaleKeys = [];
    const series = [{}].concat(chart.keys.map(function (key, i) {
      const scale = chart.scales[i] || "y";
      if (scaleKeys.indexOf(scale) < 0) scaleKeys.push(scale);
      return { label: chart.labels[i] || key, scale: scale, stroke: colourOf(chart, i), width: 1.5,
               dash: chart.pairs && i % 2 === 0 ? [5, 4] : undefined, spanGaps: false,
               // Off the plot, an interval with no observation shows the latest value known.
               value: function (u, v, si) {
                 return format(chart, v == null && u.cursor.left < 0 ? latest(u.data[si]) : v);
               } };
    }));
    if (scaleKeys.length === 0) scaleKeys.push("y");
    const scales = { x: { time: true, range: function () { return chart.xRange; } } };
    const axes = [{}];
    scaleKeys.forEach(function (scale, n) {
      scales[scale] = chart.range ? { range: chart.range } : chart.percent ? { range: [0, 1] } : chart.log ? { distr: 3 } : {};
      const axis = { scale: scale, size: 60, side: n === 0 ? 3 : 1,
                     values: function (u, ticks) { return ticks.map(function (v) { return tick(chart, v); }); } };
      if (n > 0) axis.grid = { show: false };
      if (chart.axisLabels[n]) {
        axis.label = chart.axisLabels[n];
        if (scaleKeys.length > 1) axis.stroke = colourOf(chart, chart.scales.indexOf(scale));
      }
      axes.push(axis);
    });
    return { title: chart.title, width: Math.max(300, chart.el.clientWidth - 10), height: 200,
             series: series, scales: scales, axes: axes, plugins: [markers(chart)],
             hooks: { setCursor: [showLatest] } };
  }

  function caption(chart, text) {
    if (!chart.caption) {
      chart.caption = document.createElement("p");
      chart.caption.className = "caption";
      chart.el.appendChild(chart.caption);
    }
    chart.caption.textContent = text;
  }

  function latest(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] != null) return values[i];
    return null;
  }

  function titled(chart, series) {
    if (!chart.capacity) return chart.title;
    const total = latest(series[chart.capacity] || []);
    return total == null ? chart.title : chart.title + " of " + Math.round(total).toLocaleString("en") + " tokens";
  }

  function Chart(el) {
    const d = el.dataset;
    this.el = el;
    this.keys = list(d.series);
    this.labels = list(d.labels);
    this.scales = list(d.scales);
    this.axisLabels = list(d.axisLabels);
    this.title = d.title;
    this.unit = d.unit || "";
    this.percent = d.percent === "true";
    this.log = d.log === "true";
    this.pairs = d.pairs === "true";
    this.range = d.range ? list(d.range).map(Number) : null;
    this.divisor = Number(d.divisor) || 1;
    this.capacity = d.capacity || "";
    this.events = [];
    this.xRange = [null, null];
    this.plot = null;
    this.caption = null;
  }

  // `history` is /api/history's body: {window_s, now, series, events}.
  Chart.prototype.draw = function (history) {
    const chart = this, series = history.series, divisor = chart.divisor;
    chart.xRange = [history.now - history.window_s, history.now];
    chart.events = history.events || [];
    const data = [series.ts || []].concat(chart.keys.map(function (key) {
      return (series[key] || []).map(function (v) { return v == null ? null : v / divisor; });
    }));
    if (chart.plot === null) {
      chart.plot = new uPlot(options(chart), data, chart.el);
    } else {
      chart.plot.setData(data, false);
    }
    chart.plot.setScale("x", { min: chart.xRange[0], max: chart.xRange[1] });
    chart.el.dataset.xMin = String(Math.round(chart.xRange[0]));
    chart.el.dataset.xMax = String(Math.round(chart.xRange[1]));
    showLatest(chart.plot);
    const title = chart.plot.root.querySelector(".u-title");
    if (title) title.textContent = titled(chart, series);
    const points = data.slice(1).reduce(function (n, values) {
      return n + values.filter(function (v) { return v != null; }).length;
    }, 0);
    chart.el.dataset.points = String(points);
    if (points === 0) {
      caption(chart, chart.el.dataset.empty || "no samples in this window yet");
    } else if (chart.caption) {
      chart.caption.textContent = "";
    }
  };

  Chart.prototype.resize = function () {
    if (this.plot) this.plot.setSize({ width: Math.max(300, this.el.clientWidth - 10), height: 200 });
  };

  window.DgppCharts = {
    all: function () { return Array.from(document.querySelectorAll(".chart")).map(function (el) { return new Chart(el); }); },
  };
})();
