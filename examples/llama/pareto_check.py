#!/usr/bin/env python3
"""Does one family of schemes move another's Pareto front? For every bit budget b in [lo, hi], compares
the best (lowest-KL, or lowest-ΔPPL with --metric delta_ppl) scheme of family A with bits <= b against the
best of family B with bits <= b, reading kvc-eval's --json output. Prints the budget intervals where A is
ahead and where it is not.

  python3 examples/llama/pareto_check.py results/eval.json [--a gear,outlier,lowrank] [--b kivi]
                                         [--lo 3] [--hi 6] [--metric kl|delta_ppl]
Families are name prefixes (comma-separated). Exit status 0 whether or not A is ahead everywhere.
"""
import argparse
import json


def best_at(points, b):
    """(metric, name) of the lowest-metric point with bits <= b, or None."""
    ok = [(m, name) for bits, m, name in points if bits <= b + 1e-9]
    return min(ok) if ok else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--a", default="gear,outlier,lowrank")
    ap.add_argument("--b", default="kivi")
    ap.add_argument("--lo", type=float, default=3.0)
    ap.add_argument("--hi", type=float, default=6.0)
    ap.add_argument("--metric", choices=("kl", "delta_ppl"), default="kl")
    args = ap.parse_args()
    schemes = json.load(open(args.json))["schemes"]

    def family(prefixes):
        pre = tuple(p.strip() for p in prefixes.split(","))
        return [(s["bits_per_element"], s[args.metric], s["name"]) for s in schemes if s["name"].startswith(pre)]

    a, b = family(args.a), family(args.b)
    # The fronts only change at the schemes' bit counts: check each interval between them.
    cuts = sorted({args.lo, args.hi} | {bits for bits, _, _ in a + b if args.lo < bits < args.hi})
    rows = []
    for lo, hi in zip(cuts, cuts[1:] + [None]):
        if hi is None:
            if lo != args.hi:
                continue
            hi = lo
        ba, bb = best_at(a, lo), best_at(b, lo)
        ahead = ba is not None and (bb is None or ba[0] < bb[0])
        if rows and rows[-1][2:] == (ahead, ba, bb):
            rows[-1] = (rows[-1][0], hi, ahead, ba, bb)  # same winners: one interval
        else:
            rows.append((lo, hi, ahead, ba, bb))
    label = "KL" if args.metric == "kl" else "ΔPPL"
    fmt = lambda p: "-" if p is None else f"{p[1]} ({label} {p[0]:.3g})"
    print(f"| budget (bits) | best {args.a} | best {args.b} | ahead |")
    print("|---|---|---|---|")
    for lo, hi, ahead, ba, bb in rows:
        span = f"{lo:.2f}" if lo == hi else f"{lo:.2f}-{hi:.2f}"
        print(f"| {span} | {fmt(ba)} | {fmt(bb)} | {'yes' if ahead else '**no**'} |")


if __name__ == "__main__":
    main()
