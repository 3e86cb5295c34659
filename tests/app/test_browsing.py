"""The browser tests' own steps (tests/app/browsing.py), on a page made for them: a step that
fails while the page redraws makes a test fail that the page passed (#38 item 24: a grid click
failed with "Element is not attached to the DOM" once in 14 runs)."""

from __future__ import annotations

import pytest

from tests.app.browsing import click_cell

pytestmark = pytest.mark.browser

# A 9 × 30 plot area that the page replaces on every frame for a while after it says it is ready,
# as dcc.Graph replaces its placeholder once plotly has loaded, and plotly its drag layer on a
# redraw. Each click records the cell it fell in.
REDRAWN = """<!doctype html><title>Updating...</title>
<div id="grid"></div>
<script>
window.clicks = [];
window.redraws = 0;
function draw() {
  const g = document.createElement('div');
  g.id = 'grid';
  g.innerHTML = '<svg width="450" height="600"><g class="draglayer">' +
                '<rect class="nsewdrag" x="0" y="0" width="450" height="600" fill="#ddd"></rect></g></svg>';
  g.querySelector('.nsewdrag').addEventListener('click', (e) => {
    const r = e.target.getBoundingClientRect();
    window.clicks.push([Math.floor((e.clientX - r.left) / r.width * 9), Math.floor((e.clientY - r.top) / r.height * 30)]);
  });
  document.getElementById('grid').replaceWith(g);
  window.redraws += 1;
}
draw();
setTimeout(() => {
  document.title = 'ready';
  const until = performance.now() + REDRAW_MS;
  const step = () => { draw(); if (performance.now() < until) requestAnimationFrame(step); };
  requestAnimationFrame(step);
}, 200);
</script>"""


@pytest.mark.parametrize("redraw_ms", [0, 1500])
def test_click_cell_clicks_the_cell_while_the_grid_is_replaced(page, redraw_ms):
    page.set_content(REDRAWN.replace("REDRAW_MS", str(redraw_ms)))
    click_cell(page, "grid", col=2, row=4, n_cols=9, n_rows=30)
    page.wait_for_function("() => window.clicks.length > 0")
    assert page.evaluate("window.clicks") == [[2, 4]]
    if redraw_ms:
        assert page.evaluate("window.redraws") > 10  # the area was replaced many times meanwhile
