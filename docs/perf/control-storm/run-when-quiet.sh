#!/bin/bash
# Wait (at most $2 seconds) until no compiler runs for 10 s in a row, then run run-$1.
cd /work/wt-storm
deadline=$(( $(date +%s) + $2 ))
quiet=0
while [ $(date +%s) -lt $deadline ]; do
  if pgrep -x rustc >/dev/null || pgrep -x rust-lld >/dev/null || pgrep -f 'cargo (build|test|clippy)' >/dev/null; then quiet=0; else quiet=$((quiet+1)); fi
  [ $quiet -ge 10 ] && break
  sleep 1
done
echo "starting at $(date -u) quiet=$quiet load=$(cat /proc/loadavg)" > docs/perf/control-storm/run-$1.wait.txt
nice -n -5 /work/target-storm/release/sluice-bench scenario control-storm --sluice-bin /work/target-storm/release/sluice --warmup 5s ${EXTRA} --out docs/perf/control-storm/run-$1.json --markdown docs/perf/control-storm/run-$1.md > docs/perf/control-storm/run-$1.stdout.txt 2> docs/perf/control-storm/run-$1.stderr.txt
echo "rc=$? at $(date -u)" >> docs/perf/control-storm/run-$1.wait.txt
