import sys, random, bisect, statistics as st
for fn in sys.argv[1:]:
    rows=[l.split() for l in open(fn)]
    ev=[(int(r[0])/1e3, r[1], int(r[2]), int(r[3])) for r in rows]  # us, thread, n, late
    ev.sort()
    segs=[[ev[0]]]
    for e in ev[1:]:
        if e[0]-segs[-1][-1][0] > 1e6: segs.append([])
        segs[-1].append(e)
    for si,s in enumerate(segs):
        t0,t1=s[0][0],s[-1][0]
        lat=sorted(e[3] for e in s)
        eng={}
        for e in s: eng.setdefault(e[1],[]).append(e[0])
        def coinc(engmap, w):
            allv=sorted((t,k) for k,v in engmap.items() for t in v)
            ts=[t for t,_ in allv]; c=0
            for t,k in allv:
                lo=bisect.bisect_left(ts,t-w); hi=bisect.bisect_right(ts,t+w)
                c+=sum(1 for j in range(lo,hi) if allv[j][1]!=k)
            return c/len(allv)
        random.seed(1)
        for w in (100,300,1000):
            real=coinc(eng,w)
            sh=[]
            for _ in range(5):
                m={k:sorted(((t-t0+random.uniform(0,t1-t0))%(t1-t0))+t0 for t in v) for k,v in eng.items()}
                sh.append(coinc(m,w))
            print(f"{fn} seg{si} n={len(s)} dur={(t1-t0)/1e6:.1f}s ends/step={sum(e[2] for e in s)/len(s):.2f} w=±{w}us other-engine ends per end: real {real:.3f} shuffled {st.mean(sh):.3f}")
        print(f"   wake lateness us p50 {lat[len(lat)//2]} p90 {lat[int(len(lat)*.9)]} p99 {lat[int(len(lat)*.99)]}")
