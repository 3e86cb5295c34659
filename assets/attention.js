/* headscope: the Attention page's token strip. The strip is HTML (one span per token, as CircuitsVis
   draws its token views); hovering a token, or hovering or clicking a heatmap row, recolours the
   spans in place from the heatmap already on the page: no server round trip and no plotly redraw
   (redrawing a plotly strip's token text took 230-320 ms at 400 tokens). Served locally by Dash. */
(function () {
const DTYPES = {f4: Float32Array, f8: Float64Array, f2: null};
const decoded = new WeakMap();

/* Row ``q`` of a heatmap's z: nested lists, or plotly's base64 block {dtype, bdata, shape} (how a
   numpy array arrives); the decoded block is kept per figure, so a hover decodes nothing. */
function zRow(z, q) {
  if (Array.isArray(z)) { return z[q]; }
  if (!z || typeof z !== "object") { return null; }
  let block = decoded.get(z);
  if (!block) {
    const Typed = DTYPES[z.dtype];
    if (!Typed || typeof z.bdata !== "string") { return null; }
    // a plain loop: Uint8Array.from(text, mapper) walks the string as an iterator, ~100 ms a click
    // at 424 tokens (Chromium profile), where this takes a few
    const text = atob(z.bdata), bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) { bytes[i] = text.charCodeAt(i); }
    const cols = parseInt(String(z.shape).split(",")[1], 10);
    block = {values: new Typed(bytes.buffer), cols: cols};
    decoded.set(z, block);
  }
  return block.values.subarray(q * block.cols, (q + 1) * block.cols);
}

/* The figure builders escape token text for plotly (app/figures.py safe_text); spans take it as text. */
function unescape(text) {
  return String(text).replace(/&lt;/g, "<").replace(/&gt;/g, ">").replace(/&amp;/g, "&");
}

function parseRgb(colour) {
  const m = /rgba?\(([^)]+)\)/.exec(colour);
  if (m) { return m[1].split(",").slice(0, 3).map(Number); }
  const hex = /^#([0-9a-f]{6})$/i.exec(colour);
  if (hex) { return [0, 2, 4].map(i => parseInt(hex[1].slice(i, i + 2), 16)); }
  return [255, 255, 255];
}

/* 256 colours sampled from a plotly colorscale [[v, colour], ...] (linear between stops, as plotly
   colours a heatmap), each with the text colour that stays readable on it. */
function lookup(colorscale) {
  const stops = colorscale.map(([v, c]) => [Number(v), parseRgb(c)]);
  const table = [];
  for (let i = 0; i < 256; i++) {
    const t = i / 255;
    let k = 1;
    while (k < stops.length - 1 && stops[k][0] < t) { k++; }
    const [v0, c0] = stops[k - 1], [v1, c1] = stops[k];
    const f = v1 > v0 ? Math.min(1, Math.max(0, (t - v0) / (v1 - v0))) : 0;
    const rgb = c0.map((a, j) => Math.round(a + f * (c1[j] - a)));
    const luminance = (0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]) / 255;
    table.push({bg: `rgb(${rgb.join(",")})`, fg: luminance < 0.5 ? "#fff" : "#1f2328"});
  }
  return table;
}

let strip = null;  // what the drawn strip shows: {el, spans, tokens, n, colours, query}
// while Run's previewed grid is shown: its mark and the grid it replaced
let replaced = null;
// Run's button and click count when Cancel was last clicked (a page opened again has a new button,
// whose count starts again from 0); ``button``: its id, from the callback
let cancelledAt = null;
const cancelled = (runs, button) => cancelledAt !== null && cancelledAt.runs === runs
  && cancelledAt.button === document.getElementById(button);

/* The mark "preview|run|metric|layer|head" a grid figure carries while it is Run's preview, or null. */
function markOf(figure) {
  const mark = figure && typeof figure === "object" && figure.layout && figure.layout.meta
    && figure.layout.meta.preview;
  return typeof mark === "string" && mark.startsWith("preview|") ? mark : null;
}

/* A banner that says something (Dash children: a string, a component or a list of them). */
function says(children) {
  if (children === null || children === undefined || children === "") { return false; }
  return !(Array.isArray(children) && children.every(c => !says(c)));
}

function weightText(w) { return w === null ? "not visible to this query" : w.toFixed(4); }

/* Recolour the spans by row ``query`` of the heatmap graph ``heat`` (a plotly graph div, or a Dash
   figure); false when that heatmap is not this run's (a head click still on its way). */
function paint(query, heat) {
  if (!strip || !strip.el.isConnected || !heat) { return false; }
  const meta = heat.layout && heat.layout.meta;
  if (!meta || meta.n !== strip.n || !heat.data || !heat.data[0]) { return false; }
  if (!Number.isInteger(query) || query < 0 || query >= strip.n) { return false; }
  const row = zRow(heat.data[0].z, query);
  if (!row) { return false; }
  let top = 1e-6;
  for (let i = 0; i <= query; i++) {
    const w = row[i];
    if (w !== null && !Number.isNaN(w) && w > top) { top = w; }
  }
  for (let i = 0; i < strip.n; i++) {
    const span = strip.spans[i];
    const raw = i <= query ? row[i] : null;
    const w = raw === null || raw === undefined || Number.isNaN(raw) ? null : raw;
    if (w === null) {
      span.style.backgroundColor = "";
      span.style.color = "";
    } else {
      const c = strip.colours[Math.min(255, Math.max(0, Math.round(255 * w / top)))];
      span.style.backgroundColor = c.bg;
      span.style.color = c.fg;
    }
    span.dataset.weight = w === null ? "" : String(w);
    span.title = `position ${i}: ${strip.tokens[i]}\nweight ${weightText(w)}`;
  }
  if (strip.query !== null && strip.spans[strip.query]) { strip.spans[strip.query].classList.remove("hs-token-query"); }
  strip.spans[query].classList.add("hs-token-query");
  strip.query = query;
  strip.title.textContent = `Attention from token ${query} (${strip.tokens[query]}) — layer ${meta.layer}, head ${meta.head}`;
  strip.top.textContent = top.toFixed(4);
  return true;
}

function heatmapGraph() {
  return strip && document.querySelector(`#${strip.el.dataset.heatmap} .js-plotly-plot`);
}

/* Hovering a span: recolour at once, then tell the page which token is selected (exports use it). */
document.addEventListener("mouseover", event => {
  const span = event.target.closest && event.target.closest("[data-pos]");
  if (!span || !strip || !strip.el.contains(span)) { return; }
  const query = Number(span.dataset.pos);
  if (query === strip.query || !paint(query, heatmapGraph())) { return; }
  const store = strip.el.dataset.queryStore;
  if (store && window.dash_clientside.set_props) { window.dash_clientside.set_props(store, {data: query}); }
});

window.dash_clientside = Object.assign({}, window.dash_clientside, {
  headscope: Object.assign({}, (window.dash_clientside || {}).headscope, {
    /* Draw the strip (spans) from the token-strip figure the server built (app/figures.py
       token_strip, the figure its export holds); none, and hidden, when the page shows no strip. */
    drawStrip: function (figure, id) {
      const el = document.getElementById(id);
      const meta = figure && figure.layout && figure.layout.meta;
      if (!el) { return window.dash_clientside.no_update; }
      el.replaceChildren();
      strip = null;
      if (!meta || !meta.per_row) { return "hs-token-strip hs-hidden"; }
      const trace = figure.data[0];
      const tokens = [];
      for (let i = 0; i < meta.n; i++) {
        tokens.push(unescape(trace.text[Math.floor(i / meta.per_row)][i % meta.per_row]));
      }
      const title = document.createElement("div");
      title.className = "hs-strip-title";
      const legend = document.createElement("div");
      legend.className = "hs-strip-legend";
      const colours = lookup(trace.colorscale);
      const bar = document.createElement("span");
      bar.className = "hs-strip-bar";
      bar.style.background = `linear-gradient(to right, ${[0, 64, 128, 192, 255].map(i => colours[i].bg).join(", ")})`;
      const top = document.createElement("span");
      legend.append("colour: weight 0 ", bar, " ", top, " (this row's largest); uncoloured: keys after the query");
      const body = document.createElement("div");
      body.className = "hs-strip-body";
      const spans = tokens.map((token, i) => {
        const span = document.createElement("span");
        span.className = "hs-token";
        span.dataset.pos = String(i);
        span.textContent = token;
        return span;
      });
      body.append(...spans);
      el.append(title, legend, body);
      strip = {el: el, spans: spans, tokens: tokens, n: meta.n, colours: colours, query: null, title: title, top: top};
      // the first view is the row the server drew (its query), so it needs no heatmap
      const per = meta.per_row;
      const query = Number.isInteger(meta.query) ? meta.query : meta.n - 1;
      const z = [];
      z[query] = Array.from({length: meta.n}, (_, i) => trace.z[Math.floor(i / per)][i % per]);
      paint(query, {layout: {meta: {n: meta.n}}, data: [{z: z}]});
      title.textContent = unescape((figure.layout.title && figure.layout.title.text) || "");
      return "hs-token-strip";
    },


    /* Run's grid, sent by its job before the run is stored (app/pages/attention.py _grid_preview):
       drawn at once, with its mark as the view drawn, so the render that follows sends only the
       heatmap. Not drawn if Cancel was clicked during this Run, nor if it comes with the job's end
       and the banner already says something (a dead job's message comes before the job's last
       report in the same answer). What it replaced is kept, to be put back if the job ends without
       its run (withdrawPreview). */
    previewGrid: function (preview, grid, drawn, running, runs, banner, button) {
      const skip = window.dash_clientside.no_update;
      const mark = markOf(preview);
      if (mark === null || drawn === mark || cancelled(runs, button) || (running !== true && says(banner))
          || (typeof drawn === "string" && drawn.startsWith(mark.split("|")[1] + "|"))) {
        return [skip, skip];  // (the last: the render of the stored run came first and drew it whole)
      }
      replaced = {mark: mark, grid: grid};
      return [preview, mark];
    },

    /* The job ended without its run: an error or a dead job in the banner, or Cancel. If the grid is
       still the preview (its layout.meta.preview) and the URL does not name its run, the grid it
       replaced comes back, and the next render draws whole figures. */
    withdrawPreview: function (banner, cancels, grid, search, runs, button) {
      const skip = window.dash_clientside.no_update;
      const triggered = (window.dash_clientside.callback_context.triggered || [])[0];
      if (!triggered) { return [skip, skip]; }
      if (triggered.prop_id.endsWith(".n_clicks")) {
        cancelledAt = {button: document.getElementById(button), runs: runs};  // its preview is not drawn
      } else if (!says(banner)) {
        return [skip, skip];
      }
      const mark = markOf(grid);
      if (!replaced || mark === null || mark !== replaced.mark) { return [skip, skip]; }
      const key = mark.split("|")[1] || "";
      const named = new URLSearchParams(typeof search === "string" ? search : "").get("run");
      if (named && key.toLowerCase().startsWith(named.toLowerCase())) { return [skip, skip]; }  // it arrived
      const back = replaced;
      replaced = null;
      return [back.grid, null];
    },

    /* A new heatmap (a head click): the strip shows its row ``query`` (the page's selected token). */
    followHead: function (heat, query) {
      if (strip) { paint(Number.isInteger(query) ? query : strip.n - 1, heat); }
    },

    /* Hovering or clicking a heatmap row selects that query token: the strip follows. */
    followQuery: function (heatHover, heatClick, heat) {
      const skip = window.dash_clientside.no_update;
      const triggered = (window.dash_clientside.callback_context.triggered || [])[0];
      if (!triggered || !strip) { return skip; }
      const event = triggered.prop_id.endsWith("clickData") ? heatClick : heatHover;
      const point = event && event.points && event.points[0];
      if (!point) { return skip; }
      const query = parseInt(String(point.y).split(" ", 1)[0], 10);
      if (query === strip.query || !paint(query, heat)) { return skip; }
      return query;
    },
  }),
});
})();
