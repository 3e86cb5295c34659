/* headscope: a background job's change of the page's URL, put into the URL as it is when the job
   ends (app.components.url_patch: what each field means). The job sends the URL it read when it
   started ("started"; "before": as the server reads it) and the one it made ("after"):
   - by default only the keys that differ between "before" and "after", and those in "reset", are set
     or removed, so what the user changed while the job ran (a score, a method) stays;
   - with "keep" (a new text), "after" is taken whole but for the settings in "keep" the user changed
     meanwhile, and written even if the URL already says it (the run is drawn);
   - a result computed on a key ("on", e.g. the run) that the page no longer shows is not put in:
     the banner says so, and so does the job's status line ("status"), which the job's answer filled
     with the result's numbers.
   Served locally by Dash. */
(function () {
const params = (s) => new URLSearchParams(typeof s === "string" ? s : "");
const list = (value) => (Array.isArray(value) ? value.filter((key) => typeof key === "string") : []);
const listOrNone = (value) => value === undefined || value === null || Array.isArray(value);
// what the server sends (app.components.url_patch); anything else (a forged answer) writes nothing
const valid = (patch) => patch !== null && typeof patch === "object" && typeof patch.after === "string" &&
  typeof patch.before === "string" && listOrNone(patch.on) && listOrNone(patch.reset) && listOrNone(patch.keep);
const started = (patch) => params(typeof patch.started === "string" ? patch.started : patch.before);
// a job's status line (an element with role="status"): the only element a patch may write to
const statusLine = (id) => {
  const line = typeof id === "string" ? document.getElementById(id) : null;
  return line !== null && line.getAttribute("role") === "status";
};
const id = (value) => (value === null ? null : value.toLowerCase());  // run and result ids: any case
const stale = (patch, search) => {
  const then = started(patch), now = params(search);
  return list(patch.on).some((key) => id(then.get(key)) !== id(now.get(key)));
};
const same = (a, b) => JSON.stringify([...a.entries()].sort()) === JSON.stringify([...b.entries()].sort());
function put(into, key, value) {
  if (value === null) { into.delete(key); } else { into.set(key, value); }
}

window.dash_clientside = Object.assign({}, window.dash_clientside, {
  headscope_url: {
    merge: function (patch, search) {
      const skip = window.dash_clientside.no_update;
      if (!valid(patch) || stale(patch, search)) { return skip; }
      const before = params(patch.before), after = params(patch.after), now = params(search);
      let out;
      if (patch.keep !== undefined && patch.keep !== null) {
        const then = started(patch);
        out = params(patch.after);
        for (const key of list(patch.keep)) {
          if (now.get(key) !== then.get(key)) { put(out, key, now.get(key)); }  // changed meanwhile
        }
      } else {
        out = params(search);
        const reset = new Set(list(patch.reset));
        for (const key of new Set([...before.keys(), ...after.keys(), ...reset])) {
          if (reset.has(key) || after.get(key) !== before.get(key)) { put(out, key, after.get(key)); }
        }
      }
      // a Run's URL is written even when it names what the URL already does, so the run it computed is
      // drawn (a link to a run missing from the store says "run the text again": that Run gives the
      // same id, and the page stayed empty); written as it stands, so no history entry is added
      if (same(out, now)) { return Array.isArray(patch.keep) ? search : skip; }
      const text = out.toString();
      return text ? "?" + text : "";
    },
    apply: function (patch, search) {
      const skip = window.dash_clientside.no_update;
      if (valid(patch) && stale(patch, search)) {
        const what = typeof patch.what === "string" && patch.what ? patch.what : "This result";
        const set = window.dash_clientside.set_props;
        if (set && statusLine(patch.status)) {
          set(patch.status, {children: "Not shown: computed for the text the page showed when it started."});
        }
        return [skip, what + " was computed for what the page showed when it started, not for what it " +
                      "shows now, so it is not shown: run it again here."];
      }
      return [window.dash_clientside.headscope_url.merge(patch, search), skip];
    },
  },
});
})();
