/* headscope: clicks on a layer × head grid (the Attention, Heads, QK, Ablation, Patching and Compare pages),
   applied in the browser, in order.

   A click is read from the mouse event itself (where the button went down and came up), not from
   plotly's click event: plotly reports the point its last hover found, and its hover runs at most
   every 50 ms and again after each redraw, so a second click soon after the first was reported as
   the first cell again (one head toggled twice, the other never). The toggle reads the selection
   where Dash keeps it (the page's store, read synchronously) and writes it back at once with
   ``dash_clientside.set_props``, with the heads box and the boxed markers and count on the map: no
   server round trip, no Dash callback in between (a callback queued behind another click's read the
   selection before that click was applied, or was dropped for the newer click). The line under the
   box follows in the browser (assets/ablation.js), and the server redraws the map only if its run
   or score changed meanwhile (app/pages/ablation.py ``draw_map``). On the Attention, Heads and
   QK pages, and on any of the Compare page's three grids, a click selects that head in the page's
   URL, as a link would (their renders draw it): read from plotly's click, a second click while the
   first head was being drawn was read as the first. On
   the Patching page's map a click asks for that head's per-position patching. */
(function () {
const GRID = "hs-abl-grid", PENDING = "hs-abl-pending", HEADS = "hs-abl-heads";
const ATTENTION_URL = "attn-hs-url", HEADS_URL = "heads-hs-url", QK_URL = "qk-hs-url", COMPARE_URL = "cmp-hs-url";  // app/components.py url_id(page prefix)
const PATCHING_MAP = "hs-pat-map", PATCHING_CLICK = "hs-pat-click";  // app/ids.py
const CHOSEN_TRACE = "chosen";  // the uid of the boxed markers' trace (app/figures.py head_selection)
const MOVE = 4;  // pixels: a press that moves further is a drag (a zoom), not a click

function props(id) {
  const api = window.dash_component_api;
  const component = api && api.getLayout ? api.getLayout(id) : null;
  return component && component.props ? component.props : null;
}

/* The (layer, head) under client point (x, y) of graph div ``gd`` on its subplot ``subplot`` (plotly's
   name for a pair of axes: "xy", "x2y2", …; the Compare page draws three grids side by side): that
   subplot's axis ranges over its plot area (its drag box), cells centred on whole numbers (a reversed
   layer axis included). */
function cellAt(gd, subplot, x, y) {
  const layout = gd && gd._fullLayout, names = /^x(\d*)y(\d*)$/.exec(subplot || "");
  const drag = names && gd.querySelector(".draglayer ." + subplot + " .nsewdrag");
  const xaxis = names && layout && layout["xaxis" + names[1]], yaxis = names && layout && layout["yaxis" + names[2]];
  if (!xaxis || !yaxis || !drag) { return null; }
  const box = drag.getBoundingClientRect();
  if (!box.width || !box.height) { return null; }
  const [x0, x1] = xaxis.range, [y0, y1] = yaxis.range;
  const head = Math.round(x0 + (x - box.left) / box.width * (x1 - x0));
  const layer = Math.round(y1 + (y - box.top) / box.height * (y0 - y1));
  // a cell on the map: the edge pixel of a [-0.5, n - 0.5] range rounds to n, a head that is not there
  const within = (v, a, b) => v >= Math.max(0, Math.ceil(Math.min(a, b))) && v <= Math.floor(Math.max(a, b));
  return Number.isInteger(head) && Number.isInteger(layer) && within(head, x0, x1) && within(layer, y0, y1)
    ? [layer, head] : null;
}

function sortedHeads(set) {
  return Array.from(set, h => h.split(".").map(Number)).sort((a, b) => a[0] - b[0] || a[1] - b[1]);
}

/* Toggle (layer, head) in the pending selection; repaint the boxes and the count on the map. */
function toggle(layer, head) {
  const grid = props(GRID), store = props(PENDING);
  const figure = grid && grid.figure;
  const marks = figure && Array.isArray(figure.data) ? figure.data.findIndex(t => t && t.uid === CHOSEN_TRACE) : -1;
  if (marks < 0 || !store) { return; }  // no heads to choose on this map (no run and no sweep yet)
  const pending = store.data;
  const heads = new Set(typeof pending === "string" && pending ? pending.split(",") : []);
  const key = layer + "." + head;
  if (heads.has(key)) { heads.delete(key); } else { heads.add(key); }
  const pairs = sortedHeads(heads);
  const text = pairs.map(h => h[0] + "." + h[1]).join(",");
  const data = figure.data.slice();
  data[marks] = Object.assign({}, data[marks], {x: pairs.map(h => h[1]), y: pairs.map(h => h[0])});
  const title = Object.assign({}, figure.layout.title);
  title.text = String(title.text || "").replace(/^\d+ heads chosen/, pairs.length + " heads chosen");
  const set = window.dash_clientside.set_props;
  set(PENDING, {data: text});
  set(HEADS, {value: text});
  set(GRID, {figure: Object.assign({}, figure, {data: data, layout: Object.assign({}, figure.layout, {title: title})})});
}

/* Select (layer, head) on the page whose URL store is ``urlId`` (keys as app/url_state.py names them),
   where the page's render reads it, once graph ``gridId`` shows a map (no run or sweep yet: nothing to
   select) and ``only`` (if given) accepts the URL's parameters. ``drop``: the keys a new head resets,
   as the page's server did (the Attention and QK query token, the Heads page's trial). */
function selectHead(urlId, gridId, drop, only) {
  return function (layer, head) {
    const url = props(urlId), grid = props(gridId);
    const figure = grid && grid.figure;
    if (!url || !figure || !Array.isArray(figure.data) || !figure.data.length) { return; }
    const params = new URLSearchParams(url.search || "");
    if (only && !only(params)) { return; }
    params.set("layer", String(layer));
    params.set("head", String(head));
    drop.forEach(key => params.delete(key));
    const search = "?" + params.toString();
    if (search !== url.search) { window.dash_clientside.set_props(urlId, {search: search}); }
  };
}

/* The Patching page's map: a click on a head asks for that head's patching position by position (a
   background job, app/pages/patching.py run_positions) through the page's store; the count makes the
   same head clicked again a new request. */
let patchingClicks = 0;
function patchPositions(layer, head) {
  const map = props(PATCHING_MAP);
  const figure = map && map.figure;
  if (!figure || !Array.isArray(figure.data) || !figure.data.length) { return; }  // no run yet
  // the residual stream's map is layer × position already: no head to patch by position (app/views/patching.py)
  if (figure.layout && figure.layout.meta && figure.layout.meta.cells === "positions") { return; }
  patchingClicks += 1;
  window.dash_clientside.set_props(PATCHING_CLICK, {data: {layer: layer, head: head, click: patchingClicks}});
}

/* The Heads page's retrieval map has a cell per query head only under the query-head aggregation
   (under a key-value group view its cells are groups, not heads). */
const perQueryHead = params => (params.get("agg") || "query") === "query";

const GRIDS = {  // graph id → what a click on a cell does
  "hs-abl-grid": toggle,
  "hs-grid": selectHead(ATTENTION_URL, "hs-grid", ["query"]),
  "hs-heads-grid": selectHead(HEADS_URL, "hs-heads-grid", ["trial"], perQueryHead),
  "hs-heads-score-grid": selectHead(HEADS_URL, "hs-heads-score-grid", ["trial"]),
  "hs-qk-rank-map": selectHead(QK_URL, "hs-qk-rank-map", ["query"]),
  [PATCHING_MAP]: patchPositions,
  "hs-cmp-grids": selectHead(COMPARE_URL, "hs-cmp-grids", []),  // any of its three grids (first, second, change)
};

let pressed = null;
document.addEventListener("mousedown", function (e) {
  const drag = e.button === 0 && e.target.closest ? e.target.closest(".nsewdrag") : null;
  const id = drag ? Object.keys(GRIDS).find(g => drag.closest("#" + g)) : undefined;
  const subplot = drag && drag.parentNode ? drag.parentNode.getAttribute("class") : null;  // <g class="x2y2">
  pressed = id ? {id: id, subplot: subplot, x: e.clientX, y: e.clientY} : null;
}, true);
document.addEventListener("mouseup", function (e) {
  const p = pressed;
  pressed = null;
  if (!p || e.button !== 0 || Math.hypot(e.clientX - p.x, e.clientY - p.y) > MOVE) { return; }
  const graph = document.getElementById(p.id);
  const cell = cellAt(graph && graph.querySelector(".js-plotly-plot"), p.subplot, p.x, p.y);
  if (cell) { GRIDS[p.id](cell[0], cell[1]); }
}, true);
})();
