/* headscope: a page fills its text box from the run its link names (the render's text goes to a
   store, and this puts it in the box). It never replaces what the user wrote: the same run drawn
   again (a head click, a metric) leaves the box alone, so an edit not yet run stays; a new run's
   text is put in unless the user is typing in the box right now (focused, and changed since it was
   last filled), as when they type while a link is still loading. Served locally by Dash. */
(function () {
window.dash_clientside = Object.assign({}, window.dash_clientside, {
  headscope_text: {
    fill: function (text, id) {
      const skip = window.dash_clientside.no_update;
      const box = document.getElementById(id);
      if (typeof text !== "string" || !box) { return skip; }
      const last = box.dataset.hsFilled;
      if (text === last) { return skip; }
      const typing = document.activeElement === box && box.value !== (last === undefined ? "" : last);
      box.dataset.hsFilled = text;
      return typing ? skip : text;
    },
  },
});
})();
