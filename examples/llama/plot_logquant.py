#!/usr/bin/env python3
"""LogQuant figure from kvc-eval's coverage JSON (`kvc-eval --coverage coverage.json`).

    plot_logquant.py coverage.json out.png

Top: which positions kvc::LogWindow<42> keeps in full precision after 2000 tokens (our selector's own
answer, the paper's illustration): position 0, a gap, then sparse tokens whose stride halves towards
the present, then the dense recent region. Bottom: per layer, the share of SmolLM2's exact attention
mass that falls on the tokens each scheme keeps in fp16 (LogQuant2 vs KIVI at the same budget, with
and without the rows not yet quantized).

JSON (written by kvc-eval, examples/llama/coverage.hpp):
  {"tokens": int, "from": int, "sets": [{"name", "description", "mean_size"}, ...],
   "mass": [[float per set] per layer], "logquant_kept_after": int, "logquant_kept": [int, ...]}
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1], encoding="utf-8") as f:
        data = json.load(f)
    kept = data["logquant_kept"]
    n = data["logquant_kept_after"]
    sets = data["sets"]
    mass = data["mass"]

    fig = plt.figure(figsize=(11, 7.5))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 2.4], width_ratios=[1, 1])
    top, zoom, bottom = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    for ax, lo, title in ((top, 0, f"all {n} positions"), (zoom, n - 300, "the last 300 positions")):
        shown = [p for p in kept if p >= lo]
        ax.eventplot([shown], lineoffsets=0.5, linelengths=0.8, colors="tab:blue", linewidths=0.8)
        ax.set_xlim(lo - 5, n + 5)
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_xlabel("token position")
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"kvc::LogWindow<42> (LogQuant2's selector): the {len(kept)} positions kept in fp16 after {n} tokens "
                 "(blue), and the attention mass they catch", fontsize=10)

    layers = list(range(len(mass)))
    styles = {"logquant2": ("tab:blue", "-"), "log-set-126": ("tab:blue", ":"),
              "kivi2-g64-w126": ("tab:red", "-"), "recent-126": ("tab:red", ":")}
    for i, s in enumerate(sets):
        color, ls = styles.get(s["name"], (None, "-"))
        bottom.plot(layers, [row[i] for row in mass], ls, color=color, marker="o", markersize=3,
                    label=f'{s["name"]} ({s["mean_size"]:.0f} fp16 tokens on average)')
    bottom.set_xlabel("layer")
    bottom.set_ylabel("attention mass on fp16 tokens")
    bottom.set_ylim(0, 1)
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8, loc="lower right")
    bottom.set_title(f'SmolLM2-135M exact attention, {data["tokens"]} tokens, positions >= {data["from"]}, '
                     "mean over query heads")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(sys.argv[2], dpi=120)
    print(f"plot_logquant: wrote {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
