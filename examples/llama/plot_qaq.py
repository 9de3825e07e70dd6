#!/usr/bin/env python3
"""QAQ figure from kvc-eval JSON files (`kvc-eval --schemes qaq:...,qaq-u... --json F`).

    plot_qaq.py out.png HIST_SCHEME eval.json [eval.json ...]

Left: quality against honest bits per element (everything counted: codes, lo/step, outliers with their
channels, token ids, attention histories): the QAQ curve (qaq:KS:VS, one point per pair of error
targets) beside per-token uniform quantization with the same codec and outliers (qaq-uB, the paper's
Fig. 4 baseline), the n = 1 (qaq-n1) and alpha = 0 (qaq-a0) ablations, and, where the files have them, the
same curve and baseline with 2-byte metadata (qaq-lm:KS:VS, qaq-uB-lm), and the rotated outlier-free QAQ with
2-byte metadata and n = 1 (qaq-a0n1-rot-lm:KS:VS) beside its own uniform baselines (qaq-uB-a0-rot, qaq-uB-a0-rot-lm);
top ΔPPL, bottom KL.
Right: the code widths QAQ chose for keys and values (all layers, after the run) for HIST_SCHEME.
Every file must share the model, text and token count; schemes are merged by name (later files win).
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(paths: list[str]) -> tuple[dict, dict[str, dict]]:
    head, schemes = None, {}
    for p in paths:
        with open(p, encoding="utf-8") as f:
            d = json.load(f)
        key = (d["model"], d["text"], d["tokens"])
        if head is None:
            head = d
        elif key != (head["model"], head["text"], head["tokens"]):
            raise SystemExit(f"plot_qaq: {p} is a different run ({key})")
        for s in d["schemes"]:
            schemes[s["name"]] = s
    return head, schemes


def family(name: str) -> str | None:
    if name.startswith("qaq-u"):
        for suffix, fam in (("-a0-rot-lm", "uniform-a0-rot-lm"), ("-a0-rot", "uniform-a0-rot"), ("-lm", "uniform-lm")):
            if name.endswith(suffix) and name[5:-len(suffix)].isdigit():
                return fam
    for prefix, fam in (("qaq-n1:", "n1"), ("qaq-a0:", "a0"), ("qaq:", "qaq"), ("qaq-lm:", "lm"),
                        ("qaq-a0n1-rot-lm:", "a0n1-rot-lm")):
        if name.startswith(prefix):
            return fam
    if name.startswith("qaq-u") and name[5:].isdigit():
        return "uniform"
    return None


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    out, hist_name, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    head, schemes = load(paths)
    if hist_name not in schemes or "key_widths" not in schemes[hist_name]:
        raise SystemExit(f"plot_qaq: {hist_name} has no width histogram in the files")
    styles = {
        "qaq": dict(color="tab:blue", marker="o", label="QAQ (sweep of sigma_S:sigma_X)"),
        "uniform": dict(color="tab:gray", marker="s", label="per-token uniform + 1% outliers (qaq-uB)"),
        "n1": dict(color="tab:orange", marker="^", linestyle="none", label="QAQ n = 1"),
        "a0": dict(color="tab:red", marker="v", linestyle="none", label="QAQ alpha = 0"),
        "lm": dict(color="tab:cyan", marker="o", linestyle="--", label="QAQ, 2-byte metadata (qaq-lm)"),
        "uniform-lm": dict(color="tab:brown", marker="s", linestyle="--", label="uniform, 2-byte metadata (qaq-uB-lm)"),
        "a0n1-rot-lm": dict(color="tab:green", marker="D", markersize=4,
                            label="QAQ alpha = 0, n = 1, rotated, 2-byte metadata (qaq-a0n1-rot-lm)"),
        "uniform-a0-rot": dict(color="tab:olive", marker="s", linestyle=":", label="uniform, no outliers, rotated (qaq-uB-a0-rot)"),
        "uniform-a0-rot-lm": dict(color="tab:pink", marker="s", linestyle=":",
                                  label="uniform, no outliers, rotated, 2-byte metadata (qaq-uB-a0-rot-lm)"),
    }
    fig = plt.figure(figsize=(12, 7))
    ax_ppl = fig.add_subplot(2, 2, 1)
    ax_kl = fig.add_subplot(2, 2, 3, sharex=ax_ppl)
    for fam, st in styles.items():
        pts = sorted((s["bits_per_element"], s["delta_ppl"], s["kl"], n) for n, s in schemes.items() if family(n) == fam)
        if not pts:
            continue
        bits = [p[0] for p in pts]
        ax_ppl.plot(bits, [max(p[1], 1e-3) for p in pts], **st)
        ax_kl.plot(bits, [p[2] for p in pts], **st)
    for ax, label in ((ax_ppl, "ΔPPL (floored at 1e-3)"), (ax_kl, "KL to fp32 (nats)")):
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.axvspan(2.5, 6.0, color="tab:green", alpha=0.06)
        ax.grid(True, which="both", alpha=0.3)
    ax_ppl.axhline(0.1, color="tab:green", linestyle=":", linewidth=1)
    ax_ppl.axvline(4.0, color="tab:green", linestyle=":", linewidth=1)
    ax_kl.set_xlabel("bits per K/V element (compressed cache, everything counted)")
    ax_ppl.legend(fontsize=8)
    ax_ppl.set_title(f"{head['model']}, {head['tokens']} tokens")
    s = schemes[hist_name]
    for i, (side, key) in enumerate((("keys", "key_widths"), ("values", "value_widths"))):
        ax = fig.add_subplot(2, 2, 2 + 2 * i)
        w = s[key]
        total = sum(w)
        mean = sum(b * n for b, n in enumerate(w)) / total
        ax.bar(range(len(w)), [n / total for n in w], color="tab:blue" if i == 0 else "tab:purple")
        ax.set_xticks(range(1, len(w)))
        ax.set_ylabel("share of tokens")
        ax.set_title(f"{hist_name}: {side}, mean code width {mean:.2f} bits")
        if i == 1:
            ax.set_xlabel("code width b (bits)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot_qaq: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
