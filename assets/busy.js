/* headscope: a long action shown as busy (app/components.py show_busy), the same way on every page.
   Dash disables the action's button while its job runs (the callback's ``running``); that change,
   not the click itself, starts and ends the busy state, so a job started by a link or a URL change
   shows it too, and a click that starts no job leaves nothing marked. While the job runs:
   - its status line says the job is starting until the job's first progress report replaces it,
     and its progress bar runs without a value (the browser's indeterminate bar);
   - when the job was started by a click on the button (its click is newer than the last job's
     start), the error banner is cleared: a message about an earlier try no longer stands over this
     one. A job a link starts by itself leaves the banner, which speaks of that link;
   - each figure the job will replace is marked stale: faded, with a caption (assets/headscope.css).
     The mark is a flag in the graph's style (``--hs-stale``), not a class: a dcc.Graph redraws for
     a new figure, id or style only, so a class set on it would never reach the page.
   When the button is enabled again (the job answered, failed, died or was cancelled) the marks go,
   and a status line that still says "starting" (a job that ended before reporting) is cleared.
   Served locally by Dash. */
(function () {
const FLAG = "--hs-stale";

/* ``style`` with the stale flag set (``on``) or removed; no_update when it is so already. */
function marked(style, on) {
  const was = style !== null && typeof style === "object" && FLAG in style;
  if (was === on) { return window.dash_clientside.no_update; }
  const out = Object.assign({}, style !== null && typeof style === "object" ? style : {});
  if (on) { out[FLAG] = "1"; } else { delete out[FLAG]; }
  return out;
}

const started = {};  // button id → the click time (ms) of the last job started by a click of it

window.dash_clientside = Object.assign({}, window.dash_clientside, {
  headscope_busy: {
    /* The outputs for the button's ``disabled`` = ``busy``: [banner, status line, progress value
       (when ``withBar``), each figure's style]. ``status`` is the line as it stands, ``styles`` the
       figures' styles, ``clicked`` the button's last click time (its n_clicks_timestamp, ms),
       ``button`` its id, ``starting`` what the line says while the job starts. */
    state: function (busy, status, styles, clicked, button, starting, withBar) {
      const skip = window.dash_clientside.no_update;
      const figures = (Array.isArray(styles) ? styles : []).map((style) => marked(style, busy === true));
      if (busy === true) {
        const byClick = typeof clicked === "number" && clicked > (started[button] || 0);
        if (byClick) { started[button] = clicked; }
        return [byClick ? "" : skip, starting, ...(withBar ? [null] : []), ...figures];
      }
      return [skip, status === starting ? "" : skip, ...(withBar ? [skip] : []), ...figures];
    },
  },
});
})();
