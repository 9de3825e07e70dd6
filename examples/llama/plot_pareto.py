#!/usr/bin/env python3
"""Pareto plot of KV-cache compression schemes from the kvc-eval JSON.

    plot_pareto.py eval.json out.png [--linthresh T] [--no-layers]

x: stored bits per KV element (log2 axis); y: PPL(scheme) - PPL(exact cache).
The y axis is symlog: linear within +-T (default: picked from the data, shown
as a grey band and in the axis label), logarithmic outside, so ΔPPL values that
are tiny or slightly negative (fp noise; a scheme may even beat the baseline on
a short text) are drawn where they are, not clipped. The Pareto front (no other
scheme has both fewer bits and lower ΔPPL) is marked and listed on stdout. A
second panel plots each scheme's layer_rel_err when the JSON has it.

JSON (written by kvc-eval):
  {"model": str, "text": str, "tokens": int, "baseline": {"name": str, "ppl": float},
   "schemes": [{"name": str, "bits_per_element": float, "ppl": float,
                "delta_ppl": float, "kl": float, "top1": float,
                "layer_rel_err": [float, ...]}, ...]}
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter  # noqa: E402


def fail(msg: str) -> None:
    print(f"plot_pareto: error: {msg}", file=sys.stderr)
    sys.exit(2)


def load(path: str) -> dict:
    try:
        with open(path) as fh:
            d = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        fail(f"cannot read {path}: {e}")
    for key in ("baseline", "schemes"):
        if key not in d:
            fail(f"{path}: missing key '{key}'")
    if not isinstance(d["schemes"], list) or not d["schemes"]:
        fail(f"{path}: 'schemes' must be a non-empty list")
    base_ppl = d["baseline"].get("ppl")
    for i, s in enumerate(d["schemes"]):
        for key in ("name", "bits_per_element"):
            if key not in s:
                fail(f"{path}: scheme #{i} has no '{key}'")
        if "delta_ppl" not in s:
            if "ppl" in s and base_ppl is not None:
                s["delta_ppl"] = s["ppl"] - base_ppl
            else:
                fail(f"{path}: scheme '{s['name']}' has neither 'delta_ppl' nor 'ppl'")
    return d


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated (minimise both coordinates)."""
    front = []
    for i, (xi, yi) in enumerate(points):
        dominated = any(
            (xj <= xi and yj <= yi) and (xj < xi or yj < yi)
            for j, (xj, yj) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def pick_linthresh(deltas: list[float]) -> float:
    """Power of ten at or below the smallest non-zero |ΔPPL|, within [1e-6, 1e-2]."""
    nz = [abs(v) for v in deltas if v != 0 and math.isfinite(v)]
    if not nz:
        return 1e-4
    t = 10.0 ** math.floor(math.log10(min(nz)))
    return min(max(t, 1e-6), 1e-2)


def place_labels(fig, ax, labels) -> None:
    """Annotate points, trying a few offsets so that labels do not overlap."""
    offsets = [(6, 6, "left", "bottom"), (6, -6, "left", "top"), (-6, 6, "right", "bottom"),
               (-6, -6, "right", "top"), (6, 24, "left", "bottom"), (6, -24, "left", "top"),
               (-6, 24, "right", "bottom"), (-6, -24, "right", "top")]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    taken = []
    for x, y, text, on in sorted(labels, key=lambda t: (t[0], t[1])):
        fallback = chosen = None
        for dx, dy, ha, va in offsets:
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points",
                              ha=ha, va=va, fontsize=8, color="tab:red" if on else "0.25")
            bb = ann.get_window_extent(renderer).expanded(1.03, 1.08)
            clash = any(bb.overlaps(t) for t in taken)
            inside = ax.bbox.contains(bb.x0, bb.y0) and ax.bbox.contains(bb.x1, bb.y1)
            if not clash and inside:
                chosen = (ann, bb)
                break
            if fallback is None:
                fallback = (ann, bb)   # first offset, used if nothing fits
            else:
                ann.remove()
        if chosen is not None and fallback is not None:
            fallback[0].remove()
        ann, bb = chosen or fallback
        taken.append(bb)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("eval_json")
    ap.add_argument("out_png")
    ap.add_argument("--linthresh", type=float, default=None,
                    help="symlog linear threshold for ΔPPL (default: from the data)")
    ap.add_argument("--no-layers", action="store_true", help="omit the per-layer error panel")
    args = ap.parse_args(argv)

    d = load(args.eval_json)
    base = d["baseline"]
    base_name = base.get("name", "baseline")
    base_ppl = base.get("ppl")

    schemes = []
    for s in d["schemes"]:
        x, y = float(s["bits_per_element"]), float(s["delta_ppl"])
        if not (math.isfinite(x) and math.isfinite(y)) or x <= 0:
            print(f"plot_pareto: warning: skipping '{s['name']}' (bits {x}, ΔPPL {y})", file=sys.stderr)
            continue
        schemes.append(s)
    if not schemes:
        fail("no scheme with finite bits and ΔPPL")

    names = [s["name"] for s in schemes]
    pts = [(float(s["bits_per_element"]), float(s["delta_ppl"])) for s in schemes]
    # The exact cache itself is a point on the trade-off (32 bits, ΔPPL 0) unless
    # the JSON already lists it among the schemes.
    has_base = any(n == base_name for n in names)
    all_pts = pts + ([] if has_base else [(32.0, 0.0)])
    all_names = names + ([] if has_base else [f"{base_name} (exact)"])
    front = pareto_front(all_pts)

    linthresh = args.linthresh or pick_linthresh([p[1] for p in pts])

    show_layers = (not args.no_layers) and any(s.get("layer_rel_err") for s in schemes)
    if show_layers:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(10, 6.5))

    # --- Pareto panel ------------------------------------------------------
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=linthresh, linscale=1.0)
    ax.axhspan(-linthresh, linthresh, color="0.92", zorder=0)
    ax.axhline(0.0, color="0.5", lw=0.8, zorder=1)

    front_set = set(front)
    labels = []
    for i, ((x, y), name) in enumerate(zip(all_pts, all_names)):
        on = i in front_set
        is_base = i >= len(pts)
        ax.scatter([x], [y], s=70 if on else 40, zorder=3,
                   marker="*" if is_base else ("o" if on else "x"),
                   color="tab:red" if on else "tab:gray")
        s = schemes[i] if not is_base else None
        label = name
        if s is not None:
            label += f"\nΔ{y:+.2g}"
            if s.get("top1") is not None:
                label += f" top1 {float(s['top1']):.3f}"
        labels.append((x, y, label, on))
    fx = [all_pts[i][0] for i in front]
    fy = [all_pts[i][1] for i in front]
    ax.step(fx, fy, where="post", color="tab:red", lw=1.2, alpha=0.7, zorder=2, label="Pareto front")

    xs = [p[0] for p in all_pts]
    lo, hi = min(xs), max(xs)
    ticks = [t for t in (1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64) if lo / 1.5 <= t <= hi * 1.5]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo / 1.35, hi * 1.6)
    ax.set_xlabel("stored bits per KV element")
    ax.set_ylabel(f"ΔPPL vs exact cache (symlog, linear for |Δ| < {linthresh:g})")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)

    title = f"{d.get('model', '?')}: KV-cache compression, {d.get('text', '?')}"
    if d.get("tokens") is not None:
        title += f", {d['tokens']} tokens"
    if d.get("attention", "fast") != "fast":
        title += f", {d['attention']} attention"
    if base_ppl is not None:
        title += f"\nbaseline {base_name} PPL {float(base_ppl):.4f}"
    fig.suptitle(title, fontsize=11)

    # --- per-layer panel ---------------------------------------------------
    if show_layers:
        for s in schemes:
            err = s.get("layer_rel_err")
            if not err:
                continue
            vals = [max(float(v), 1e-12) for v in err]
            ax2.plot(range(len(vals)), vals, marker=".", ms=3, lw=1, label=s["name"])
        ax2.set_yscale("log")
        ax2.set_xlabel("layer")
        ax2.set_ylabel("layer_rel_err (relative error per layer)")
        ax2.grid(True, which="both", alpha=0.3)
        ax2.legend(fontsize=7, ncol=2)

    fig.tight_layout()
    place_labels(fig, ax, labels)
    fig.savefig(args.out_png, dpi=120)
    plt.close(fig)

    print(f"plot_pareto: wrote {args.out_png} ({len(pts)} schemes, symlog linthresh {linthresh:g})")
    print("Pareto front (bits/elem, ΔPPL, name):")
    for i in front:
        print(f"  {all_pts[i][0]:6.2f}  {all_pts[i][1]:+.4g}  {all_names[i]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
