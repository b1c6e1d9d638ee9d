"""Horizontal bar charts as SVG text, for the pages rendered from stored bench results (``bench --render``).

Written here rather than drawn with matplotlib because the pages are checked byte for byte against a fresh
render (``tests/test_docs.py``, and ``git status`` after ``bench --render`` on a fresh clone): a plotting
library's output changes with its version and fonts, this text does not. Every bar starts at zero, so bar
lengths compare as the values do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

__all__ = ["Bar", "Panel", "bar_chart", "nice_step"]

WIDTH = 900
"""The chart's width in pixels."""
_LABEL = 170  # pixels for the bar labels on a panel's left
_VALUE = 56  # pixels kept on a panel's right for the value written after the longest bar
_BAR, _GAP = 16, 6  # bar height and the space between bars
_HIGHLIGHT, _OTHER, _AXIS = "#1f6fb2", "#a3adb8", "#59636e"


@dataclass
class Bar:
    """One bar: its ``label``, its ``value`` (>= 0, in the panel's unit; None: not measured, drawn as a dash) and
    whether it is drawn in the highlight colour."""

    label: str
    value: float | None
    highlight: bool = False


@dataclass
class Panel:
    """One panel: a ``title`` (the measure and its unit), the ``bars`` top to bottom, and the Python format of the
    values written after the bars (``".1f"``)."""

    title: str
    bars: list[Bar] = field(default_factory=list)
    fmt: str = ".1f"


def nice_step(top: float, ticks: int = 4) -> float:
    """A round tick step (1, 2, 2.5 or 5 times a power of ten) that covers ``top`` (> 0) in about ``ticks`` steps."""
    raw = top / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def _number(value: float) -> str:
    """A tick label: no trailing zeros, no exponent."""
    return f"{value:.6f}".rstrip("0").rstrip(".")


def _panel(panel: Panel, x: float, y: float, width: float) -> tuple[list[str], float]:
    """The SVG elements of ``panel`` with its top-left corner at (x, y), ``width`` wide; returns them and the
    panel's height."""
    values = [b.value for b in panel.bars if b.value is not None]
    if any(v < 0 for v in values):
        raise ValueError(f"{panel.title}: a bar below zero ({min(values)}): the chart's bars start at zero")
    top = max(values, default=0.0) or 1.0
    step = nice_step(top)
    axis_max = math.ceil(top / step - 1e-9) * step
    left, span = x + _LABEL, width - _LABEL - _VALUE
    out = [f'<text x="{x:.1f}" y="{y + 13:.1f}" font-weight="bold">{escape(panel.title)}</text>']
    bars_top = y + 24
    bottom = bars_top + len(panel.bars) * (_BAR + _GAP)
    ticks = round(axis_max / step)
    for i in range(ticks + 1):
        tx = left + span * i / ticks
        out.append(f'<line x1="{tx:.1f}" y1="{bars_top - 3:.1f}" x2="{tx:.1f}" y2="{bottom:.1f}" stroke="#e3e7eb"/>')
        out.append(
            f'<text x="{tx:.1f}" y="{bottom + 14:.1f}" text-anchor="middle" fill="{_AXIS}">{_number(step * i)}</text>'
        )
    for i, bar in enumerate(panel.bars):
        by = bars_top + i * (_BAR + _GAP)
        out.append(f'<text x="{left - 6:.1f}" y="{by + _BAR - 4:.1f}" text-anchor="end">{escape(bar.label)}</text>')
        if bar.value is None:
            out.append(f'<text x="{left + 4:.1f}" y="{by + _BAR - 4:.1f}" fill="{_AXIS}">-</text>')
            continue
        length = span * bar.value / axis_max
        colour = _HIGHLIGHT if bar.highlight else _OTHER
        out.append(f'<rect x="{left:.1f}" y="{by:.1f}" width="{length:.1f}" height="{_BAR}" fill="{colour}"/>')
        out.append(f'<text x="{left + length + 4:.1f}" y="{by + _BAR - 4:.1f}">{format(bar.value, panel.fmt)}</text>')
    out.append(f'<line x1="{left:.1f}" y1="{bars_top - 3:.1f}" x2="{left:.1f}" y2="{bottom:.1f}" stroke="{_AXIS}"/>')
    return out, bottom + 20 - y


def bar_chart(rows: list[tuple[str, list[Panel]]], title: str) -> str:
    """An SVG document: one row per ``(heading, panels)`` of ``rows``, its panels side by side, each a horizontal
    bar chart whose axis starts at zero; ``title`` is the document's ``<title>`` (what a screen reader says).

    Raises:
        ValueError: a negative value (bars start at zero), or no rows.
    """
    if not rows:
        raise ValueError("a chart needs at least one row of panels")
    columns = max(len(panels) for _, panels in rows)
    width = (WIDTH - 20) / columns
    body, y = [], 10.0
    for heading, panels in rows:
        body.append(f'<text x="10" y="{y + 14:.1f}" font-size="14" font-weight="bold">{escape(heading)}</text>')
        y += 26
        height = 0.0
        for i, panel in enumerate(panels):
            elements, h = _panel(panel, 10 + i * width, y, width - 10)
            body += elements
            height = max(height, h)
        y += height + 8
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y:.0f}" '
            f'viewBox="0 0 {WIDTH} {y:.0f}" font-family="sans-serif" font-size="12">',
            f"<title>{escape(title)}</title>",
            f'<rect width="{WIDTH}" height="{y:.0f}" fill="white"/>',
            *body,
            "</svg>",
            "",
        ]
    )
