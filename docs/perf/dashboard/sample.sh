#!/bin/bash
# Runs one `scenario core` and samples sluice's threads' CPU time from schedstat (ns, exact)
# over 40 s of its steady state (from 15 s after sluice starts).
d=$1; tag=$2
cd "$(dirname "$0")/../../.."  # the repository root
target/release/sluice-bench scenario core --n 1024 --rate 10 --duration 60s --sut sluice \
  --sluice-bin target/release/sluice --dashboards $d \
  --out ${OUT:-/tmp}/$tag.json --markdown ${OUT:-/tmp}/$tag.md > ${OUT:-/tmp}/$tag.log 2>&1 &
bench=$!
pid=""
for i in $(seq 1 100); do pid=$(pgrep -x sluice -P $bench | head -1); [ -n "$pid" ] && break; sleep 0.2; done
[ -z "$pid" ] && { echo "no sluice"; wait $bench; exit 1; }
read_ns() { # $1 = thread name or ALL
  local sum=0
  for t in /proc/$pid/task/*; do
    c=$(cat $t/comm 2>/dev/null); s=$(cut -d' ' -f1 $t/schedstat 2>/dev/null)
    [ -z "$s" ] && continue
    if [ "$1" = ALL ] || [ "$c" = "$1" ]; then sum=$((sum + s)); fi
  done
  echo $sum
}
per_thread() { for t in /proc/$pid/task/*; do echo "$(basename $t) $(cat $t/comm) $(cut -d' ' -f1 $t/schedstat)"; done; }
sleep 15
a0=$(read_ns ALL); c0=$(read_ns sluice-control); t0=$(date +%s%N); per_thread > ${OUT:-/tmp}/$tag.threads0
sleep 40
a1=$(read_ns ALL); c1=$(read_ns sluice-control); t1=$(date +%s%N); per_thread > ${OUT:-/tmp}/$tag.threads1
wall=$((t1 - t0))
echo "$tag dashboards=$d pid=$pid window_s=$(echo "scale=3; $wall/1000000000" | bc) sluice_all_pct=$(echo "scale=3; ($a1-$a0)*100/$wall" | bc) control_thread_pct=$(echo "scale=4; ($c1-$c0)*100/$wall" | bc) load=$(cut -d' ' -f1-3 /proc/loadavg)"
wait $bench
