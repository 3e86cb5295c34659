/* headscope: the Attention page's token strip follows the hovered token or heatmap row in the
   browser, from the heatmap already on the page (no server round trip). Served locally by Dash. */
(function () {
const DTYPES = {f4: Float32Array, f8: Float64Array, f2: null};
const decoded = new WeakMap();

/* Row ``q`` of a heatmap's z: nested lists, or plotly's base64 block {dtype, bdata, shape} (how a
   numpy array arrives); the decoded block is kept per figure, so a hover decodes nothing. */
function zRow(z, q) {
  if (Array.isArray(z)) { return z[q]; }
  let block = decoded.get(z);
  if (!block) {
    const Typed = DTYPES[z.dtype];
    if (!Typed || typeof z.bdata !== "string") { return null; }
    const bytes = Uint8Array.from(atob(z.bdata), ch => ch.charCodeAt(0));
    const cols = parseInt(String(z.shape).split(",")[1], 10);
    block = {values: new Typed(bytes.buffer), cols: cols};
    decoded.set(z, block);
  }
  const row = block.values.subarray(q * block.cols, (q + 1) * block.cols);
  return Array.from(row, v => (Number.isNaN(v) ? null : v));
}

window.dash_clientside = Object.assign({}, window.dash_clientside, {
  headscope: Object.assign({}, (window.dash_clientside || {}).headscope, {
    followQuery: function (stripHover, heatHover, heatClick, heat, strip) {
      const skip = [window.dash_clientside.no_update, window.dash_clientside.no_update];
      const meta = strip && strip.layout && strip.layout.meta;
      const heatMeta = heat && heat.layout && heat.layout.meta;
      if (!meta || !meta.per_row || !heatMeta || heatMeta.n !== meta.n) { return skip; }
      const triggered = (window.dash_clientside.callback_context.triggered || [])[0];
      if (!triggered) { return skip; }
      const fromStrip = triggered.prop_id === "hs-strip.hoverData";  // app/ids.py: STRIP
      const event = fromStrip ? stripHover : (triggered.prop_id.endsWith("clickData") ? heatClick : heatHover);
      const point = event && event.points && event.points[0];
      if (!point) { return skip; }
      const query = fromStrip ? Number(point.y) * meta.per_row + Number(point.x)
        : parseInt(String(point.y).split(" ", 1)[0], 10);
      if (!Number.isInteger(query) || query < 0 || query >= meta.n || query === meta.query) { return skip; }
      const row = zRow(heat.data[0].z, query);
      if (!row) { return skip; }
      const per = meta.per_row;
      const old = strip.data[0];
      const z = old.z.map(r => r.slice());
      const custom = old.customdata.map(r => r.map(c => c.slice()));
      let top = 1e-6;
      for (let i = 0; i < meta.n; i++) {
        const r = Math.floor(i / per), c = i % per;
        const w = i <= query && row[i] !== null && row[i] !== undefined ? row[i] : null;
        z[r][c] = w;
        custom[r][c][1] = w === null ? -1 : w;
        if (w !== null && w > top) { top = w; }
      }
      const r = Math.floor(query / per), c = query % per;
      const token = old.text[r][c];
      const title = Object.assign({}, strip.layout.title, {
        text: `Attention from token ${query} (${token}) — layer ${heatMeta.layer}, head ${heatMeta.head}`,
      });
      const shape = {type: "rect", x0: c - 0.5, x1: c + 0.5, y0: r - 0.5, y1: r + 0.5,
                     line: {color: "#e4572e", width: 2}};
      const figure = {
        data: [Object.assign({}, old, {z: z, customdata: custom, zmax: top, zmin: 0})],
        layout: Object.assign({}, strip.layout, {title: title, shapes: [shape],
                                                 meta: Object.assign({}, meta, {query: query})}),
      };
      return [figure, query];
    },
  }),
});
})();
