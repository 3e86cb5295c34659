"""What a drawn figure hides by its own layout, read in the browser from the figure's SVG: a title or
colour-bar title that runs past the figure's edges, and a colour bar (its fills, ticks and title)
drawn over a plot area, over an axis's tick labels, or over another colour bar. Each hides data or
says less than the figure means to; the journeys (tests/app/test_journeys.py: ``clean``) check it
after every step on every page, and the Compare page at 1280 and 1440 px."""

from __future__ import annotations

HIDDEN_PARTS = """() => { const out = [];
    const seen = r => r.width > 0 && r.height > 0;
    const union = rects => rects.length ? {left: Math.min(...rects.map(r => r.left)), right: Math.max(...rects.map(r => r.right)),
        top: Math.min(...rects.map(r => r.top)), bottom: Math.max(...rects.map(r => r.bottom))} : null;
    const overlap = (a, b) => [Math.min(a.right, b.right) - Math.max(a.left, b.left),
                               Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top)];
    document.querySelectorAll('.js-plotly-plot').forEach(el => {
        const svg = el.querySelector('.main-svg'); if (!svg) return;
        const fig = svg.getBoundingClientRect(); if (!fig.width) return;
        const where = el.closest("[id]")?.id;
        el.querySelectorAll('.gtitle, .cbtitle').forEach(t => {
            const r = t.getBoundingClientRect(); if (!r.width) return;
            const over = Math.max(r.right - fig.right, fig.left - r.left, fig.top - r.top, r.bottom - fig.bottom);
            if (over > 1) out.push(`${where}: ${t.textContent.slice(0, 80)} (${over.toFixed(0)} px; right ${(r.right - fig.right).toFixed(0)}, left ${(fig.left - r.left).toFixed(0)}, top ${(fig.top - r.top).toFixed(0)}, bottom ${(r.bottom - fig.bottom).toFixed(0)})`);
        });
        const areas = Array.from(el.querySelectorAll('.draglayer .nsewdrag')).map(r => r.getBoundingClientRect()).filter(seen);
        const ticks = Array.from(el.querySelectorAll('.xtick text, .ytick text'))
            .map(t => [t.textContent, t.getBoundingClientRect()]).filter(([, r]) => seen(r));
        const bars = Array.from(el.querySelectorAll('.colorbar')).map(cb => union(Array.from(
            cb.querySelectorAll('.cbfills, .cbaxis text, .cbtitle, .cboutline')).map(p => p.getBoundingClientRect()).filter(seen)))
            .filter(b => b);
        bars.forEach((bar, i) => {
            areas.forEach((area, j) => { const [w, h] = overlap(bar, area);
                if (w > 1 && h > 1) out.push(`${where}: colour bar ${i} over plot area ${j} (${w.toFixed(0)} × ${h.toFixed(0)} px)`); });
            ticks.forEach(([text, r]) => { const [w, h] = overlap(bar, r);
                if (w > 1 && h > 1) out.push(`${where}: colour bar ${i} over the axis label ${JSON.stringify(text.slice(0, 30))}`); });
            bars.slice(i + 1).forEach((other, k) => { const [w, h] = overlap(bar, other);
                if (w > 1 && h > 1) out.push(`${where}: colour bars ${i} and ${i + k + 1} overlap`); });
        });
    });
    return out; }"""


def hidden_parts(page) -> list[str]:
    """Every part of a drawn figure on ``page`` that its layout hides, at the page's window size
    (module docstring); [] when none."""
    return page.evaluate(HIDDEN_PARTS)
