/* headscope: the Ablation page's line under the heads box, from the selection (the page's pending
   store) and the effects on the page (its shown store, written by Apply and cleared by a render that
   shows none): "applied" only while the effects shown are those of the heads chosen, on this text.
   Written by the server's callbacks instead, it said "applied" after a new text or Back, where the
   effects shown were not of those heads or no effects were shown. And Apply's effects of a text the
   page no longer shows do not stay on it, and a render that answers after them does not replace them.
   Served locally by Dash. */
(function () {
const heads = () => window.headscope_heads;  // assets/head_lists.js (loaded after this file)

window.dash_clientside = Object.assign({}, window.dash_clientside, {
  headscope_ablation: {
    line: function (pending, shown) {
      const chosen = typeof pending === "string" ? pending : "";
      if (!chosen) { return "No heads chosen: click heads in the map (or type them), then Apply."; }
      const n = heads().count(chosen);
      const row = shown !== null && typeof shown === "object" ? shown.row : null;
      const applied = row !== null && typeof row === "object" && typeof row.heads === "string" ? row.heads : null;
      if (applied !== null && heads().same(applied, chosen)) { return `${n} heads applied: ${heads().names(chosen)}`; }
      return `${n} heads chosen: ${heads().names(chosen)} — Apply to compute their effects`;
    },
    // Apply's effects are drawn when its job ends; if a text was run meanwhile, the page shows that
    // text, and effects of the other one (the key's run) are replaced by the figure that waits for Apply
    on_this_text: function (shown, search, waiting) {
      const skip = window.dash_clientside.no_update;
      if (shown === null || typeof shown !== "object" || !Array.isArray(shown.key) ||
          typeof shown.key[1] !== "string") { return [skip, skip, skip]; }
      const run = new URLSearchParams(typeof search === "string" ? search : "").get("run") || "";
      if (shown.key[1].toLowerCase() === run.toLowerCase()) { return [skip, skip, skip]; }
      return [waiting, "", null];
    },
    // the render's effects figure (app/pages/ablation.py _asked), decided here when its answer arrives:
    // not over effects of the same applied set already on the page (an Apply job may have drawn them
    // while the render ran: decided on the server, from the page as it was when the render started,
    // "Apply computes the effects" went over them for good), nor, while the Apply job runs, over what
    // a render drew for the same text and set (a link's "computing"); and not for a URL the page has left
    effects: function (asked, search, shown, drawnFor, applying) {
      const skip = window.dash_clientside.no_update;
      if (asked === null || typeof asked !== "object" || asked.search !== search) { return [skip, skip, skip, skip]; }
      const key = JSON.stringify(asked.key === undefined ? null : asked.key);
      const showing = shown !== null && typeof shown === "object" && Array.isArray(shown.key);
      if (showing && JSON.stringify(shown.key) === key) { return [skip, skip, skip, key]; }
      if (applying === true && drawnFor === key) { return [skip, skip, skip, skip]; }
      return [asked.figure, "", null, key];
    },
  },
});
})();
