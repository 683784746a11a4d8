"""The status page's chart of committed steps over time, as inline SVG.

Server-rendered: the page loads nothing from the network and runs no
JavaScript library, so it works on an air-gapped cluster and in a plain
headless browser. Pure: the data and the time are passed in.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#7f7f7f",
    "#bcbd22",
)
MAX_LINES = 16
"""Groups drawn; a job with more lists the rest below the chart."""


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def render_chart(
    series: Mapping[str, Sequence[tuple[float, int]]],
    now: float,
    width: int = 720,
    height: int = 240,
) -> str:
    """An `<svg>` with one polyline of (wall-clock seconds, step) points per
    group, x = time up to `now`, y = step; a legend names each line.

    With no points it is still an `<svg>`, saying so, so the page's layout
    and a test's selector do not depend on the job's progress.
    """
    pad_l, pad_r, pad_t, pad_b = 56, 150, 12, 30
    plot_w, plot_h = width - pad_l - pad_r, height - pad_t - pad_b
    named = sorted(series.items())[:MAX_LINES]
    points = [p for _, pts in named for p in pts]
    parts = [
        f'<svg id="steps-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        'aria-label="committed steps over time per replica group">',
        f'<rect x="{pad_l}" y="{pad_t}" width="{plot_w}" height="{plot_h}" '
        'fill="#fafafa" stroke="#999"/>',
    ]
    if not points:
        parts.append(
            f'<text x="{pad_l + plot_w / 2:.0f}" y="{pad_t + plot_h / 2:.0f}" '
            'text-anchor="middle" fill="#666">no steps yet</text></svg>'
        )
        return "".join(parts)
    t0 = min(t for t, _ in points)
    t1 = max(now, max(t for t, _ in points))
    s1 = max(max(s for _, s in points), 1)
    span_t = max(t1 - t0, 1e-9)

    def xy(t: float, s: int) -> str:
        x = pad_l + (t - t0) / span_t * plot_w
        y = pad_t + plot_h - s / s1 * plot_h
        return f"{x:.1f},{y:.1f}"

    # Axes: the step at the top and bottom, the time span along the bottom.
    parts += [
        f'<text x="{pad_l - 4}" y="{pad_t + 10}" text-anchor="end" font-size="11">{s1}</text>',
        f'<text x="{pad_l - 4}" y="{pad_t + plot_h}" text-anchor="end" font-size="11">0</text>',
        f'<text x="{pad_l}" y="{height - 10}" font-size="11">-{_fmt_s(t1 - t0)}</text>',
        f'<text x="{pad_l + plot_w}" y="{height - 10}" text-anchor="end" font-size="11">now</text>',
        f'<text x="{pad_l + plot_w / 2:.0f}" y="{height - 10}" text-anchor="middle" '
        'font-size="11">time</text>',
        f'<text x="12" y="{pad_t + plot_h / 2:.0f}" font-size="11" '
        f'transform="rotate(-90 12 {pad_t + plot_h / 2:.0f})" text-anchor="middle">step</text>',
    ]
    for i, (name, pts) in enumerate(named):
        color = PALETTE[i % len(PALETTE)]
        label = html.escape(name)
        if pts:
            coords = " ".join(xy(t, s) for t, s in pts)
            # Hold the last known step up to now: a group that stopped shows a flat tail.
            coords += " " + xy(t1, pts[-1][1])
            parts.append(
                f'<polyline class="series" data-group="{label}" fill="none" stroke="{color}" '
                f'stroke-width="2" points="{coords}"/>'
            )
        ly = pad_t + 14 + 16 * i
        lx = pad_l + plot_w + 10
        parts.append(
            f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 16}" y2="{ly - 4}" stroke="{color}" '
            f'stroke-width="3"/><text x="{lx + 20}" y="{ly}" font-size="11">'
            f"{html.escape(name[:18])}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)
