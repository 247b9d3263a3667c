#!/usr/bin/env python3
"""Pairs the in-flight spread of `kvmesh bench` reports: for each report directory given, each
repeat's N meshed routers against the same repeat's one router (`--routers 1 --routers N`),
under one policy (default least_request). Prints each pair, then the mean difference with its
standard error and how many pairs are above, and the same for the mean in flight per engine
and the busiest engine's count above the fewest possible (over the samples under load, and
over the steady part alone when the report has it).

    scripts/spread-pairs.py [--policy P] [--routers N] DIR...
"""
import argparse
import json
import statistics as st


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="least_request")
    ap.add_argument("--routers", type=int, default=3)
    ap.add_argument("dirs", nargs="+")
    a = ap.parse_args()
    rows = []
    for d in a.dirs:
        with open(f"{d}/report.json") as f:
            runs = [r for r in json.load(f)["runs"] if r["policy"] == a.policy]
        one = {r["repeat"]: r for r in runs if r["routers"] == 1}
        many = {r["repeat"]: r for r in runs if r["routers"] == a.routers and r["mesh"]}
        rows += [(d, k, one[k], many[k]) for k in sorted(one) if k in many]
    if not rows:
        raise SystemExit("no pairs: each report needs --routers 1 and meshed --routers N runs")
    fields = [("inflight_spread", "max/mean"), ("inflight_mean", "mean in flight"),
              ("inflight_excess", "above the fewest"),
              ("inflight_excess_steady", "above the fewest, steady")]
    # A figure the report does not have (an older build's) shows as "-", not as 0.
    fmt = lambda x: "-" if x is None else f"{x:.4f}"
    for d, k, o, m in rows:
        cells = "  ".join(f"{label} {fmt(o.get(key))} {fmt(m.get(key))}"
                          for key, label in fields)
        print(f"{d} repeat {k}: {cells}")
    for key, label in fields:
        pairs = [(o.get(key), m.get(key)) for _, _, o, m in rows]
        pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
        if not pairs:
            continue
        diff = [y - x for x, y in pairs]
        se = st.stdev(diff) / len(diff) ** 0.5 if len(diff) > 1 else 0.0
        print(f"{label}: 1 router {st.mean(x for x, _ in pairs):.4f}, {a.routers} meshed "
              f"{st.mean(y for _, y in pairs):.4f}, difference {st.mean(diff):+.4f} ± {se:.4f} "
              f"({sum(1 for x in diff if x > 0)} of {len(diff)} above)")


if __name__ == "__main__":
    main()
