#!/bin/bash
# Sitting 3 (session 39): sluice beside the bridge, the floor and the relay floor, alternating.
B=/tmp/s39; OUT=/tmp/s39/out; mkdir -p $OUT
cd /work/main
run() { name=$1; shift; echo "$name start $(date +%T) $(cat /proc/loadavg)" >> $OUT/log
  $B/sluice-bench scenario core --rate 10 --duration 40s --aggregate off --progress 0s --sluice-bin $B/sluice "$@" --out $OUT/$name.json --markdown $OUT/$name.md > $OUT/$name.txt 2>&1
  echo "$name done $(date +%T) rc=$?" >> $OUT/log; }
for r in 1 2; do
  run n1024-$r --n 1024 --sut sluice,mosquitto-bridge,floor,relay-floor
  run n512-$r --n 512 --sut relay-floor,floor,mosquitto-bridge,sluice
  run n1024-2sh-$r --n 1024 --sut sluice --sluice-shards 2
done
echo "all done $(date +%T)" >> $OUT/log
