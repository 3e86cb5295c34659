/* headscope: the Ablation page's effects panel and the line under its heads box. Served locally by Dash.

   One owner decides what the effects panel shows: ``reduce(state, event)``, a pure function, run in
   the browser as each event reaches the page (``asked``, ``applied`` and ``cancel`` below, one Dash
   callback per source), so events are taken in the order they arrive and against the panel as it is then. The server only produces figures: the page's render
   (app/pages/ablation.py ``render``) and the Apply job (``apply``) send them as events; neither
   decides whether they are shown.

   State (the panel store): {shows, key, row}
     shows  "note"      a message figure (nothing computed for this text and set, a cancel, a failure)
            "computing" a link's effects are being computed (its Apply job runs)
            "effects"   the effects of ``key`` (the text and applied set), with their summary
     key    JSON of [model, run, heads, method, ref, source] the panel is for (null before any render)
     row    the effects' numbers that Keep adds to the table (only while shows is "effects")

   Events and what they do (each row is tested in tests/app/test_ablation_state.py):

     event                                   state                      result
     ------------------------------------------------------------------------------------------------
     asked (a render answered)               any, for a URL the page   nothing (a render of a URL the
       {search, key, figure, computing,        has left                  page has left)
        cancelled}                           effects or computing of   nothing (effects an Apply drew
                                               the same key              while the render ran stay; a
                                                                         link's "computing" stays)
                                             otherwise                 its figure, no summary; shows
                                                                         "computing" if the render
                                                                         started a link's job, else "note"
     applied (Apply's effects)               any, run not the URL's    nothing (computed on a text the
       {key, figure, summary, row}                                       page no longer shows)
                                             any, same run             the effects, summary and row
     failed (Apply refused the set)          computing                 its figure ("No effects: why")
       {failed: figure}                      note or effects           nothing (the status line says why)
     cancel (Cancel clicked)                 effects                   status: the effects shown stay
       {figure: the render's cancelled}      note or computing         the cancelled figure, status: none
                                                                         computed
     anything else (forged, unknown)         any                       nothing

   A state or event that is not one this page writes (a forged store) reads as the empty state or
   no event. */
(function () {
const heads = () => window.headscope_heads;  // assets/head_lists.js (loaded after this file)

const EMPTY = {shows: "note", key: null, row: null};
const KEPT = "Cancelled: the effects shown are the last applied set's; Apply computes the chosen heads again.";
const NONE = "Cancelled: no effects computed; Apply computes the chosen heads' effects.";

const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const isFigure = (v) => isObject(v) && (Array.isArray(v.data) || isObject(v.layout));
const keyOf = (v) => (Array.isArray(v) ? JSON.stringify(v) : null);
const runOf = (search) => (new URLSearchParams(typeof search === "string" ? search : "").get("run") || "").toLowerCase();

function valid(state) {
  if (!isObject(state) || !["note", "computing", "effects"].includes(state.shows)) { return EMPTY; }
  const key = typeof state.key === "string" ? state.key : null;
  const row = state.shows === "effects" && isObject(state.row) ? state.row : null;
  return {shows: state.shows, key, row};
}

// (state, event) -> {state, figure?, summary?, status?}: what the panel shows after ``event``; a
// missing figure, summary or status is left as it is. ``event.now`` is the page's URL when it arrives.
function reduce(state, event) {
  const s = valid(state);
  const e = isObject(event) ? event : {};
  if (e.type === "asked") {
    if (typeof e.search !== "string" || e.search !== e.now || !isFigure(e.figure)) { return {state: s}; }
    const key = keyOf(e.key);
    if ((s.shows === "effects" || s.shows === "computing") && key !== null && s.key === key) { return {state: s}; }
    return {state: {shows: e.computing === true ? "computing" : "note", key, row: null}, figure: e.figure, summary: ""};
  }
  if (e.type === "applied") {
    if (!Array.isArray(e.key) || typeof e.key[1] !== "string" || !isFigure(e.figure) ||
        e.key[1].toLowerCase() !== runOf(e.now)) { return {state: s}; }
    const summary = isObject(e.summary) || typeof e.summary === "string" ? e.summary : "";
    return {state: {shows: "effects", key: keyOf(e.key), row: isObject(e.row) ? e.row : null}, figure: e.figure, summary};
  }
  if (e.type === "failed") {
    if (s.shows !== "computing" || !isFigure(e.figure)) { return {state: s}; }
    return {state: {...s, shows: "note"}, figure: e.figure, summary: ""};
  }
  if (e.type === "cancel") {
    if (s.shows === "effects") { return {state: s, status: KEPT}; }
    const after = {state: {...s, shows: "note"}, status: NONE};
    return isFigure(e.figure) ? {...after, figure: e.figure, summary: ""} : after;
  }
  return {state: s};
}

// what a Dash callback writes after ``event``: [figure, summary, state] and, for a Cancel, the status;
// nothing where nothing changed. Dash reads the State of callbacks asked together before it writes
// what any of them returns, so a callback that wrote back the state it read would undo another's.
function step(state, event, withStatus) {
  const skip = window.dash_clientside.no_update;
  const out = reduce(state, event);
  const same = JSON.stringify(out.state) === JSON.stringify(valid(state));
  const written = [out.figure ?? skip, "summary" in out ? out.summary : skip, same ? skip : out.state];
  return withStatus ? [...written, out.status ?? skip] : written;
}

// One Dash callback per event source, each the same reducer: Dash holds a callback while any of its
// Inputs is the output of a callback under way, so one callback over all three would hold a render's
// answer and a Cancel until the Apply job ends.
window.dash_clientside = Object.assign({}, window.dash_clientside, {
  headscope_ablation: {
    reduce,
    asked: (asked, search, state) => step(state, {...(isObject(asked) ? asked : {}), type: "asked", now: search}),
    applied: function (applied, search, state) {
      const event = !isObject(applied) ? {} : "failed" in applied ? {type: "failed", figure: applied.failed}
        : {...applied, type: "applied"};
      return step(state, {...event, now: search});
    },
    cancel: (clicks, asked, state) => step(state, !clicks ? {} : {type: "cancel", figure: isObject(asked) ? asked.cancelled : null}, true),
    line: function (pending, shown) {
      const chosen = typeof pending === "string" ? pending : "";
      if (!chosen) { return "No heads chosen: click heads in the map (or type them), then Apply."; }
      const n = heads().count(chosen);
      const row = shown !== null && typeof shown === "object" ? shown.row : null;
      const applied = row !== null && typeof row === "object" && typeof row.heads === "string" ? row.heads : null;
      if (applied !== null && heads().same(applied, chosen)) { return `${n} heads applied: ${heads().names(chosen)}`; }
      return `${n} heads chosen: ${heads().names(chosen)} — Apply to compute their effects`;
    },
  },
});
})();
