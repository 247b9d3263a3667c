import sys
fn=sys.argv[1]; k=int(sys.argv[2]) if len(sys.argv)>2 else 8
rows=[]
for l in open(fn):
    f=l.split()
    rows.append((int(f[0]),int(f[2]),int(f[3]),int(f[4]),[tuple(int(x) for x in e.split(',')) for e in f[5:]]))
rows.sort()
shown=0
for i,r in enumerate(rows):
    if not r[3] or i<200: continue
    for j in range(max(0,i-4),min(len(rows),i+3)):
        t,me,ch,miss,eng=rows[j]
        print(f"{'*' if j==i else ' '} t={(t-rows[i][0])/1000:8.0f}us r{me} -> e{ch} {'MISS' if miss else '    '} view {[e[0] for e in eng]} truth {[e[2] for e in eng]} own {[e[1] for e in eng]} ")
    print()
    shown+=1
    if shown>=k: break
