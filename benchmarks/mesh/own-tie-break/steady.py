#!/usr/bin/env python3
"""The busiest engine's count above the fewest possible (max - ceil(total / engines)) over the
steady part of each `least_request` run: the samples with at least 90% of the run's highest
total in flight, as `kvmesh bench` now reports it (`inflight_excess_steady`). Reads the
per-run sample dumps of the scratch build (`samples-NN-<contender>.json.gz`, one list of
per-engine counts every 20 ms), pairs each repeat's 3 meshed routers with its one router and
prints the means, their standard errors and the paired difference.

    steady.py DIR...
"""
import glob
import gzip
import json
import math
import statistics as st
import sys


def steady(path):
    with gzip.open(path, "rt") as f:
        s = [v for v in json.load(f) if v]
    peak = max(sum(v) for v in s)
    xs = [max(v) - math.ceil(sum(v) / len(v)) for v in s if sum(v) >= 0.9 * peak]
    return sum(xs) / len(xs)


def main():
    one, many = [], []
    for d in sys.argv[1:]:
        fs = sorted(glob.glob(f"{d}/samples-*least_request*.json.gz"))
        a = [f for f in fs if "_x3_" not in f]
        b = [f for f in fs if "_x3_" in f]
        for x, y in zip(a, b):
            one.append(steady(x))
            many.append(steady(y))
    if len(one) < 2:
        raise SystemExit("need at least two pairs")
    se = lambda v: st.stdev(v) / len(v) ** 0.5
    diff = [y - x for x, y in zip(one, many)]
    print(f"steady excess: 1 router {st.mean(one):.4f} ± {se(one):.4f}, "
          f"3 meshed {st.mean(many):.4f} ± {se(many):.4f}, "
          f"difference {st.mean(diff):+.4f} ± {se(diff):.4f} ({len(diff)} pairs, "
          f"{sum(1 for x in diff if x > 0)} above)")


if __name__ == "__main__":
    main()
