#!/bin/bash
cd /work/wt/agg
BENCH=/tmp/agg-C/sluice-bench
COMMON="scenario seganet --ns 256,512 --duration 20s --min-devices 0 --out-dir /tmp/agg-runs"
CBOR="--pack-format cbor --max-pack 16KiB --max-delay 50ms"
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"; $BENCH $COMMON --name $name "$@" > /tmp/agg-runs/$name.log 2>&1; echo "== $name end $(date -u +%T) rc=$?"; }
run r5-final-maxdelay-cbor --sut sluice --sluice-bin /tmp/agg-C/sluice $CBOR --flush max_delay
run r5-old-cbor --sut sluice --sluice-bin /tmp/agg-A/sluice $CBOR
run r5-final-idle --sut sluice --sluice-bin /tmp/agg-C/sluice
