"""Pairs each repeat's 3 meshed routers with its one router, per arm and client layout; prints the
in-flight spread difference (mean ± standard error), the decisions that missed the least loaded
engine, output tok/s and hit rate.  python3 table.py"""
import json,glob,os,statistics as st
HERE=os.path.dirname(os.path.abspath(__file__))
def load(arm,mode):
    rows=[]
    for f in sorted(glob.glob(f'{HERE}/{arm}/{mode}/seed-*/report.json')):
        runs=[r for r in json.load(open(f))['runs'] if r['policy']=='least_request']
        one={r['repeat']:r for r in runs if r['routers']==1}
        many={r['repeat']:r for r in runs if r['routers']==3 and r['mesh']}
        rows+=[(one[k],many[k]) for k in one if k in many]
    return rows
for mode in ['sticky','sprayed']:
    for arm in ['split','base','stripe','ownfirst']:
        rows=load(arm,mode)
        d=[m['inflight_spread']-o['inflight_spread'] for o,m in rows]
        dec=sum(m['least_load_decisions'][0] for o,m in rows); mis=sum(m['least_load_decisions'][1] for o,m in rows)
        print(f"{mode} {arm}: n={len(d)} 1r {st.mean(o['inflight_spread'] for o,m in rows):.4f} 3m {st.mean(m['inflight_spread'] for o,m in rows):.4f} diff {st.mean(d):+.4f} ± {st.stdev(d)/len(d)**.5:.4f} above {sum(x>0 for x in d)} mis {mis}/{dec}={mis/dec*100:.2f}% tok1 {st.mean(o['output_tokens_per_s'] for o,m in rows):.0f} tok3 {st.mean(m['output_tokens_per_s'] for o,m in rows):.0f} hit1 {st.mean(o['hit_rate'] for o,m in rows)*100:.1f} hit3 {st.mean(m['hit_rate'] for o,m in rows)*100:.1f} env {sorted(set(tuple(m['mesh_envelope_age_ms']) for o,m in rows))}")
