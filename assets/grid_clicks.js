/* headscope: clicks on a layer × head grid, applied in the browser, in order.

   A page declares a grid clickable where it lays the grid out (app/components.py head_clicks): the
   graph's holder carries ``data-hs-click``, what a click on a cell does, as JSON with the ids it
   needs. This script names no page and no id; a new page's grid needs nothing here. Actions:
   - "select": the head goes into the page's URL (the Location ``url``), as a link would, and the URL
     keys in ``drop`` go (what a new head resets: a query token, a trial); only while each key of
     ``when`` has one of its values (null: the key is absent). The page's render draws it.
   - "toggle": the head goes into the selection in the store ``pending``, or out if it was there,
     written back at once with the heads box ``box`` and, on the map, the boxed markers (the trace
     whose uid is ``marks``) and the count in its title: no server round trip, no Dash callback in
     between (a callback queued behind another click's read the selection before that click was
     applied, or was dropped for the newer click).
   - "ask": the head goes to the store ``store`` with a click count (the same head clicked again is a
     new request), unless the map's cells are positions, not heads (its layout.meta.cells).
   Nothing happens while the graph shows no map (no run or sweep yet).

   A click is read from the mouse event itself (where the button went down and came up), not from
   plotly's click event: plotly reports the point its last hover found, and its hover runs at most
   every 50 ms and again after each redraw, so a second click soon after the first was reported as
   the first cell. Served locally by Dash. */
(function () {
const MOVE = 4;  // pixels: a press that moves further is a drag (a zoom), not a click

function props(id) {
  const api = window.dash_component_api;
  const component = api && api.getLayout ? api.getLayout(id) : null;
  return component && component.props ? component.props : null;
}

/* The plot area under ``target`` (an element the mouse went down on): its grid's holder, and the
   subplot's axis ranges and box on the screen; null if ``target`` is not a plot area of a clickable
   grid. The only code here that reads plotly's internals: plotly has no public API for the axis
   ranges it drew (``gd._fullLayout``: the layout with autoranged axes filled in) nor for a subplot's
   plot area (the ``.nsewdrag`` rectangle in its ``.draglayer``, whose parent's class names the
   subplot: "xy", "x2y2", …; the Compare page draws three grids side by side). */
function plotAreaAt(target) {
  const drag = target && target.closest ? target.closest(".nsewdrag") : null;
  const holder = drag ? drag.closest("[data-hs-click]") : null;
  const gd = holder ? drag.closest(".js-plotly-plot") : null;
  const subplot = drag && drag.parentNode ? drag.parentNode.getAttribute("class") : null;
  const names = /^x(\d*)y(\d*)$/.exec(subplot || "");
  const layout = gd && gd._fullLayout;
  const xaxis = names && layout && layout["xaxis" + names[1]], yaxis = names && layout && layout["yaxis" + names[2]];
  if (!xaxis || !yaxis || !Array.isArray(xaxis.range) || !Array.isArray(yaxis.range)) { return null; }
  const r = drag.getBoundingClientRect();
  return {holder: holder, x: xaxis.range.slice(0, 2), y: yaxis.range.slice(0, 2),
          box: {left: r.left, top: r.top, width: r.width, height: r.height}};
}

/* The (layer, head) at client point (px, py) of a plot area {x: head axis range, y: layer axis range,
   box: its screen rectangle}, cells centred on whole numbers (a reversed layer axis included); null
   off the cells (the edge pixel of a [-0.5, n - 0.5] range rounds to n, a head that is not there). */
function cellAt(area, px, py) {
  const box = area && area.box;
  if (!box || !(box.width > 0) || !(box.height > 0)) { return null; }
  const [x0, x1] = area.x.map(Number), [y0, y1] = area.y.map(Number);
  if (![x0, x1, y0, y1, px, py].every(Number.isFinite)) { return null; }
  const head = Math.round(x0 + (px - box.left) / box.width * (x1 - x0));
  const layer = Math.round(y1 + (py - box.top) / box.height * (y0 - y1));
  const within = (v, a, b) => v >= Math.max(0, Math.ceil(Math.min(a, b))) && v <= Math.floor(Math.max(a, b));
  return Number.isInteger(head) && Number.isInteger(layer) && within(head, x0, x1) && within(layer, y0, y1)
    ? [layer, head] : null;
}

/* The query string ``search`` with (layer, head) selected and the keys in ``drop`` removed. */
function selecting(search, layer, head, drop) {
  const params = new URLSearchParams(typeof search === "string" ? search : "");
  params.set("layer", String(layer));
  params.set("head", String(head));
  (Array.isArray(drop) ? drop : []).forEach((key) => params.delete(key));
  return "?" + params.toString();
}

/* Whether each key of ``when`` has one of its allowed values in ``search`` (null: absent). */
function holds(when, search) {
  const params = new URLSearchParams(typeof search === "string" ? search : "");
  return Object.entries(when && typeof when === "object" ? when : {})
    .every(([key, allowed]) => Array.isArray(allowed) && allowed.includes(params.get(key)));
}

const drawn = (figure) => !!figure && Array.isArray(figure.data) && figure.data.length > 0;

function select(spec, layer, head) {
  const url = props(spec.url), grid = props(spec.graph);
  if (!url || !drawn(grid && grid.figure) || !holds(spec.when, url.search)) { return; }
  const search = selecting(url.search || "", layer, head, spec.drop);
  if (search !== url.search) { window.dash_clientside.set_props(spec.url, {search: search}); }
}

function toggle(spec, layer, head) {
  const grid = props(spec.graph), store = props(spec.pending);
  const figure = grid && grid.figure;
  const marks = drawn(figure) ? figure.data.findIndex((t) => t && t.uid === spec.marks) : -1;
  if (marks < 0 || !store) { return; }  // no heads to choose on this map (no run and no sweep yet)
  const chosen = window.headscope_heads.toggled(store.data, layer, head);
  const data = figure.data.slice();
  data[marks] = Object.assign({}, data[marks], {x: chosen.pairs.map((h) => h[1]), y: chosen.pairs.map((h) => h[0])});
  const title = Object.assign({}, figure.layout && figure.layout.title);
  title.text = String(title.text || "").replace(/^\d+ heads chosen/, chosen.pairs.length + " heads chosen");
  const set = window.dash_clientside.set_props;
  set(spec.pending, {data: chosen.list});
  set(spec.box, {value: chosen.list});
  set(spec.graph, {figure: Object.assign({}, figure, {data: data, layout: Object.assign({}, figure.layout, {title: title})})});
}

let asked = 0;
function ask(spec, layer, head) {
  const map = props(spec.graph);
  const figure = map && map.figure;
  if (!drawn(figure)) { return; }  // no run yet
  if (figure.layout && figure.layout.meta && figure.layout.meta.cells === "positions") { return; }
  asked += 1;
  window.dash_clientside.set_props(spec.store, {data: {layer: layer, head: head, click: asked}});
}

const ACTIONS = {select: select, toggle: toggle, ask: ask};

/* The action a holder declares, or null if its ``data-hs-click`` is not one. */
function actionOf(holder) {
  let spec = null;
  try { spec = JSON.parse(holder.getAttribute("data-hs-click")); } catch (e) { return null; }
  return spec && typeof spec === "object" && Object.prototype.hasOwnProperty.call(ACTIONS, spec.do)
    && typeof spec.graph === "string" ? spec : null;
}

let pressed = null;
document.addEventListener("mousedown", function (e) {
  const area = e.button === 0 ? plotAreaAt(e.target) : null;
  pressed = area ? {area: area, x: e.clientX, y: e.clientY} : null;
}, true);
document.addEventListener("mouseup", function (e) {
  const p = pressed;
  pressed = null;
  if (!p || e.button !== 0 || Math.hypot(e.clientX - p.x, e.clientY - p.y) > MOVE) { return; }
  const spec = actionOf(p.area.holder), cell = cellAt(p.area, p.x, p.y);
  if (spec && cell) { ACTIONS[spec.do](spec, cell[0], cell[1]); }
}, true);

window.headscope_grid = Object.freeze({cellAt, selecting, holds});
})();
