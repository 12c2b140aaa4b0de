import json,sys,os
# usage: md.py label=file.json ...
rows={}
for arg in sys.argv[1:]:
    label,f=arg.rsplit('=',1)
    d=json.load(open(f))
    for p in d['points']:
        m=p.get('measurement')
        if not m: continue
        pub=m.get('cloud_publishes_per_s') or 0; rec=m.get('cloud_records_per_s') or 0
        lim=m['limited_by']
        lim='saturated' if lim!='-' else '-'
        rows.setdefault(p['n'],[]).append(f"| {p['n']:,} | {label} | {m['e2e_latency']['p50_ms']:.2f} | {m['e2e_latency']['p99_ms']:.2f} | {rec/pub if pub else 0:.2f} | {m['sut_cpu_percent']:.1f} | {m['sut_cpu_us_per_msg']:.1f} | {m['cloud_broker_cpu_percent']:.1f} | {m['delivery_ratio']*100:.1f} % | {lim} | {m['loadavg_at_window_end'].split()[0]} |")
print("| N | run | e2e p50 ms | e2e p99 ms | records / cloud PUBLISH | SUT CPU % | SUT µs/msg | cloud CPU % | delivered | limited | load |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
for n in sorted(rows):
    for r in rows[n]: print(r)
