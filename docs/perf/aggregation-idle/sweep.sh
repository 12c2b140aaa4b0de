#!/bin/bash
# Alternating A/B sweep: A = old rule (seeded main build), B = new rule.
cd /work/wt/agg
BENCH=/tmp/agg-B/sluice-bench
COMMON="scenario seganet --ns 16,256,1024,4096 --duration 20s --aggregate on --min-devices 0 --out-dir /tmp/agg-runs"
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"; $BENCH $COMMON --name $name "$@" > /tmp/agg-runs/$name.log 2>&1; echo "== $name end $(date -u +%T) rc=$?"; }
run r1-old --sut sluice --sluice-bin /tmp/agg-A/sluice
run r1-new --sut sluice --sluice-bin /tmp/agg-B/sluice
run r1-newnoack --sut sluice --sluice-bin /tmp/agg-B/sluice --wait-for-ack off
run r1-bridge --sut mosquitto-bridge
run r2-new --sut sluice --sluice-bin /tmp/agg-B/sluice
run r2-old --sut sluice --sluice-bin /tmp/agg-A/sluice
run r2-newnoack --sut sluice --sluice-bin /tmp/agg-B/sluice --wait-for-ack off
run r2-off --sut sluice --sluice-bin /tmp/agg-B/sluice --aggregate off
run r2-bridge --sut mosquitto-bridge
