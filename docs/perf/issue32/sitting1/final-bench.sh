#!/bin/bash
# usage: final-bench.sh BIN_DIR OUT_DIR
B=$1; O=$2; mkdir -p $O
cd /work/main
run() { name=$1; shift; echo "$name start $(date +%T) $(cat /proc/loadavg)" >> $O/log
  $B/sluice-bench scenario core "$@" --sluice-bin $B/sluice --progress 0s --out $O/$name.json --markdown $O/$name.md > $O/$name.txt 2>&1
  echo "$name done $(date +%T) rc=$?" >> $O/log; }
run core-1024-off --n 1024 --rate 10 --duration 40s --sut all --aggregate off
run core-512-off --n 512 --rate 10 --duration 40s --sut all --aggregate off
run core-1024-on --n 1024 --rate 10 --duration 40s --sut sluice --aggregate on
run core-16k --n 16384 --rate 1 --duration 40s --ramp 10s --settle 5s --sut both --aggregate off
