#!/bin/bash
# count per-message events of sluice (bin dir $1) over 10 s, 20 s into a 40 s --sut sluice run; out prefix $2
B=$1; O=$2
uptime > $O.load
$B/sluice-bench scenario core --n ${N:-1024} --rate 10 --duration 40s --sut sluice --aggregate off --sluice-bin $B/sluice --progress 0s --out $O.json > $O.log 2>&1 &
bench=$!
for i in $(seq 1 60); do pid=$(pgrep -f "^$B/sluice run" | head -1); [ -n "$pid" ] && break; sleep 1; done
sleep 20
pid=$(pgrep -f "^$B/sluice run" | head -1)
cfg=$(tr '\0' ' ' < /proc/$pid/cmdline | grep -o '[^ ]*\.toml')
port=$(grep -A3 '^\[admin\]' $cfg | grep listen | grep -o ':[0-9]*"' | tr -d ':"')
m0=$(curl -s http://127.0.0.1:$port/metrics | awk '/^sluice_mqtt_messages_received_total/ {s+=$2} END {print s}')
perf stat -x, -e raw_syscalls:sys_enter,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom,syscalls:sys_enter_writev,syscalls:sys_enter_write,syscalls:sys_enter_read,context-switches,task-clock${EXTRA_EV} -p $pid -- sleep 10 2> $O.stat
m1=$(curl -s http://127.0.0.1:$port/metrics | awk '/^sluice_mqtt_messages_received_total/ {s+=$2} END {print s}')
echo "messages $((m1-m0))" >> $O.stat
wait $bench
awk -F, -v n=$((m1-m0)) '/messages/ {print; next} {printf "%-40s %12s  %.3f /msg\n", $3, $1, $1/n}' $O.stat
grep -E "^sluice: delivery" $O.log
