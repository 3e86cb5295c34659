/* headscope: a background job's change of the page's URL, put into the URL as it is when the job
   ends (app.components.url_patch). The job sends the URL it read when it started ("before") and the
   one it made ("after"); only the keys that differ between them are set or removed here, so what
   the user changed while the job ran (a score, a new text) stays. A result computed on a key ("on",
   e.g. the run) that the page no longer shows is not put in: the banner says so. Served locally by
   Dash. */
(function () {
const params = (s) => new URLSearchParams(typeof s === "string" ? s : "");
const valid = (patch) => patch !== null && typeof patch === "object" && typeof patch.after === "string";
const stale = (patch, search) => {
  const before = params(patch.before), now = params(search);
  return (Array.isArray(patch.on) ? patch.on : []).some((key) => before.get(key) !== now.get(key));
};
window.dash_clientside = Object.assign({}, window.dash_clientside, {
  headscope_url: {
    merge: function (patch, search) {
      const skip = window.dash_clientside.no_update;
      if (!valid(patch) || stale(patch, search)) { return skip; }
      const before = params(patch.before), after = params(patch.after), now = params(search);
      let changed = false;
      for (const key of new Set([...before.keys(), ...after.keys()])) {
        const value = after.get(key);
        if (value === before.get(key) || value === now.get(key)) { continue; }
        changed = true;
        if (value === null) { now.delete(key); } else { now.set(key, value); }
      }
      const out = now.toString();
      return changed ? (out ? "?" + out : "") : skip;
    },
    apply: function (patch, search) {
      const skip = window.dash_clientside.no_update;
      if (valid(patch) && stale(patch, search)) {
        const what = typeof patch.what === "string" && patch.what ? patch.what : "This result";
        return [skip, what + " was computed for what the page showed when it started, not for what it " +
                      "shows now, so it is not shown: run it again here."];
      }
      return [window.dash_clientside.headscope_url.merge(patch, search), skip];
    },
  },
});
})();
