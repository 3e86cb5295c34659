/* headscope: head lists in the browser. A list is written "3.1,5.0" (layer.head, sorted, comma-separated:
   what analysis/ablation.py format_heads writes and the Ablation page's pending store holds) and named
   on a line "L3H1, L5H0" (the first MOST, then how many more). The Ablation map's clicks toggle heads
   in a list (assets/grid_clicks.js) and the line under its heads box names them (assets/ablation.js);
   both go through these functions, the only ones that read or write a list here. Served locally by Dash. */
(function () {
const MOST = 12;  // heads named on a line; the rest are counted

/* The "layer.head" entries of a list (empty entries and a list that is not text: none). */
function entries(list) {
  return typeof list === "string" ? list.split(",").filter(Boolean) : [];
}

/* [[layer, head], ...] of a list's plain "layer.head" entries, by layer then head, each once. */
function pairs(list) {
  const seen = new Set(), out = [];
  for (const entry of entries(list)) {
    const m = /^(\d{1,7})\.(\d{1,7})$/.exec(entry);
    if (m && !seen.has(entry)) {
      seen.add(entry);
      out.push([Number(m[1]), Number(m[2])]);
    }
  }
  return out.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
}

/* The list written from pairs, as format_heads writes it. */
function written(heads) {
  return heads.map(([layer, head]) => layer + "." + head).join(",");
}

/* ``list`` with (layer, head) added, or removed if it was there: the list and its pairs. */
function toggled(list, layer, head) {
  const key = layer + "." + head;
  const kept = pairs(list).filter(([l, h]) => l + "." + h !== key);
  const heads = kept.length < pairs(list).length ? kept : pairs(list + "," + key);
  return {list: written(heads), pairs: heads};
}

/* "L3H1, L5H0" for "3.1,5.0"; past MOST heads, "… and N more". */
function names(list) {
  const heads = entries(list).map((h) => h.split(".")).filter((p) => p.length === 2);
  const named = heads.slice(0, MOST).map(([layer, head]) => `L${layer}H${head}`).join(", ");
  return named + (heads.length > MOST ? ` and ${heads.length - MOST} more` : "");
}

/* How many heads a list names. */
function count(list) {
  return entries(list).length;
}

/* Whether two lists name the same heads, whatever their order. */
function same(a, b) {
  const set = (list) => [...new Set(entries(list))].sort().join(",");
  return set(a) === set(b);
}

window.headscope_heads = Object.freeze({pairs, toggled, names, count, same});
})();
