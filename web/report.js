// dtrain report: draws the page's charts from the data embedded by `dtrain report`
// (<script id="dtrain-data">): curves with uPlot, bars, Gantt and timeline as SVG. What it drew
// (points and marks per chart) and any error go into <pre id="dtrain-render"> as JSON, so that a
// headless browser's DOM dump shows whether every chart holds its points.
(function () {
  "use strict";
  var status = { errors: [], charts: {} };
  function fail(msg) {
    status.errors.push(String(msg));
  }
  window.addEventListener("error", function (e) {
    fail(e.message || e);
  });
  var consoleError = console.error;
  console.error = function () {
    fail(Array.prototype.join.call(arguments, " "));
    consoleError.apply(console, arguments);
  };

  var PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
  var KIND_COLORS = {
    forward: "#4e79a7", backward: "#f28e2b", optimizer: "#59a14f", synchronize: "#bab0ac", bucket: "#e15759",
    compute: "#4e79a7", communication: "#e15759", waiting: "#edc948", bubble: "#bab0ac", other: "#bab0ac"
  };
  var WIDTH = 640;
  var SVGNS = "http://www.w3.org/2000/svg";

  function color(i) {
    return PALETTE[i % PALETTE.length];
  }
  function el(tag, attrs, parent, text) {
    var e = document.createElementNS(SVGNS, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function svg(container, height) {
    var s = el("svg", { width: WIDTH, height: height, viewBox: "0 0 " + WIDTH + " " + height, role: "img" });
    container.appendChild(s);
    return s;
  }
  function note(container, text) {
    var p = document.createElement("p");
    p.className = "note";
    p.textContent = text;
    container.appendChild(p);
  }
  function bytes(b) {
    if (b >= 1073741824) return (b / 1073741824).toFixed(2) + " GiB";
    if (b >= 1048576) return (b / 1048576).toFixed(1) + " MiB";
    if (b >= 1024) return (b / 1024).toFixed(1) + " KiB";
    return Math.round(b) + " B";
  }
  function secs(s) {
    return s < 1 ? (s * 1000).toFixed(2) + " ms" : s.toFixed(3) + " s";
  }
  function legend(s, items, y) {
    var x = 10;
    items.forEach(function (it) {
      el("rect", { x: x, y: y - 9, width: 10, height: 10, fill: it[1] }, s);
      el("text", { x: x + 14, y: y, class: "legend" }, s, it[0]);
      x += 20 + it[0].length * 7;
    });
  }
  // A linear scale of [lo, hi] onto [a, b].
  function scale(lo, hi, a, b) {
    var span = hi - lo || 1;
    return function (v) {
      return a + ((v - lo) / span) * (b - a);
    };
  }
  function axis(s, x, lo, hi, y, unit) {
    el("line", { x1: x(lo), x2: x(hi), y1: y, y2: y, class: "axis" }, s);
    for (var i = 0; i <= 4; i++) {
      var v = lo + ((hi - lo) * i) / 4;
      el("line", { x1: x(v), x2: x(v), y1: y, y2: y + 4, class: "axis" }, s);
      el("text", { x: x(v), y: y + 16, class: "tick", "text-anchor": "middle" }, s, unit(v));
    }
  }

  // ---- curves (uPlot): one series per run over the union of their steps
  // style(i): extra uPlot series options for run i (a dash for trials stopped early).
  function curves(id, runs, pick, label, markers, style) {
    var container = document.getElementById("chart-" + id);
    var perRun = runs.map(function (r) {
      return pick(r);
    });
    if (!perRun.some(function (p) { return p && p.steps.length; })) {
      note(container, "No " + label + " in these metrics.");
      status.charts[id] = { series: perRun.map(function () { return 0; }) };
      return;
    }
    var xs = {};
    perRun.forEach(function (p) {
      if (p) p.steps.forEach(function (s, i) { if (p.values[i] !== null) xs[s] = true; });
    });
    var x = Object.keys(xs).map(Number).sort(function (a, b) { return a - b; });
    var data = [x];
    var series = [{ label: "step" }];
    var counts = [];
    perRun.forEach(function (p, i) {
      var byStep = {};
      if (p) p.steps.forEach(function (s, k) { if (p.values[k] !== null) byStep[s] = p.values[k]; });  // a redone step: its last value
      var ys = x.map(function (s) { return s in byStep ? byStep[s] : null; });
      counts.push(ys.filter(function (v) { return v !== null; }).length);
      data.push(ys);
      var one = { label: runs[i].name, stroke: color(i), width: 2, spanGaps: true, points: { show: x.length <= 60 } };
      var extra = style ? style(i) : {};
      for (var k in extra) one[k] = extra[k];
      series.push(one);
    });
    var marks = markers || [];
    var opts = {
      width: WIDTH, height: 300, series: series,
      scales: { x: { time: false } },
      axes: [{ label: "step" }, { label: label, size: 70 }],
      hooks: {
        draw: [function (u) {
          var ctx = u.ctx;
          ctx.save();
          marks.forEach(function (m) {
            var px = u.valToPos(m.step, "x", true);
            ctx.strokeStyle = m.color;
            ctx.setLineDash([6, 4]);
            ctx.lineWidth = 2;
            ctx.beginPath();
            ctx.moveTo(px, u.bbox.top);
            ctx.lineTo(px, u.bbox.top + u.bbox.height);
            ctx.stroke();
          });
          ctx.restore();
        }]
      }
    };
    var plot = new uPlot(opts, data, container);
    status.charts[id] = { series: counts, drawn: plot.data.slice(1).map(function (ys) {
      return ys.filter(function (v) { return v !== null && v !== undefined; }).length;
    }), markers: marks.length };
  }

  // ---- stacked bars of the step split, one bar per rank of each run
  function split(runs) {
    var container = document.getElementById("chart-split");
    var rows = [];
    runs.forEach(function (r, i) {
      var s = r.split;
      if (!s) return;
      s.ranks.forEach(function (rank, k) {
        rows.push({ label: (runs.length > 1 ? r.name + " " : "") + "rank " + rank, run: i, rest_name: s.rest_name,
          parts: [s.compute[k], s.communication[k], s.waiting[k], s.rest[k]] });
      });
    });
    if (!rows.length) {
      note(container, "No trace in these runs: train with --trace FILE to see where each rank's step goes.");
      status.charts.split = { bars: 0 };
      return;
    }
    var rowH = 22, top = 24, left = 130, height = top + rows.length * rowH + 40;
    var s = svg(container, height);
    var max = 0;
    rows.forEach(function (row) {
      max = Math.max(max, row.parts.reduce(function (a, b) { return a + b; }, 0));
    });
    var x = scale(0, max, left, WIDTH - 20);
    var names = ["compute", "communication", "waiting", rows[0].rest_name];
    legend(s, names.map(function (n) { return [n, KIND_COLORS[n]]; }), 14);
    var bars = 0;
    rows.forEach(function (row, j) {
      var y = top + j * rowH, at = 0;
      el("text", { x: left - 6, y: y + 14, "text-anchor": "end", class: "label" }, s, row.label);
      row.parts.forEach(function (v, k) {
        var name = k === 3 ? row.rest_name : names[k];
        var r = el("rect", { x: x(at), y: y + 2, width: Math.max(0, x(at + v) - x(at)), height: rowH - 6,
          fill: KIND_COLORS[name], class: "bar" }, s);
        el("title", {}, r, row.label + " " + name + ": " + secs(v));
        at += v;
      });
      bars++;
    });
    axis(s, x, 0, max, top + rows.length * rowH + 4, function (v) { return secs(v); });
    status.charts.split = { bars: bars };
  }

  // ---- Gantt of the first steps: a row per rank, compute spans above, gradient buckets below
  function gantt(runs) {
    var container = document.getElementById("chart-gantt");
    var counts = [];
    runs.forEach(function (r) {
      var g = r.gantt;
      if (!g || !g.spans.length) {
        counts.push(0);
        return;
      }
      var title = document.createElement("h3");
      title.textContent = (runs.length > 1 ? r.name + ": " : "") + "steps " + g.steps.join(" and ");
      container.appendChild(title);
      var rowH = 34, top = 24, left = 60, height = top + g.ranks * rowH + 40;
      var s = svg(container, height);
      var end = 0;
      g.spans.forEach(function (sp) { end = Math.max(end, sp[1] + sp[2]); });
      var x = scale(0, end, left, WIDTH - 10);
      legend(s, g.kinds.map(function (k) { return [k, KIND_COLORS[k]]; }), 14);
      for (var rank = 0; rank < g.ranks; rank++) {
        el("text", { x: left - 6, y: top + rank * rowH + 18, "text-anchor": "end", class: "label" }, s, "rank " + rank);
      }
      var n = 0;
      g.spans.forEach(function (sp) {
        var kind = g.kinds[sp[3]], comm = kind === "bucket";
        var y = top + sp[0] * rowH + (comm ? 22 : 2);
        var w = Math.max(1, x(sp[1] + sp[2]) - x(sp[1]));
        var rect = el("rect", { x: x(sp[1]), y: y, width: w, height: comm ? 8 : 18, fill: KIND_COLORS[kind],
          class: "span", stroke: "#fff", "stroke-width": 0.5 }, s);
        el("title", {}, rect, "rank " + sp[0] + " " + kind + (sp[4] >= 0 ? " " + sp[4] : "") + " (step " + sp[5] +
          "): " + sp[2].toFixed(2) + " ms");
        if (!comm && w > 16 && sp[4] >= 0) {
          el("text", { x: x(sp[1]) + w / 2, y: y + 13, "text-anchor": "middle", class: "inbar" }, s, String(sp[4]));
        }
        n++;
      });
      axis(s, x, 0, end, top + g.ranks * rowH + 4, function (v) { return v.toFixed(0) + " ms"; });
      counts.push(n);
    });
    if (!counts.some(function (c) { return c > 0; })) note(container, "No trace in these runs: no Gantt chart.");
    status.charts.gantt = { spans: counts };
  }

  // ---- simple vertical bars with labels
  function bars(id, items, unit, empty) {
    var container = document.getElementById("chart-" + id);
    if (!items.length) {
      note(container, empty);
      status.charts[id] = { bars: 0 };
      return;
    }
    var top = 20, bottom = 60, height = 260;
    var s = svg(container, height);
    var max = 0;
    items.forEach(function (it) { max = Math.max(max, it.value); });
    var y = scale(0, max, height - bottom, top);
    var bw = Math.min(60, (WIDTH - 80) / items.length - 8);
    items.forEach(function (it, i) {
      var x0 = 60 + i * (bw + 8);
      var r = el("rect", { x: x0, y: y(it.value), width: bw, height: Math.max(0, y(0) - y(it.value)), fill: it.color,
        class: "bar" }, s);
      el("title", {}, r, it.label + ": " + unit(it.value));
      el("text", { x: x0 + bw / 2, y: y(it.value) - 4, "text-anchor": "middle", class: "tick" }, s, unit(it.value));
      el("text", { x: x0 + bw / 2, y: height - bottom + 14, "text-anchor": "middle", class: "label" }, s, it.label);
      if (it.sub) el("text", { x: x0 + bw / 2, y: height - bottom + 28, "text-anchor": "middle", class: "tick" }, s, it.sub);
    });
    el("line", { x1: 50, x2: WIDTH - 10, y1: y(0), y2: y(0), class: "axis" }, s);
    status.charts[id] = { bars: items.length };
  }

  function wire(runs) {
    var items = [];
    runs.forEach(function (r, i) {
      var w = r.wire;
      if (!w || w.f32_per_step === undefined) return;
      var who = runs.length > 1 ? r.name + " " : "";
      items.push({ label: who + "as f32", value: w.f32_per_step, color: "#bab0ac", sub: "per step" });
      items.push({ label: who + "on the wire", value: w.wire_per_step, color: color(i), sub: w.compress });
    });
    bars("wire", items, bytes, "No gradient communication in these runs (one process, or no data parallelism).");
  }

  function memory(runs) {
    var items = [];
    runs.forEach(function (r, i) {
      var m = r.memory;
      if (!m || !m.peak_rss) return;
      m.peak_rss.forEach(function (b, k) {
        items.push({ label: (runs.length > 1 ? r.name + " " : "") + "rank " + k, value: b, color: color(i), sub: "peak RSS" });
      });
    });
    bars("memory", items, bytes, "No final record: no memory figures.");
  }

  // ---- wall-clock timeline: starts as bands, failures, the work lost, checkpoints
  function timeline(runs) {
    var container = document.getElementById("chart-timeline");
    var rows = runs.filter(function (r) { return r.timeline; });
    if (!rows.length) {
      note(container, "No start records: no timeline.");
      status.charts.timeline = { bands: 0, failures: 0, checkpoints: 0 };
      return;
    }
    var rowH = 46, top = 24, left = 110, height = top + rows.length * rowH + 40;
    var s = svg(container, height);
    var defs = el("defs", {}, s);
    var pat = el("pattern", { id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse",
      patternTransform: "rotate(45)" }, defs);
    el("rect", { width: 6, height: 6, fill: "#fde0dd" }, pat);
    el("line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#d62728", "stroke-width": 2 }, pat);
    var end = 0;
    rows.forEach(function (r) {
      r.timeline.attempts.forEach(function (a) { end = Math.max(end, a.end); });
    });
    var x = scale(0, end, left, WIDTH - 20);
    legend(s, [["start of the job", "#4e79a7"], ["work lost", "#d62728"], ["downtime", "#999"], ["checkpoint", "#333"]], 14);
    var bands = 0, failures = 0, ticks = 0;
    rows.forEach(function (r, j) {
      var y = top + j * rowH, t0 = r.timeline.t0;
      el("text", { x: left - 6, y: y + 20, "text-anchor": "end", class: "label" }, s, r.name);
      r.timeline.attempts.forEach(function (a, k) {
        var band = el("rect", { x: x(a.start), y: y + 4, width: Math.max(1, x(a.end) - x(a.start)), height: 24,
          fill: k % 2 ? "#76b7b2" : "#4e79a7", class: "band" }, s);
        el("title", {}, band, "start " + a.attempt + ": " + a.world + " ranks, " + a.start.toFixed(1) + "-" +
          a.end.toFixed(1) + " s");
        el("text", { x: x(a.start) + 3, y: y + 20, class: "inbar" }, s, a.world + " ranks");
        bands++;
      });
      r.restarts.forEach(function (f) {
        var at = f.failed_at - t0, back = f.restart_at - t0;
        if (f.lost_work_s !== null) {
          el("rect", { x: x(at - f.lost_work_s), y: y + 4, width: Math.max(1, x(at) - x(at - f.lost_work_s)), height: 24,
            fill: "url(#hatch)", class: "lost" }, s);
        }
        el("rect", { x: x(at), y: y + 4, width: Math.max(1, x(back) - x(at)), height: 24, fill: "#999", class: "down" }, s);
        var line = el("line", { x1: x(at), x2: x(at), y1: y, y2: y + 32, stroke: "#d62728", "stroke-width": 3,
          class: "failure" }, s);
        el("title", {}, line, f.reason + " (resumed at step " + f.resumed_step + ")");
        failures++;
      });
      r.timeline.checkpoints.forEach(function (c) {
        var tick = el("line", { x1: x(c.time), x2: x(c.time), y1: y + 30, y2: y + 38, stroke: "#333", "stroke-width": 2,
          class: "checkpoint" }, s);
        el("title", {}, tick, "checkpoint at step " + c.step);
        ticks++;
      });
    });
    axis(s, x, 0, end, top + rows.length * rowH + 4, function (v) { return v.toFixed(1) + " s"; });
    status.charts.timeline = { bands: bands, failures: failures, checkpoints: ticks };
  }

  // ---- a sweep (dtrain report SWEEPDIR): every trial's metric and loss, one line each, best first
  function sweep(sw) {
    var trials = sw.trials;
    var dashed = function (i) {
      return trials[i].status === "done" ? {} : { dash: [6, 4], width: 1.5 };
    };
    curves("sweep", trials, function (t) { return t.metric; }, sw.metric + " (" + sw.mode + ")", [], dashed);
    curves("loss", trials, function (t) { return t.loss; }, "loss", [], dashed);
    ["sweep", "loss"].forEach(function (id) {
      status.charts[id].trials = trials.map(function (t) { return t.trial; });
      status.charts[id].dashed = trials.filter(function (t) { return t.status !== "done"; }).length;
    });
  }

  function draw() {
    var page = JSON.parse(document.getElementById("dtrain-data").textContent);
    document.querySelectorAll(".swatch").forEach(function (e) {
      e.style.background = color(Number(e.getAttribute("data-run")));
    });
    if (page.sweep) {
      sweep(page.sweep);
      return;
    }
    var runs = page.runs;
    var restartMarks = [];
    runs.forEach(function (r, i) {
      r.restarts.forEach(function (f) { restartMarks.push({ step: f.resumed_step, color: color(i) }); });
    });
    curves("loss", runs, function (r) { return { steps: r.series.steps, values: r.series.loss }; }, "loss", restartMarks);
    curves("throughput", runs, function (r) { return { steps: r.series.steps, values: r.series.rate }; },
      runs.length ? runs[0].series.unit : "per s", restartMarks);
    var mfuLabel = "MFU";
    runs.forEach(function (r) { if (r.series.mfu && r.series.mfu_label !== "MFU") mfuLabel = r.series.mfu_label; });
    curves("mfu", runs, function (r) {
      return r.series.mfu && r.series.mfu_label === mfuLabel ? { steps: r.series.steps, values: r.series.mfu } : null;
    }, mfuLabel, []);
    if (mfuLabel !== "MFU") {
      note(document.getElementById("chart-mfu"),
        "These metrics have no measured peak (peak_flops_per_rank): the model's FLOP rate is shown instead of MFU.");
    }
    split(runs);
    gantt(runs);
    wire(runs);
    memory(runs);
    timeline(runs);
  }

  function finish() {
    var out = document.getElementById("dtrain-render");
    out.textContent = JSON.stringify(status);
    document.body.setAttribute("data-rendered", status.errors.length ? "errors" : "ok");
  }

  // "#only=loss,timeline" in the address shows only those sections (for screenshots).
  function only() {
    var m = /only=([\w,-]+)/.exec(location.hash);
    if (!m) return;
    var keep = m[1].split(",");
    document.querySelectorAll("section").forEach(function (s) {
      if (keep.indexOf(s.id) < 0) s.style.display = "none";
    });
  }

  try {
    only();
    draw();
  } catch (e) {
    fail(e && e.stack ? e.stack : e);
  }
  finish();
})();
