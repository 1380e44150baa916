/* determ report: the error plot, the root cause's neighbourhood and the node table, drawn from #report-data. */
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("report-data").textContent);
  var rows = D.rows, cols = D.columns, root = D.root;
  var SVG = "http://www.w3.org/2000/svg";
  var BAD = { root: 1, differs: 1, masked: 1, unpaired: 1 };
  var PAGE = 200;
  var state = { filter: "", onlyBad: false, sortKey: null, sortDir: 1, page: 0, view: rows };

  function el(tag, attrs, text) {
    var e = document.createElementNS(SVG, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function num(v) {
    if (typeof v === "number") return v;
    return v === "inf" ? Infinity : v === "-inf" ? -Infinity : v === "nan" ? NaN : null;
  }
  function asNumber(v) {  /* a sortable number for a cell's value, or null */
    var x = num(v);
    if (x === null && typeof v === "string" && v !== "" && isFinite(+v)) x = +v;
    return x === null || isNaN(x) ? null : x;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "";
    if (typeof v === "number") return Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(3) : String(+v.toPrecision(4));
    if (Array.isArray(v)) return "[" + v.map(fmt).join(", ") + "]";
    if (typeof v === "object") return Object.keys(v).map(function (k) { return k + "=" + fmt(v[k]); }).join(" ");
    return String(v);
  }

  /* ------------------------------------------------------------------ plot */
  function drawPlot() {
    var box = document.getElementById("plot");
    if (!box) return;
    var W = Math.max(box.clientWidth || 900, 300), H = 280, L = 56, R = 12, T = 14, B = 30;
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, id: "plot-svg", preserveAspectRatio: "none" });
    var vmin = Infinity, vmax = -Infinity, nonfinite = false;
    rows.forEach(function (r) {
      [num(r.e), num(r.r)].forEach(function (v) {
        if (v === null) return;
        if (!isFinite(v)) { nonfinite = true; return; }
        if (v > 0) { if (v < vmin) vmin = v; if (v > vmax) vmax = v; }
      });
    });
    var lo = vmax > 0 ? Math.floor(Math.log10(vmin)) : -8;
    var hi = vmax > 0 ? Math.ceil(Math.log10(vmax)) : 0;
    if (hi <= lo) hi = lo + 1;
    var top = nonfinite ? T + 14 : T;  /* a band above the scale for NaN and Inf */
    var zeroY = H - B, n = Math.max(rows.length - 1, 1);
    function x(i) { return L + (W - L - R) * (rows.length > 1 ? i / n : 0.5); }
    function y(v) {
      v = num(v);
      if (v === null) return zeroY;
      if (isNaN(v) || !isFinite(v)) return T;  /* NaN or Inf: the top band, never the zero line */
      if (v <= 0) return zeroY;
      return top + (H - B - 8 - top) * (hi - Math.log10(v)) / (hi - lo);
    }
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: zeroY, y2: zeroY, "class": "axis" }));
    for (var p = lo; p <= hi; p++) {
      var yy = y(Math.pow(10, p));
      svg.appendChild(el("line", { x1: L, x2: W - R, y1: yy, y2: yy, "class": "axis", "stroke-dasharray": "2,4" }));
      svg.appendChild(el("text", { x: 4, y: yy + 4 }, "1e" + p));
    }
    svg.appendChild(el("text", { x: 4, y: zeroY + 4 }, "0"));
    if (nonfinite) svg.appendChild(el("text", { x: 4, y: T + 4, id: "nonfinite-band" }, "nan/inf"));
    var prev = null;
    rows.forEach(function (r, i) {
      var stage = (r.g || "") + " " + (r.s || "");
      if (stage !== prev && (r.g !== undefined || r.s !== undefined)) {
        svg.appendChild(el("line", { x1: x(i), x2: x(i), y1: T, y2: H - B + 4, "class": "axis" }));
        svg.appendChild(el("text", { x: x(i) + 3, y: H - 6 }, stage.trim()));
        prev = stage;
      }
    });
    var g = el("g", { id: "points" });
    rows.forEach(function (r, i) {
      if (num(r.r) !== null) {
        var q = el("rect", { x: x(i) - 1.5, y: y(r.r) - 1.5, width: 3, height: 3, "class": "ref" });
        q.appendChild(el("title", {}, r.n + ": reference vs fp64 " + fmt(num(r.r))));
        g.appendChild(q);
      }
    });
    rows.forEach(function (r, i) {
      var c = el("circle", { cx: x(i), cy: y(r.e), r: r.v === "root" ? 5 : 3, "class": "pt " + r.v, "data-row": r.id });
      c.appendChild(el("title", {}, r.n + " (" + (r.op || "") + ") " + r.v + (num(r.e) !== null ? ": " + fmt(num(r.e)) : "")));
      c.addEventListener("click", function () { goTo(r.id); });
      g.appendChild(c);
    });
    svg.appendChild(g);
    if (root !== null && root !== undefined && rows[root]) {
      var rx = x(root), ry = y(rows[root].e);
      svg.appendChild(el("circle", { cx: rx, cy: ry, r: 10, "class": "root-mark", id: "root-mark" }));
      var lab = el("text", { x: Math.min(rx + 12, W - 160), y: Math.max(ry - 10, T + 10), id: "root-label" }, "root cause: " + rows[root].n);
      svg.appendChild(lab);
    }
    box.appendChild(svg);
  }

  /* ------------------------------------------------------------------ neighbourhood */
  function drawNeighbourhood() {
    var box = document.getElementById("neighbourhood");
    if (!box) return;
    if (root === null || root === undefined || !rows[root]) {
      box.textContent = "No root cause with a node row" + (D.kind === "dump" || D.kind === "compare" ? " (API dumps carry no data-flow links)." : ".");
      return;
    }
    var r = rows[root];
    var prods = [], seen = {};
    r["in"].forEach(function (i, k) {
      if (i !== null && !seen[i]) { seen[i] = 1; prods.push(rows[i]); }
      else if (i === null) prods.push({ n: r.ins[k], v: "unjudged", id: null });
    });
    var cons = rows.filter(function (q) { return q["in"].indexOf(root) >= 0; });
    var MAX = 12, more = [prods.length - MAX, cons.length - MAX];
    prods = prods.slice(0, MAX); cons = cons.slice(0, MAX);
    var W = Math.max(box.clientWidth || 900, 600), bw = Math.min(260, W / 3 - 30), bh = 26, gap = 8;
    var H = Math.max(prods.length, cons.length, 1) * (bh + gap) + 40;
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, height: H, id: "neighbourhood-svg" });
    var defs = el("defs", {});
    var mk = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 6, markerHeight: 6, orient: "auto" });
    mk.appendChild(el("path", { d: "M0,0 L10,5 L0,10 z", style: "fill:#868e96;stroke:none" }));
    defs.appendChild(mk); svg.appendChild(defs);
    function node(q, cx, cy, role) {
      var a = el("a", { "class": "nb " + q.v + " " + role, href: q.id !== null ? "#row-" + q.id : "#", "data-row": q.id === null ? "" : q.id });
      a.appendChild(el("rect", { x: cx - bw / 2, y: cy - bh / 2, width: bw, height: bh }));
      var label = q.n + (q.op ? "  " + q.op : "");
      if (label.length > bw / 7) label = label.slice(0, Math.floor(bw / 7) - 1) + "\u2026";
      a.appendChild(el("text", { x: cx - bw / 2 + 6, y: cy + 4 }, label));
      a.appendChild(el("title", {}, q.n + " (" + (q.op || "") + ") " + q.v));
      if (q.id !== null) a.addEventListener("click", function (ev) { ev.preventDefault(); goTo(q.id); });
      svg.appendChild(a);
    }
    var cx = [bw / 2 + 10, W / 2, W - bw / 2 - 10], mid = H / 2;
    function col(list, k) { var top = mid - (list.length * (bh + gap) - gap) / 2 + bh / 2; return list.map(function (_, i) { return top + i * (bh + gap); }); }
    var py = col(prods), cy2 = col(cons);
    prods.forEach(function (q, i) { svg.appendChild(el("path", { d: "M" + (cx[0] + bw / 2) + "," + py[i] + " C" + (cx[0] + bw) + "," + py[i] + " " + (cx[1] - bw) + "," + mid + " " + (cx[1] - bw / 2) + "," + mid })); });
    cons.forEach(function (q, i) { svg.appendChild(el("path", { d: "M" + (cx[1] + bw / 2) + "," + mid + " C" + (cx[1] + bw) + "," + mid + " " + (cx[2] - bw) + "," + cy2[i] + " " + (cx[2] - bw / 2) + "," + cy2[i] })); });
    prods.forEach(function (q, i) { node(q, cx[0], py[i], "producer"); });
    node(r, cx[1], mid, "root");
    cons.forEach(function (q, i) { node(q, cx[2], cy2[i], "consumer"); });
    svg.appendChild(el("text", { x: 10, y: 14 }, "producers" + (more[0] > 0 ? " (+" + more[0] + ")" : "")));
    svg.appendChild(el("text", { x: W - bw - 10, y: 14 }, "consumers" + (more[1] > 0 ? " (+" + more[1] + ")" : "")));
    box.appendChild(svg);
  }

  /* ------------------------------------------------------------------ table */
  function cellText(r, key) {
    var v = r[key];
    if (key === "in") return (r.ins || []).join(" ");
    if (key === "e" || key === "r") return fmt(num(v));
    return fmt(v);
  }
  var ALIASES = { node: "n", verdict: "v", stage: "s", kind: "k", source: "src", dtype: "dt", shape: "sh", graph: "g",
                  inputs: "in", error: "e" };
  var KEYS = {};
  cols.forEach(function (c) { KEYS[c[0].toLowerCase()] = c[0]; });
  function columnOf(word) { return ALIASES[word] || KEYS[word] || null; }
  function matches(r, terms) {
    for (var t = 0; t < terms.length; t++) {
      var term = terms[t], m = term.match(/^(\w+):(.*)$/), hit = false, key = m ? columnOf(m[1]) : null;
      if (key) {  /* column:text; any other word with a colon (module:fc1) is plain text */
        hit = cellText(r, key).toLowerCase().indexOf(m[2]) >= 0;
      } else {
        for (var c = 0; c < cols.length && !hit; c++) hit = cellText(r, cols[c][0]).toLowerCase().indexOf(term) >= 0;
      }
      if (!hit) return false;
    }
    return true;
  }
  function recompute() {
    var terms = state.filter.toLowerCase().split(/\s+/).filter(Boolean);
    var view = rows.filter(function (r) { return (!state.onlyBad || BAD[r.v]) && matches(r, terms); });
    if (state.sortKey) {
      var k = state.sortKey, d = state.sortDir;
      view = view.slice().sort(function (a, b) {
        var xa = asNumber(a[k]), xb = asNumber(b[k]), x, y;
        if (xa !== null && xb !== null) { x = xa; y = xb; }  /* both numbers: compared as numbers */
        else if (xa !== null || xb !== null) return xa === null ? 1 : -1;  /* numbers before text and blanks */
        else { x = cellText(a, k); y = cellText(b, k); }
        if (x === y) return a.id - b.id;
        if (x === "") return 1;
        if (y === "") return -1;
        return (x < y ? -1 : 1) * d;
      });
    }
    state.view = view;
  }
  function renderTable() {
    var table = document.getElementById("nodes");
    if (!table) return;
    var view = state.view, pages = Math.max(1, Math.ceil(view.length / PAGE));
    state.page = Math.min(state.page, pages - 1);
    var tb = document.createElement("tbody");
    view.slice(state.page * PAGE, (state.page + 1) * PAGE).forEach(function (r) {
      var tr = document.createElement("tr");
      tr.id = "row-" + r.id; tr.className = "v-" + r.v; tr.setAttribute("data-row", r.id);
      cols.forEach(function (c) {
        var td = document.createElement("td"), key = c[0];
        td.className = "c-" + key;
        if (key === "in") {
          (r.ins || []).forEach(function (name, k) {
            var pid = r["in"][k];
            if (k) td.appendChild(document.createTextNode(" "));
            if (pid !== null && pid !== undefined) {
              var a = document.createElement("a");
              a.href = "#row-" + pid; a.className = "producer"; a.setAttribute("data-row", pid); a.textContent = name;
              a.addEventListener("click", function (ev) { ev.preventDefault(); goTo(pid); });
              td.appendChild(a);
            } else td.appendChild(document.createTextNode(name));
          });
        } else td.textContent = cellText(r, key);
        tr.appendChild(td);
      });
      tb.appendChild(tr);
    });
    table.replaceChild(tb, table.tBodies[0]);
    document.getElementById("count").textContent = view.length + " of " + rows.length + " nodes";
    document.getElementById("page").textContent = " page " + (state.page + 1) + " / " + pages + " ";
  }
  function buildHead() {
    var tr = document.querySelector("#nodes thead tr");
    if (!tr) return;
    cols.forEach(function (c) {
      var th = document.createElement("th");
      th.textContent = c[1]; th.setAttribute("data-key", c[0]);
      th.addEventListener("click", function () {
        state.sortDir = state.sortKey === c[0] ? -state.sortDir : 1;
        state.sortKey = c[0];
        Array.prototype.forEach.call(tr.children, function (x) { x.className = ""; });
        th.className = state.sortDir > 0 ? "asc" : "desc";
        recompute(); renderTable();
      });
      tr.appendChild(th);
    });
  }
  function goTo(id) {
    if (id === null || id === undefined || id === "" || !rows[id]) return;
    id = +id;
    var at = state.view.findIndex(function (r) { return r.id === id; });
    if (at < 0) {
      state.filter = ""; state.onlyBad = false;
      document.getElementById("filter").value = ""; document.getElementById("only-bad").checked = false;
      recompute();
      at = state.view.findIndex(function (r) { return r.id === id; });
    }
    state.page = Math.floor(at / PAGE);
    renderTable();
    var tr = document.getElementById("row-" + id);
    if (tr) {
      tr.classList.remove("flash"); void tr.offsetWidth; tr.classList.add("flash");
      tr.scrollIntoView({ block: "center" });
      if (history.replaceState) history.replaceState(null, "", "#row-" + id);
    }
  }
  window.determReport = { goTo: goTo, rows: rows };

  function redrawPlot() {
    var box = document.getElementById("plot");
    if (box) { box.textContent = ""; drawPlot(); }
  }
  function init() {
    drawPlot();
    var resized = null;
    window.addEventListener("resize", function () { clearTimeout(resized); resized = setTimeout(redrawPlot, 150); });
    drawNeighbourhood();
    if (document.getElementById("nodes")) {
      buildHead(); recompute(); renderTable();
      var f = document.getElementById("filter"), t = null;
      f.addEventListener("input", function () {
        clearTimeout(t);
        t = setTimeout(function () { state.filter = f.value; state.page = 0; recompute(); renderTable(); }, 120);
      });
      document.getElementById("only-bad").addEventListener("change", function (ev) { state.onlyBad = ev.target.checked; state.page = 0; recompute(); renderTable(); });
      document.getElementById("prev").addEventListener("click", function () { if (state.page > 0) { state.page--; renderTable(); } });
      document.getElementById("next").addEventListener("click", function () { state.page++; renderTable(); });
    }
    var rn = document.getElementById("root-node");
    if (rn) rn.addEventListener("click", function (ev) { if (rn.getAttribute("data-row") !== "") { ev.preventDefault(); goTo(+rn.getAttribute("data-row")); } });
    var m = location.hash.match(/^#row-(\d+)$/);
    if (m) goTo(+m[1]);
    document.body.setAttribute("data-ready", "1");
  }
  init();
})();
