#!/bin/bash
cd /work/wt/agg
BENCH=/tmp/agg-B/sluice-bench
COMMON="scenario seganet --ns 16,64,256,512 --duration 20s --min-devices 0 --out-dir /tmp/agg-runs"
CBOR="--pack-format cbor --max-pack 16KiB --max-delay 50ms"
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"; $BENCH $COMMON --name $name "$@" > /tmp/agg-runs/$name.log 2>&1; echo "== $name end $(date -u +%T) rc=$?"; }
run r3-old --sut sluice --sluice-bin /tmp/agg-A/sluice
run r3-new --sut sluice --sluice-bin /tmp/agg-B/sluice
run r3-bridge --sut mosquitto-bridge
run r3-oldcbor --sut sluice --sluice-bin /tmp/agg-A/sluice $CBOR
run r3-newcbor --sut sluice --sluice-bin /tmp/agg-B/sluice $CBOR
run r3-off --sut sluice --sluice-bin /tmp/agg-B/sluice --aggregate off
run r4-new --sut sluice --sluice-bin /tmp/agg-B/sluice
run r4-old --sut sluice --sluice-bin /tmp/agg-A/sluice
run r4-newcbor --sut sluice --sluice-bin /tmp/agg-B/sluice $CBOR
run r4-oldcbor --sut sluice --sluice-bin /tmp/agg-A/sluice $CBOR
run r4-bridge --sut mosquitto-bridge
