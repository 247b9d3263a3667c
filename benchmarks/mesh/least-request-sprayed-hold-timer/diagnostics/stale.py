import sys
def pct(v,q):
    v=sorted(v); return v[min(len(v)-1,int(len(v)*q))] if v else None
for fn in sys.argv[1:]:
    for li,l in enumerate(open(fn)):
        f=l.split()
        polls,el=int(f[3]),int(f[5])
        hi=[int(x[1:]) for x in f[6:] if x[0]=='+']; lo=[int(x[1:]) for x in f[6:] if x[0]=='-']
        print(f"{fn} run{li} poll every {el/polls:.0f}us; untold frees n={len(hi)} p50 {pct(hi,.5)} p90 {pct(hi,.9)} p99 {pct(hi,.99)} max {max(hi) if hi else 0}; untold placements n={len(lo)} p50 {pct(lo,.5)} p90 {pct(lo,.9)} p99 {pct(lo,.99)} max {max(lo) if lo else 0}")
        for th in (500,1000,2000,5000):
            print(f"    over {th}us: frees {sum(1 for x in hi if x>th)}, placements {sum(1 for x in lo if x>th)}")
