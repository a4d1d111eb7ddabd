"""The report page's inline stylesheet and script (no CDN: the page must open offline).

The script reads the JSON in ``<script id="epscale-data">`` and draws every
``<div class="plot" data-plot=KIND>`` element: line charts and stacked areas as SVG,
heatmaps on a canvas. Each drawer checks that it drew something (a path with points, a
canvas with cells) and marks its box ``data-drawn="1"``; failures are shown in the box.
``#epscale-status`` carries ``data-expected``, ``data-drawn`` and ``data-errors`` (uncaught
errors, rejected promises and console.error calls) so a headless browser can check the page.
"""

CSS = r"""
:root { --fg:#1d2330; --muted:#667085; --line:#e4e7ec; --bg:#f7f8fa; --card:#fff;
        --bad:#b42318; --warn:#b54708; --ok:#027a48; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
       color:var(--fg); background:var(--bg); }
header { padding:18px 28px 10px; background:var(--card); border-bottom:1px solid var(--line); }
header h1 { margin:0 0 4px; font-size:20px; }
header .sub { color:var(--muted); }
main { padding:16px 28px 40px; max-width:1500px; }
h2 { font-size:16px; margin:26px 0 10px; }
.cards { display:flex; flex-wrap:wrap; gap:10px; margin-top:12px; }
.card { background:var(--bg); border:1px solid var(--line); border-radius:8px; padding:8px 12px; min-width:120px; }
.card .k { color:var(--muted); font-size:12px; } .card .v { font-size:18px; font-weight:600; }
.card.bad .v { color:var(--bad); }
.grid { display:grid; grid-template-columns:repeat(auto-fill,minmax(560px,1fr)); gap:14px; }
.panel { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 12px 6px; position:relative; }
.panel h3 { margin:0 0 2px; font-size:13px; font-weight:600; }
.panel .note { color:var(--muted); font-size:12px; margin:0 0 4px; }
.plot { position:relative; min-height:40px; }
.plot svg, .plot canvas { width:100%; height:auto; display:block; }
.plot .err { color:var(--bad); font-weight:600; padding:12px; }
.legend { display:flex; flex-wrap:wrap; gap:4px 12px; font-size:12px; color:var(--muted); margin:2px 0 2px; }
.legend i { display:inline-block; width:14px; height:3px; vertical-align:middle; margin-right:4px; }
.legend .bar { height:10px; width:160px; border-radius:2px; }
table { border-collapse:collapse; width:100%; background:var(--card); border:1px solid var(--line); }
th, td { text-align:left; padding:6px 10px; border-bottom:1px solid var(--line); vertical-align:top; font-size:13px; }
th { background:#f2f4f7; font-weight:600; }
tr.alert td:first-child { color:var(--bad); font-weight:600; }
.allclear { color:var(--ok); font-weight:600; padding:10px 12px; background:var(--card); border:1px solid var(--line); border-radius:8px; }
.warnings { color:var(--warn); }
#tip { position:fixed; pointer-events:none; background:rgba(29,35,48,.94); color:#fff; font-size:12px;
       padding:6px 8px; border-radius:6px; display:none; z-index:10; white-space:nowrap; }
#epscale-status { color:var(--muted); font-size:12px; margin-top:30px; }
code { font-size:12px; }
"""

JS = r"""
(function () {
  "use strict";
  var STATUS = { expected: 0, drawn: 0, errors: [] };
  function publish() {
    var el = document.getElementById("epscale-status");
    if (!el) return;
    el.setAttribute("data-expected", String(STATUS.expected));
    el.setAttribute("data-drawn", String(STATUS.drawn));
    el.setAttribute("data-errors", String(STATUS.errors.length));
    el.setAttribute("data-done", "1");
    el.textContent = "plots drawn: " + STATUS.drawn + "/" + STATUS.expected + "; page errors: " +
      STATUS.errors.length + (STATUS.errors.length ? " (" + STATUS.errors.join(" | ") + ")" : "");
  }
  window.addEventListener("error", function (e) { STATUS.errors.push("error: " + e.message); publish(); });
  window.addEventListener("unhandledrejection", function (e) { STATUS.errors.push("rejection: " + e.reason); publish(); });
  var consoleError = console.error;
  console.error = function () {
    STATUS.errors.push("console.error: " + Array.prototype.join.call(arguments, " "));
    publish();
    return consoleError.apply(console, arguments);
  };

  var NS = "http://www.w3.org/2000/svg";
  var PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                 "#7f7f7f", "#bcbd22", "#17becf"];
  var D = JSON.parse(document.getElementById("epscale-data").textContent);
  var tip = document.getElementById("tip");

  function svgEl(tag, attrs, parent) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function isNum(v) { return typeof v === "number" && isFinite(v); }
  function fmt(v) {
    if (!isNum(v)) return "—";
    var a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(2) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(2) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
    if (a === 0) return "0";
    if (a < 1e-3) return v.toExponential(1);
    return String(+v.toPrecision(3));
  }
  function pct(v) {
    if (!isNum(v)) return "—";
    var x = 100 * v, a = Math.abs(x);
    if (a === 0) return "0%";
    return (a >= 10 ? x.toFixed(0) : a >= 1 ? x.toFixed(1) : String(+x.toPrecision(2))) + "%";
  }
  // tick labels with as many decimals as the tick step needs (no "485, 485, 486")
  function axisFmt(step, percent) {
    var s = percent ? step * 100 : step;
    var dec = Math.max(0, Math.min(6, Math.ceil(-Math.log10(s) - 1e-9)));
    return function (v) {
      var x = percent ? v * 100 : v;
      if (!percent && Math.abs(x) >= 1e4) return fmt(x);
      return (Math.abs(x) < 1e-12 ? "0" : x.toFixed(dec)) + (percent ? "%" : "");
    };
  }
  function ticks(lo, hi, n) {
    if (!(hi > lo)) { hi = lo + 1; }
    var step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
    var err = (hi - lo) / n / step;
    if (err >= 7.5) step *= 10; else if (err >= 3.5) step *= 5; else if (err >= 1.5) step *= 2;
    var out = [];
    for (var t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
    return out;
  }
  function showTip(ev, html) {
    tip.innerHTML = html; tip.style.display = "block";
    var x = ev.clientX + 14, y = ev.clientY + 12;
    if (x + tip.offsetWidth > window.innerWidth - 8) x = ev.clientX - tip.offsetWidth - 14;
    tip.style.left = x + "px"; tip.style.top = y + "px";
  }
  function hideTip() { tip.style.display = "none"; }
  function legend(box, items) {
    var lg = document.createElement("div"); lg.className = "legend";
    items.forEach(function (it) {
      var s = document.createElement("span"), i = document.createElement("i");
      i.style.background = it.color; if (it.dash) i.style.opacity = "0.6";
      s.appendChild(i); s.appendChild(document.createTextNode(it.name)); lg.appendChild(s);
    });
    box.appendChild(lg);
  }

  // ------------------------------------------------------------------ line / stacked charts
  // o: {x:[steps], series:[{name, y:[..|null], color, dash}], stacked, ymin, ymax, yfmt,
  //     hlines:[{y, label}], marks:[{x, label}], points:[{x, y, name}]}
  function lineChart(box, o) {
    var W = 640, H = o.height || 230, m = { l: 58, r: 12, t: 10, b: 26 };
    var x = o.x, n = x.length, series = o.series.filter(function (s) { return s.y; });
    if (!n || !series.length) throw new Error("no data to draw");
    var ys = series.map(function (s) { return s.y.slice(); });
    if (o.stacked) {
      var cum = new Array(n).fill(0);
      ys = ys.map(function (y) {
        var top = y.map(function (v, i) { return cum[i] + (isNum(v) ? v : 0); });
        cum = top; return top;
      });
    }
    var lo = Infinity, hi = -Infinity, xlo = Infinity, xhi = -Infinity, finiteCount = 0;
    ys.forEach(function (y) { y.forEach(function (v, i) {
      if (isNum(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); finiteCount++;
        xlo = Math.min(xlo, x[i]); xhi = Math.max(xhi, x[i]); } }); });
    (o.points || []).forEach(function (p) { if (isNum(p.y)) { lo = Math.min(lo, p.y); hi = Math.max(hi, p.y); } });
    if (!finiteCount) throw new Error("no finite values to draw");
    (o.hlines || []).forEach(function (h) { lo = Math.min(lo, h.y); hi = Math.max(hi, h.y); });
    if (o.ymin !== undefined) lo = Math.min(lo, o.ymin);
    if (o.ymax !== undefined) hi = Math.max(hi, o.ymax);
    if (o.stacked) lo = 0;
    var pad = (hi - lo) * 0.06 || Math.abs(hi) * 0.1 || 1;
    if (!(o.stacked || o.ymin === 0)) lo -= pad;
    hi += pad;
    xlo = Math.min(xlo, x[0]); xhi = Math.max(xhi, x[n - 1]);
    if (xhi === xlo) { xhi = xlo + 1; }
    function sx(v) { return m.l + (v - xlo) / (xhi - xlo) * (W - m.l - m.r); }
    function sy(v) { return H - m.b - (v - lo) / (hi - lo) * (H - m.t - m.b); }
    var svg = svgEl("svg", { viewBox: "0 0 " + W + " " + H, preserveAspectRatio: "xMidYMid meet" });
    var yt = ticks(lo, hi, 5), ystep = yt.length > 1 ? yt[1] - yt[0] : 1;
    var yfmt = o.yfmt === "pct" ? axisFmt(ystep, true) : (o.yfmt || axisFmt(ystep, false));
    yt.forEach(function (t) {
      svgEl("line", { x1: m.l, x2: W - m.r, y1: sy(t), y2: sy(t), stroke: "#eef0f3" }, svg);
      svgEl("text", { x: m.l - 6, y: sy(t) + 4, "text-anchor": "end", "font-size": 12, fill: "#667085" }, svg)
        .textContent = yfmt(t);
    });
    ticks(xlo, xhi, 8).forEach(function (t) {
      if (t < xlo || t > xhi) return;
      svgEl("line", { x1: sx(t), x2: sx(t), y1: H - m.b, y2: H - m.b + 4, stroke: "#98a2b3" }, svg);
      svgEl("text", { x: sx(t), y: H - m.b + 16, "text-anchor": "middle", "font-size": 12, fill: "#667085" }, svg)
        .textContent = fmt(t);
    });
    svgEl("line", { x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b, stroke: "#98a2b3" }, svg);
    var drawn = 0;
    if (o.stacked) {
      for (var k = ys.length - 1; k >= 0; k--) {
        var top = ys[k], bot = k ? ys[k - 1] : new Array(n).fill(0), d = "";
        for (var i = 0; i < n; i++) d += (i ? "L" : "M") + sx(x[i]).toFixed(1) + " " + sy(top[i]).toFixed(1);
        for (var j = n - 1; j >= 0; j--) d += "L" + sx(x[j]).toFixed(1) + " " + sy(bot[j]).toFixed(1);
        svgEl("path", { d: d + "Z", fill: series[k].color, "fill-opacity": 0.85, stroke: "none" }, svg);
        drawn += n;
      }
    } else {
      ys.forEach(function (y, k) {
        var d = "", pen = false, pts = 0, lone = [];
        for (var i = 0; i < n; i++) {
          if (!isNum(y[i])) { pen = false; continue; }
          d += (pen ? "L" : "M") + sx(x[i]).toFixed(1) + " " + sy(y[i]).toFixed(1);
          if (!pen && (i + 1 >= n || !isNum(y[i + 1]))) lone.push(i);
          pen = true; pts++;
        }
        if (!pts) return;
        svgEl("path", { d: d, fill: "none", stroke: series[k].color, "stroke-width": series[k].width || 1.6,
                        "stroke-dasharray": series[k].dash ? "5 4" : "none", "stroke-linejoin": "round" }, svg);
        lone.forEach(function (i) { svgEl("circle", { cx: sx(x[i]), cy: sy(y[i]), r: 2.5, fill: series[k].color }, svg); });
        drawn += pts;
      });
    }
    (o.points || []).forEach(function (p) {
      if (!isNum(p.y)) return;
      svgEl("circle", { cx: sx(p.x), cy: sy(p.y), r: 3.5, fill: p.color || "#d62728", stroke: "#fff" }, svg);
      drawn++;
    });
    (o.hlines || []).forEach(function (h) {
      svgEl("line", { x1: m.l, x2: W - m.r, y1: sy(h.y), y2: sy(h.y), stroke: "#b42318", "stroke-dasharray": "6 4" }, svg);
      svgEl("text", { x: W - m.r - 4, y: sy(h.y) - 4, "text-anchor": "end", "font-size": 12, fill: "#b42318" }, svg)
        .textContent = h.label;
    });
    (o.marks || []).forEach(function (mk) {
      if (mk.x < xlo || mk.x > xhi) return;
      var c = mk.color || "#b42318";
      svgEl("line", { x1: sx(mk.x), x2: sx(mk.x), y1: m.t, y2: H - m.b, stroke: c, "stroke-opacity": mk.label ? 0.9 : 0.5,
        "stroke-dasharray": mk.label ? "4 3" : "" }, svg);
      if (mk.label) svgEl("text", { x: sx(mk.x) + 3, y: m.t + 12, "font-size": 11, fill: c }, svg).textContent = mk.label;
    });
    if (!drawn) throw new Error("nothing was drawn");
    var cursor = svgEl("line", { y1: m.t, y2: H - m.b, stroke: "#344054", "stroke-opacity": 0, "pointer-events": "none" }, svg);
    var hit = svgEl("rect", { x: m.l, y: m.t, width: W - m.l - m.r, height: H - m.t - m.b, fill: "transparent" }, svg);
    hit.addEventListener("mousemove", function (ev) {
      var r = svg.getBoundingClientRect(), vx = (ev.clientX - r.left) / r.width * W;
      var xv = xlo + (vx - m.l) / (W - m.l - m.r) * (xhi - xlo), best = 0;
      for (var i = 1; i < n; i++) if (Math.abs(x[i] - xv) < Math.abs(x[best] - xv)) best = i;
      cursor.setAttribute("x1", sx(x[best])); cursor.setAttribute("x2", sx(x[best]));
      cursor.setAttribute("stroke-opacity", 0.5);
      var html = "<b>step " + x[best] + "</b>";
      series.forEach(function (s) { html += "<br>" + s.name + ": " + (o.tipfmt || fmt)(s.y[best]); });
      showTip(ev, html);
    });
    hit.addEventListener("mouseleave", function () { cursor.setAttribute("stroke-opacity", 0); hideTip(); });
    legend(box, series.map(function (s) { return { name: s.name, color: s.color, dash: s.dash }; })
      .concat((o.points && o.points.length) ? [{ name: o.points[0].name, color: o.points[0].color || "#d62728" }] : []));
    box.appendChild(svg);
    return drawn;
  }

  // ------------------------------------------------------------------ heatmap
  // o: {x:[cols' steps], z:[col][row] ratio to the mean (1 = average), rowLabel, rows}
  function heatColor(r) {
    if (!isNum(r)) return "#d0d5dd";
    if (r <= 0) return "#101828";  // no tokens at all
    var t = Math.max(-3, Math.min(3, Math.log2(r))) / 3;  // -1 cold .. +1 hot
    var c0 = [255, 255, 255], c1 = t < 0 ? [33, 102, 172] : [178, 24, 43], a = Math.abs(t);
    return "rgb(" + c0.map(function (c, i) { return Math.round(c + (c1[i] - c) * a); }).join(",") + ")";
  }
  function heatmap(box, o) {
    var cols = o.z.length, rows = o.rows;
    if (!cols || !rows) throw new Error("no data to draw");
    var m = { l: 58, r: 12, t: 6, b: 26 };
    var cell = Math.max(2, Math.min(26, Math.floor(220 / rows)));
    var W = 640, H = m.t + m.b + cell * rows;
    var cv = document.createElement("canvas");
    var dpr = 2; cv.width = W * dpr; cv.height = H * dpr;
    var ctx = cv.getContext("2d"); ctx.scale(dpr, dpr);
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, H);
    var cw = (W - m.l - m.r) / cols, painted = 0;
    for (var c = 0; c < cols; c++) {
      var col = o.z[c];
      for (var r = 0; r < rows; r++) {
        ctx.fillStyle = heatColor(col ? col[r] : null);
        ctx.fillRect(m.l + c * cw, m.t + r * cell, Math.ceil(cw + 0.5), cell);
        painted++;
      }
    }
    ctx.fillStyle = "#667085"; ctx.font = "12px sans-serif"; ctx.textAlign = "right";
    var every = Math.max(1, Math.ceil(12 / cell));
    for (var rr = 0; rr < rows; rr += every) ctx.fillText(String(rr), m.l - 6, m.t + rr * cell + cell / 2 + 4);
    ctx.save(); ctx.translate(12, m.t + rows * cell / 2); ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "center"; ctx.fillText(o.rowLabel, 0, 0); ctx.restore();
    ctx.textAlign = "center";
    var x = o.x, xlo = x[0], xhi = x[cols - 1];
    ticks(xlo, xhi, 8).forEach(function (t) {
      if (t < xlo || t > xhi) return;
      var c = 0; while (c < cols - 1 && x[c] < t) c++;
      ctx.fillText(fmt(t), m.l + (c + 0.5) * cw, H - m.b + 16);
    });
    // verify: the middle of the first cell must not be the background any more
    var px = ctx.getImageData(Math.floor((m.l + cw / 2) * dpr), Math.floor((m.t + cell / 2) * dpr), 1, 1).data;
    if (!painted || px[3] === 0) throw new Error("heatmap cells were not painted");
    cv.addEventListener("mousemove", function (ev) {
      var b = cv.getBoundingClientRect(), vx = (ev.clientX - b.left) / b.width * W, vy = (ev.clientY - b.top) / b.height * H;
      var c = Math.floor((vx - m.l) / cw), r = Math.floor((vy - m.t) / cell);
      if (c < 0 || c >= cols || r < 0 || r >= rows) { hideTip(); return; }
      var v = o.z[c] ? o.z[c][r] : null;
      showTip(ev, "<b>step " + x[c] + "</b><br>" + o.rowLabel + " " + r + ": " +
        (isNum(v) ? (v === 0 ? "no tokens" : v.toFixed(2) + "x the mean load") : "—"));
    });
    cv.addEventListener("mouseleave", hideTip);
    var lg = document.createElement("div"); lg.className = "legend";
    lg.innerHTML = "<span>load vs mean: 1/8x</span><i class='bar' style='background:linear-gradient(90deg," +
      [0.125, 0.35, 1, 2.8, 8].map(heatColor).join(",") + ")'></i><span>8x</span>" +
      "<span><i style='background:#101828;height:10px;width:10px'></i>no tokens</span>";
    box.appendChild(lg);
    box.appendChild(cv);
    return painted;
  }

  // ------------------------------------------------------------------ plot kinds
  function S(name, y, i, extra) { var s = { name: name, y: y, color: PALETTE[i % PALETTE.length] };
    for (var k in (extra || {})) s[k] = extra[k]; return s; }
  var T = D.scalars, X = D.x;
  function layerById(id) { for (var i = 0; i < D.layers.length; i++) if (D.layers[i].layer === id) return D.layers[i]; return null; }
  function perLayer(key, opts) {
    return function (box) {
      return lineChart(box, Object.assign({ x: D.layer_x, series: D.layers.map(function (L, i) {
        return S("layer " + L.layer, L[key], i); }) }, opts || {}));
    };
  }
  // elastic restarts: a labelled line where the layout changed ("4 -> 2 proc")
  function layoutMarks() { return (D.layout_changes || []).map(function (c) {
    return { x: c.step, label: c.label, color: "#1f5fbf" }; }); }
  var KINDS = {
    loss: function (box) {
      var s = [S("train loss", T.loss, 0)];
      if (T.loss_max) s.push(S("train loss (bucket max)", T.loss_max, 1, { dash: true }));
      return lineChart(box, { x: X, series: s,
        points: D.val_loss.map(function (p) { return { x: p[0], y: p[1], name: "validation loss", color: "#d62728" }; }),
        marks: D.bad_steps.map(function (s) { return { x: s }; }).concat(layoutMarks()) });
    },
    grad_norm: function (box) {
      var s = [S("grad norm", T.grad_norm, 2)];
      if (T.grad_norm_max) s.push(S("grad norm (bucket max)", T.grad_norm_max, 3, { dash: true }));
      return lineChart(box, { x: X, series: s, ymin: 0,
        marks: D.bad_steps.map(function (s) { return { x: s }; }) });
    },
    lr: function (box) { return lineChart(box, { x: X, series: [S("learning rate", T.lr, 4)], ymin: 0 }); },
    throughput: function (box) {
      var s = [S("tokens/s (all processes)", T.tokens_per_s, 0)];
      return lineChart(box, { x: X, series: s, ymin: 0, marks: layoutMarks() });
    },
    mfu: function (box) { return lineChart(box, { x: X, series: [S("MFU", T.mfu, 1)], ymin: 0, yfmt: "pct", tipfmt: pct }); },
    comm: function (box) {
      var s = [S("communication share", T.comm_share, 3)];
      if (T.comm_exposed_share) s.push(S("exposed (waited on)", T.comm_exposed_share, 1));
      Object.keys(T).filter(function (k) { return k.indexOf("comm_exposed_share.") === 0; })
        .forEach(function (k, i) { s.push(S("exposed: " + k.slice(19), T[k], 4 + i, { dash: true })); });
      if (T.worst_rank_idle) s.push(S("worst-rank idle", T.worst_rank_idle, 7, { dash: true }));
      return lineChart(box, { x: X, series: s, ymin: 0, yfmt: "pct", tipfmt: pct,
        hlines: D.rules.max_comm_share ? [{ y: D.rules.max_comm_share, label: "alert " + pct(D.rules.max_comm_share) }] : [] });
    },
    breakdown: function (box) {
      var names = Object.keys(D.breakdown);
      return lineChart(box, { x: X, stacked: true, series: names.map(function (k, i) { return S(k, D.breakdown[k], i); }),
        tipfmt: function (v) { return isNum(v) ? (v * 1e3).toFixed(1) + " ms" : "—"; },
        yfmt: function (v) { return fmt(v * 1e3) + " ms"; } });
    },
    memory: function (box) { return lineChart(box, { x: X, series: [S("memory (MB, max over ranks)", T.mem_mb, 5)] }); },
    expert_load: function (box) {
      var L = layerById(+box.getAttribute("data-layer"));
      return heatmap(box, { x: D.layer_x, z: L.load, rows: L.num_experts, rowLabel: "expert" });
    },
    max_vio: perLayer("max_vio", { ymin: 0,
      hlines: [{ y: D.rules.imbalance_max_vio, label: "alert > " + D.rules.imbalance_max_vio }] }),
    drop_rate: perLayer("dropped_frac", { ymin: 0, yfmt: "pct", tipfmt: pct }),
    entropy: perLayer("router_entropy", { ymin: 0 }),
    bias_range: perLayer("bias_range", { ymin: 0 }),
    rank_load: function (box) {
      return heatmap(box, { x: D.layer_x, z: D.ranks.load, rows: D.ranks.num_ep, rowLabel: "EP rank" });
    },
    rank_idle: function (box) {
      return lineChart(box, { x: D.layer_x, ymin: 0, yfmt: "pct", tipfmt: pct, series: D.ranks.idle.map(function (y, i) {
        return S(D.ranks.idle_names[i], y, i); }) });
    },
    rank_time: function (box) {
      return lineChart(box, { x: X, ymin: 0, series: D.ranks.time.map(function (y, i) {
        return S(D.ranks.time_names[i], y, i); }), tipfmt: function (v) { return isNum(v) ? (v * 1e3).toFixed(1) + " ms" : "—"; } });
    }
  };

  var boxes = document.querySelectorAll(".plot");
  STATUS.expected = boxes.length;
  Array.prototype.forEach.call(boxes, function (box) {
    var kind = box.getAttribute("data-plot");
    try {
      if (!KINDS[kind]) throw new Error("unknown plot kind " + kind);
      KINDS[kind](box);
      box.setAttribute("data-drawn", "1");
      STATUS.drawn++;
    } catch (e) {
      box.setAttribute("data-drawn", "0");
      var msg = document.createElement("div"); msg.className = "err";
      msg.textContent = "could not draw " + kind + ": " + e.message;
      box.appendChild(msg);
      STATUS.errors.push(kind + ": " + e.message);
    }
  });
  publish();
})();
"""
