#!/usr/bin/env python3
"""Reads the scratch build's per-sample dump (`KVMESH_DUMP_VIEWS=FILE`, gzipped here): every
20 ms, the true in-flight count per engine (every router's own counts added) and, per router
and engine, the view its policies read: `load,in_flight,own,weight`.

    views.py seed-83.log.gz            per run: steady samples, their excess, and at the
                                       samples with an excess whether any router's view
                                       differed from the truth or had a weight below 1
    views.py seed-83.log.gz RUN        the samples of run RUN (0-based, in the order the
                                       bench ran them) with an excess: true counts and
                                       each router's own counts
"""
import gzip
import math
import sys


def runs(path):
    out, cur = [], []
    with gzip.open(path, "rt") as f:
        for line in f:
            _, rest = line.split(" ", 1)
            end = rest.index("]") + 1
            truth = [int(x) for x in rest[1:end - 1].split(",")]
            views = [[tuple(float(x) for x in c.split(",")) for c in part.split()]
                     for part in rest[end:].split("|")[1:]]
            if sum(truth) == 0 and cur and sum(cur[-1][0]) > 0:
                out.append(cur)
                cur = []
            cur.append((truth, views))
    if cur:
        out.append(cur)
    return [r for r in out if len(r) >= 50]


def excess(t):
    return max(t) - math.ceil(sum(t) / len(t))


def steady(run):
    peak = max(sum(t) for t, _ in run)
    return [(i, t, v) for i, (t, v) in enumerate(run) if sum(t) >= 0.9 * peak]


def summary(path):
    for n, run in enumerate(runs(path)):
        st = steady(run)
        hit = [(t, v) for _, t, v in st if excess(t) > 0]
        inexact = sum(1 for t, v in hit for r in v if any(r[j][0] != t[j] for j in range(len(t))))
        light = sum(1 for t, v in hit for r in v if any(r[j][3] < 0.999 for j in range(len(t))))
        mean = sum(excess(t) for _, t, _ in st) / len(st)
        print(f"run {n}: {len(run)} samples, {len(st)} steady, excess {mean:.3f}, "
              f"{len(hit)} with an excess; router views there not exact: {inexact}, "
              f"with a weight below 1: {light}")


def detail(path, n):
    for i, t, v in steady(runs(path)[n]):
        if excess(t) > 0:
            own = "  ".join(",".join(str(int(r[j][2])) for j in range(len(t))) for r in v)
            print(f"{i * 20:6d} ms  {t}  own per router: {own}")


if __name__ == "__main__":
    if len(sys.argv) == 3:
        detail(sys.argv[1], int(sys.argv[2]))
    else:
        summary(sys.argv[1])
