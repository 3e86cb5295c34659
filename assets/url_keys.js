/* headscope: a store that changes only when some keys of the page's URL do (app/components.py
   url_keys_store). A page whose figures depend on different parts of its URL gives each group of
   figures such a store and draws the group from it: a click that changes one key (a head, a trial)
   then sets off only the callbacks of the figures that show it, and the others are neither asked
   for nor redrawn. Served locally by Dash. */
(function () {
window.dash_clientside = Object.assign({}, window.dash_clientside, {
  headscope_keys: {
    /* ``keys``' values in the query string ``search`` (absent keys left out), in the order of
       ``keys``; no_update when ``current`` holds the same already. */
    pick: function (search, current, keys) {
      const params = new URLSearchParams(typeof search === "string" ? search : "");
      const out = {};
      (Array.isArray(keys) ? keys : []).forEach((key) => {
        if (params.has(key)) { out[key] = params.get(key); }
      });
      const same = current !== null && typeof current === "object" && JSON.stringify(current) === JSON.stringify(out);
      return same ? window.dash_clientside.no_update : out;
    },
  },
});
})();
