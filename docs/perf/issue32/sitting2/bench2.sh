#!/bin/bash
# second sitting: old vs new vs new@2 shards vs LTO; then 16k, connections, functions
N=/tmp/fin; O=/tmp/hot-A; L=/tmp/lto; OUT=/tmp/fin/out2; mkdir -p $OUT
cd /work/main
run() { name=$1; bin=$2; shift 2; echo "$name start $(date +%T) $(cat /proc/loadavg)" >> $OUT/log
  $N/sluice-bench scenario core --n 1024 --rate 10 --duration 40s --aggregate off --progress 0s --sluice-bin $bin "$@" --out $OUT/$name.json --markdown $OUT/$name.md > $OUT/$name.txt 2>&1
  echo "$name done $(date +%T) rc=$?" >> $OUT/log; }
for r in 1 2; do
  run new-all-$r $N/sluice --sut all
  run old-$r $O/sluice --sut sluice
  run new2sh-$r $N/sluice --sut sluice --sluice-shards 2
  [ -x $L/sluice ] && run lto-$r $L/sluice --sut sluice
done
echo "16k start $(date +%T) $(cat /proc/loadavg)" >> $OUT/log
$N/sluice-bench scenario core --n 16384 --rate 1 --duration 40s --ramp 10s --settle 5s --sut both --aggregate off --sluice-bin $N/sluice --progress 0s --out $OUT/core-16k.json --markdown $OUT/core-16k.md > $OUT/core-16k.txt 2>&1
echo "16k done $(date +%T)" >> $OUT/log
for b in new old; do bin=$N/sluice; [ $b = old ] && bin=$O/sluice
  echo "conn-$b start $(date +%T) $(cat /proc/loadavg)" >> $OUT/log
  $N/sluice-bench scenario connections --sluice-bin $bin --n 4000 --out $OUT/conn-$b.json --markdown $OUT/conn-$b.md > $OUT/conn-$b.txt 2>&1
  echo "conn-$b done $(date +%T)" >> $OUT/log
done
for b in new old; do bin=/tmp/fin2/sluice; [ $b = old ] && bin=$O/sluice
  echo "fn-$b start $(date +%T) $(cat /proc/loadavg)" >> $OUT/log
  $N/sluice-bench scenario functions --part adaptor --function compiled --no-baseline --sluice-bin $bin --out $OUT/fn-$b.json --markdown $OUT/fn-$b.md > $OUT/fn-$b.txt 2>&1
  echo "fn-$b done $(date +%T)" >> $OUT/log
done
