#!/usr/bin/env python3
"""Per arm: every run (repeat) of each contender -> hit, out tok/s, TTFT p99, inflight spread; means per arm."""
import json, sys, glob, re, collections
rows = collections.defaultdict(list)
for d in sorted(glob.glob(sys.argv[1] if len(sys.argv) > 1 else '*-seed*/')):
    m = re.search(r'/([a-z]+)-([a-z0-9]+)-seed(\d+)/?$', d.rstrip('/') + '/')
    m = re.search(r'([a-z]+)-([a-z0-9]+)-seed(\d+)', d)
    lay, arm, seed = m.group(1), m.group(2), int(m.group(3))
    try:
        r = json.load(open(d + '/report.json'))
    except Exception:
        continue
    for run in r['runs']:
        if run['policy'] == 'round_robin':
            continue
        name = run['policy'] + (' x%d' % run['routers'] if run['routers'] > 1 else ' x1')
        rows[(lay, name, arm)].append((seed, run['hit_rate'], run['output_tokens_per_s'], run['ttft_p99_ms'], run['inflight_spread'], max(n for _, n in run['per_engine'])))
print('| layout | contender | arm | runs | hit | out tok/s | TTFT p99 | in-flight max/mean | busiest engine requests |')
print('|---|---|---|---|---|---|---|---|---|')
for k in sorted(rows):
    v = rows[k]
    n = len(v)
    mean = lambda i: sum(x[i] for x in v) / n
    print(f'| {k[0]} | {k[1]} | {k[2]} | {n} | {100*mean(1):.1f}% | {mean(2):.0f} | {mean(3):.0f} | {mean(4):.2f} | {mean(5):.1f} |')
