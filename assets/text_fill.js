/* headscope: a page fills its text box from the run its link names (the render's text goes to a
   store, and this puts it in the box). It never replaces what the user wrote: text in the box that
   is neither empty nor the text last put there is the user's own (an edit not yet run, or text typed
   while a link was loading) and stays, whatever has the focus; the same run drawn again (a head
   click) leaves the box alone. An empty box is always filled: Back or Forward can rebuild the page,
   which empties the box but keeps this element and its mark. Served locally by Dash. */
(function () {
window.dash_clientside = Object.assign({}, window.dash_clientside, {
  headscope_text: {
    fill: function (text, id) {
      const skip = window.dash_clientside.no_update;
      const box = document.getElementById(id);
      if (typeof text !== "string" || !box) { return skip; }
      const edited = box.value !== "" && box.value !== box.dataset.hsFilled;
      box.dataset.hsFilled = text;
      return (edited || box.value === text) ? skip : text;
    },
  },
});
})();
