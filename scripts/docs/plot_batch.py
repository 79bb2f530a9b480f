"""Plot `bench batch --json` output as an SVG: measured speedup against batch, the roofline prediction, the
crossover marked. Plain SVG, no plotting library needed.

    python main.py bench batch --synthetic llama-8b --batches 1,2,4,8,16,32,64,128,256 --json > batch.json
    python scripts/docs/plot_batch.py batch.json docs/batch_regime.svg
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

WIDTH, HEIGHT = 720, 440
LEFT, RIGHT, TOP, BOTTOM = 70, 30, 50, 70


def _scale(report: dict):
    batches = [r["batch"] for r in report["rows"]]
    values = [r["speedup"] for r in report["rows"]] + [r["predicted_speedup"] for r in report["rows"]] + [1.0]
    x0, x1 = math.log2(min(batches)), max(math.log2(max(batches)), math.log2(min(batches)) + 1)
    y1 = max(values) * 1.1
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(b: float) -> float:
        return LEFT + plot_w * (math.log2(b) - x0) / (x1 - x0)

    def y(s: float) -> float:
        return TOP + plot_h * (1 - s / y1)

    return x, y, y1, batches


def _polyline(points, colour: str, dashed: bool = False) -> str:
    dash = ' stroke-dasharray="6 4"' if dashed else ""
    coords = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
    return f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>'


def _axes(x, y, y1: float, batches: list) -> list:
    out = [f'<line x1="{LEFT}" y1="{y(0)}" x2="{WIDTH - RIGHT}" y2="{y(0)}" stroke="black"/>',
           f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{y(0)}" stroke="black"/>']
    for b in batches:
        out.append(f'<text x="{x(b):.1f}" y="{y(0) + 18:.1f}" text-anchor="middle" font-size="12">{b}</text>')
    step = 0.5 if y1 <= 4 else 1.0
    tick = 0.0
    while tick <= y1:
        out.append(f'<text x="{LEFT - 8}" y="{y(tick) + 4:.1f}" text-anchor="end" '
                   f'font-size="12">{tick:g}</text>')
        tick += step
    out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 25}" text-anchor="middle" '
               f'font-size="13">batch size B (sequences)</text>')
    out.append(f'<text x="18" y="{(TOP + y(0)) / 2}" text-anchor="middle" font-size="13" '
               f'transform="rotate(-90 18 {(TOP + y(0)) / 2})">speedup over plain batched decoding</text>')
    return out


def render(report: dict) -> str:
    x, y, y1, batches = _scale(report)
    rows = report["rows"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>']
    parts += _axes(x, y, y1, batches)
    parts.append(f'<line x1="{LEFT}" y1="{y(1):.1f}" x2="{WIDTH - RIGHT}" y2="{y(1):.1f}" stroke="#888" '
                 f'stroke-dasharray="2 3"/>')
    predicted = [(x(r["batch"]), y(r["predicted_speedup"])) for r in rows]
    parts.append(_polyline(predicted, "#d62728", dashed=True))
    parts.append(_polyline([(x(r["batch"]), y(r["speedup"])) for r in rows], "#1f77b4"))
    for r in rows:
        parts.append(f'<circle cx="{x(r["batch"]):.1f}" cy="{y(r["speedup"]):.1f}" r="4" fill="#1f77b4"/>')
    for key, colour, label in (("measured_crossover", "#1f77b4", "measured"),
                               ("predicted_crossover", "#d62728", "predicted")):
        b = report.get(key)
        if b is not None and min(batches) <= b <= max(batches):
            parts.append(f'<line x1="{x(b):.1f}" y1="{TOP}" x2="{x(b):.1f}" y2="{y(0)}" stroke="{colour}" '
                         f'stroke-width="1" stroke-dasharray="4 4"/>')
            label_y = TOP + 14 if label == "measured" else TOP + 30
            right_half = x(b) > (LEFT + WIDTH - RIGHT) / 2  # such a label ends at its line, inside the plot
            anchor, label_x = ("end", x(b) - 4) if right_half else ("start", x(b) + 4)
            parts.append(f'<text x="{label_x:.1f}" y="{label_y}" text-anchor="{anchor}" '
                         f'font-size="12" fill="{colour}">{label} crossover B≈{b:.0f}</text>')
    knee = report["fit"].get("knee_tokens")
    title = (f'{report["method"]}, K={report["k"]} on {report["device"]}: measured (solid), roofline '
             f'prediction (dashed)')
    if knee:
        title += f'; knee {knee:.0f} tokens/forward'
    room = WIDTH - LEFT - RIGHT  # a title longer than the plot is squeezed to its width
    fit = f' textLength="{room}" lengthAdjust="spacingAndGlyphs"' if 0.6 * 12 * len(title) > room else ""
    parts.append(f'<text x="{LEFT}" y="24" font-size="12"{fit}>{title}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def in_and_out(argv: list, doc: str, source: tuple, out: tuple) -> tuple:
    """The two paths of a report tool's command line, IN then OUT: source and out are each (metavar, help);
    doc is the tool's --help text (also used by scripts/docs/refit_batch.py)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for dest, (metavar, text) in (("source", source), ("out", out)):
        parser.add_argument(dest, type=Path, metavar=metavar, help=text)
    args = parser.parse_args(argv)
    return args.source, args.out


def main(argv: list) -> int:
    source, out = in_and_out(argv, __doc__, ("BENCH.json", "`bench batch --json` output"),
                             ("OUT.svg", "where the SVG plot goes"))
    report = json.loads(source.read_text(encoding="utf-8"))
    out.write_text(render(report), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
