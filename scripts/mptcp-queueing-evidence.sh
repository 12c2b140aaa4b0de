#!/bin/sh
# ADR 0012's evidence: what the kernel's MPTCP scheduler does with CoAP request/response
# traffic over two shaped links, with no sluice in the way. Needs root, iproute2, tc,
# libcoap3-bin (coap-server-notls), mptcpize, python3.
#
# usage: scripts/mptcp-queueing-evidence.sh RATE TBF_LATENCY SIZE WINDOW TOTAL [sluice]
#   e.g. scripts/mptcp-queueing-evidence.sh 2mbit 100ms 900 64 1500
# With `sluice` (and SLUICE=path/to/sluice, default target/release/sluice): the operator's run
# of issue 30 instead: sluice (one shard, `[[coap.proxy]] mptcp = true`, or `paths` with
# PATHS=1) in the gateway namespace, scripts/coap_udp_load.py (aiocoap, one socket) sending
# to it.
# Two veth links gateway<->cloud (10.77.1.0/24, 10.77.2.0/24), the cloud's service address
# 10.77.0.1 on its lo, policy routing per source address, an MPTCP `subflow` endpoint for
# link 1, libcoap's server under `mptcpize run` in the cloud namespace, and
# scripts/coap_tcp_load.py (one MPTCP connection) in the gateway namespace. Prints
# `ss -tiM` of the connection every second, and at the end the qdisc counters and the
# MPTCP MIB counters (nstat).
set -eu
RATE=${1:-2mbit}; LAT=${2:-100ms}; SIZE=${3:-900}; WIN=${4:-64}; TOTAL=${5:-1500}; WITH=${6:-}
HERE=$(cd "$(dirname "$0")" && pwd)
G=mpevg$$; C=mpevc$$
cleanup() {
  for ns in $G $C; do for p in $(ip netns pids $ns 2>/dev/null); do kill -9 $p 2>/dev/null || true; done; ip netns del $ns 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM
ip netns add $G; ip netns add $C
for ns in $G $C; do ip -n $ns link set lo up; ip netns exec $ns sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0; done
ip -n $C addr add 10.77.0.1/32 dev lo
for i in 0 1; do
  n=$((i+1))
  ip -n $G link add g$i type veth peer name c$i netns $C
  ip -n $G addr add 10.77.$n.2/24 dev g$i; ip -n $C addr add 10.77.$n.1/24 dev c$i
  ip -n $G link set g$i up; ip -n $C link set c$i up
  ip -n $G rule add from 10.77.$n.2 table $((100+i))
  ip -n $G route add 10.77.0.1/32 via 10.77.$n.1 dev g$i table $((100+i))
  [ $i = 0 ] && ip -n $G route add 10.77.0.1/32 via 10.77.$n.1 dev g$i
  ip netns exec $G tc qdisc replace dev g$i root tbf rate $RATE burst 32kbit latency $LAT
  ip netns exec $C tc qdisc replace dev c$i root tbf rate $RATE burst 32kbit latency $LAT
done
for ns in $G $C; do ip netns exec $ns sysctl -qw net.ipv4.tcp_congestion_control=${CC:-$(sysctl -n net.ipv4.tcp_congestion_control)}; done
for ns in $G $C; do ip -n $ns mptcp limits set subflows 8 add_addr_accepted 8; done
ip -n $G mptcp endpoint add 10.77.2.2 dev g1 subflow
echo "== kernel $(uname -r), congestion control $(ip netns exec $G sysctl -n net.ipv4.tcp_congestion_control), scheduler $(ip netns exec $G sysctl -n net.mptcp.scheduler), rate $RATE, tbf latency $LAT, $SIZE B PUTs, $WIN outstanding, $TOTAL total"
ip netns exec $G tc qdisc show
ip netns exec $C sh -c 'mptcpize run coap-server-notls -A 10.77.0.1 -p 5683 -v 0 >/dev/null 2>&1 &'
sleep 1
ip netns exec $G nstat -n >/dev/null
if [ "$WITH" = sluice ]; then
  SLUICE=${SLUICE:-$HERE/../target/release/sluice}
  CONF=$(mktemp)
  if [ -n "${PATHS:-}" ]; then HOW='paths = [{ bind = "10.77.1.2" }, { bind = "10.77.2.2" }]'; else HOW='mptcp = true'; fi
  printf '[gateway]\nshards = 1\n[mqtt]\nlisten = "127.0.0.1:1883"\n[coap]\nenabled = true\nlisten = "127.0.0.1:5683"\n[admin]\nenabled = true\nlisten = "127.0.0.1:9100"\n[[coap.proxy]]\nname = "cloud"\nurl = "coap+tcp://10.77.0.1:5683"\nprefix = "cloud"\n%s\nrequest_timeout = "30s"\n' "$HOW" > $CONF
  ip netns exec $G sh -c "$SLUICE run -c $CONF >/dev/null 2>&1 &"
  sleep 2
  ip netns exec $G python3 "$HERE/coap_udp_load.py" 127.0.0.1 cloud/example_data --total $TOTAL --window $WIN --size $SIZE ${SOCKETS:+--sockets} &
else
  ip netns exec $G python3 "$HERE/coap_tcp_load.py" 10.77.0.1 5683 ${NOMPTCP:+--no}--mptcp --total $TOTAL --window $WIN --size $SIZE &
fi
LOAD=$!
t=0
while kill -0 $LOAD 2>/dev/null; do
  sleep 1; t=$((t+1))
  echo "-- t=${t}s ss -tiM (gateway)"
  ip netns exec $G ss -tinM state established '( dport = :5683 or dport = :5201 )' | grep -v '^State' || true
done
wait $LOAD || true
echo "== qdisc counters (gateway side = requests out, cloud side = responses back)"
for i in 0 1; do
  echo "link $i gateway: $(ip netns exec $G tc -s qdisc show dev g$i | tr '\n' ' ' | sed 's/  */ /g')"
  echo "link $i cloud:   $(ip netns exec $C tc -s qdisc show dev c$i | tr '\n' ' ' | sed 's/  */ /g')"
done
if [ "$WITH" = sluice ]; then
  echo "== sluice status: coap_proxy"
  ip netns exec $G python3 -c "
import json, urllib.request
st = json.load(urllib.request.urlopen('http://127.0.0.1:9100/api/v1/status'))
for u in st['coap_proxy']:
    print(json.dumps({k: u[k] for k in ('shard', 'state', 'connects', 'retries', 'mptcp', 'paths') if k in u}))
"
fi
echo "== coap-server alive: $(ip netns pids $C | wc -l) process(es)"
echo "== MPTCP MIB (gateway, nonzero)"
ip netns exec $G nstat -a | grep -i mptcp || true
