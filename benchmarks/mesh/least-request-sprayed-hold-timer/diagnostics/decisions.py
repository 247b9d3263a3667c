import sys
def pct(v,q):
    v=sorted(v); return v[min(len(v)-1,int(len(v)*q))] if v else None
for fn in sys.argv[1:]:
    rows=[]
    for l in open(fn):
        f=l.split()
        t,n,me,ch,miss=int(f[0]),int(f[1]),int(f[2]),int(f[3]),int(f[4])
        eng=[tuple(int(x) for x in e.split(',')) for e in f[5:]]
        rows.append((t,me,ch,miss,eng))
    rows.sort()
    misses=[r for r in rows if r[3]]
    # stale engines
    hi_age=[];lo_age=[];anymis=0
    hi_age_all=[];lo_age_all=[]
    for t,me,ch,miss,eng in rows:
        st=[(j,e) for j,e in enumerate(eng) if e[0]!=e[2]]
        if st: anymis+=1
        for j,e in st:
            (hi_age_all if e[0]>e[2] else lo_age_all).append(e[3])
        if miss:
            for j,e in st:
                (hi_age if e[0]>e[2] else lo_age).append(e[3])
    near=[]
    for i,r in enumerate(rows):
        # nearest other-router decision before
        j=i-1; d=None
        while j>=0:
            if rows[j][1]!=r[1]: d=(r[0]-rows[j][0])/1000; break
            j-=1
        near.append(d if d is not None else 1e9)
    print(f"{fn}: decisions {len(rows)} misses {len(misses)}; decisions with any count off {anymis} ({anymis/len(rows):.0%})")
    print(f"  off counts at all decisions: too high n={len(hi_age_all)} age(us) p50 {pct(hi_age_all,.5)} p90 {pct(hi_age_all,.9)} p99 {pct(hi_age_all,.99)}; too low n={len(lo_age_all)} p50 {pct(lo_age_all,.5)} p90 {pct(lo_age_all,.9)} p99 {pct(lo_age_all,.99)}")
    print(f"  at misses: too high n={len(hi_age)} age p50 {pct(hi_age,.5)} p90 {pct(hi_age,.9)}; too low n={len(lo_age)} age p50 {pct(lo_age,.5)} p90 {pct(lo_age,.9)}")
    print(f"  previous decision at another router: p10 {pct(near,.1):.0f} p25 {pct(near,.25):.0f} p50 {pct(near,.5):.0f} us; share within 100us {sum(1 for x in near if x<100)/len(near):.0%}, 1ms {sum(1 for x in near if x<1000)/len(near):.0%}")
