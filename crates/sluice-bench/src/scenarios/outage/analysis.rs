//! The outage scenario's analysis, sans-IO: arrivals and event times in, figures out.

use super::*;

/// Event times of a run, ns since the UNIX epoch.
#[derive(Debug, Clone, Copy)]
pub struct Events {
    pub started_ns: u64,
    /// The ramp's end: "before the outage" latencies start here.
    pub steady_from_ns: u64,
    pub cut_ns: u64,
    pub reconnect_ns: u64,
    pub load_end_ns: u64,
    pub guard_ns: u64,
}

/// What [`analyse`] computes from the arrivals.
pub struct Analysis {
    /// Per second after the start: first arrivals of messages sent before the reconnect
    /// (pre-cut traffic and backlog) and after it (live).
    pub per_second: Vec<SecondCounts>,
    pub unique: u64,
    pub gaps: u64,
    pub backlog_messages: u64,
    pub backlog_bytes: u64,
    pub backlog_sent_during_outage: u64,
    pub drain_end_ns: Option<u64>,
    pub before: Histogram<u64>,
    pub live_during_drain: Histogram<u64>,
    pub live_after_drain: Histogram<u64>,
    pub backlog: Histogram<u64>,
    /// Sent within the guard after the reconnect (sluice's session may not be up yet: either
    /// stream).
    pub near_reconnect: Histogram<u64>,
    pub order: OrderCheck,
}

/// Classify every first arrival (in arrival order) by its send time relative to the events.
pub fn analyse(arrivals: &[Arrival], e: &Events) -> Analysis {
    let mut seen: HashSet<(u32, u64)> = HashSet::with_capacity(arrivals.len());
    let mut firsts: Vec<Arrival> = Vec::with_capacity(arrivals.len());
    for a in arrivals {
        if seen.insert((a.device, a.seq)) {
            firsts.push(*a);
        }
    }
    let backlog_firsts: Vec<&Arrival> = firsts
        .iter()
        .filter(|a| a.sent_at_ns < e.reconnect_ns && a.received_ns >= e.reconnect_ns)
        .collect();
    let drain_end_ns = backlog_firsts.iter().map(|a| a.received_ns).max();
    // Live from: the guard after the reconnect, or the first arrival after it if that is
    // later (sluice's session is up by then; before it, a message may still travel as
    // backlog: the reconnect the relay sees is the TCP accept, not sluice's CONNACK, and a
    // loaded machine can take seconds between the two).
    let first_after_reconnect = firsts
        .iter()
        .map(|a| a.received_ns)
        .filter(|&r| r >= e.reconnect_ns)
        .min();
    let live_from_ns = e
        .reconnect_ns
        .saturating_add(e.guard_ns)
        .max(first_after_reconnect.unwrap_or(0));
    let drain_end = drain_end_ns.unwrap_or(e.reconnect_ns);
    let mut before = latency_histogram();
    let mut live_during_drain = latency_histogram();
    let mut live_after_drain = latency_histogram();
    let mut backlog = latency_histogram();
    let mut near_reconnect = latency_histogram();
    let mut max_seq: HashMap<u32, u64> = HashMap::new();
    let mut count: HashMap<u32, u64> = HashMap::new();
    // Per device: highest seq seen so far in the backlog and in the live stream.
    let mut backlog_high: HashMap<u32, Arrival> = HashMap::new();
    let mut live_high: HashMap<u32, Arrival> = HashMap::new();
    // Per device: lowest live seq arrived so far (for the interleaving count).
    let mut live_low: HashMap<u32, u64> = HashMap::new();
    let mut interleaved: HashSet<u32> = HashSet::new();
    let mut order = OrderCheck {
        backlog_checked: 0,
        backlog_violations: 0,
        live_checked: 0,
        live_violations: 0,
        unchecked_near_reconnect: 0,
        devices_with_live_before_backlog: 0,
        first_violations: Vec::new(),
    };
    let rel_ms = |ns: u64| (ns as f64 - e.cut_ns as f64) / 1e6;
    for a in &firsts {
        let micros = a.received_ns.saturating_sub(a.sent_at_ns) / 1000;
        let m = max_seq.entry(a.device).or_insert(a.seq);
        *m = (*m).max(a.seq);
        *count.entry(a.device).or_insert(0) += 1;
        if a.sent_at_ns >= e.steady_from_ns && a.sent_at_ns < e.cut_ns {
            // In flight at the cut and delivered after the reconnect: part of the backlog.
            if a.received_ns < e.cut_ns {
                record_us(&mut before, micros);
            }
        } else if a.sent_at_ns >= e.cut_ns && a.sent_at_ns < e.reconnect_ns {
            record_us(&mut backlog, micros);
        } else if a.sent_at_ns >= e.reconnect_ns && a.sent_at_ns < live_from_ns {
            record_us(&mut near_reconnect, micros);
        } else if a.sent_at_ns >= e.reconnect_ns && a.sent_at_ns <= drain_end {
            record_us(&mut live_during_drain, micros);
        } else if a.sent_at_ns > drain_end {
            record_us(&mut live_after_drain, micros);
        }
        let is_backlog = a.sent_at_ns.saturating_add(e.guard_ns) < e.reconnect_ns;
        let (checked, violations, high) =
            if a.sent_at_ns.saturating_add(e.guard_ns) < e.reconnect_ns {
                if live_low.get(&a.device).is_some_and(|&low| low > a.seq) {
                    interleaved.insert(a.device);
                }
                (
                    &mut order.backlog_checked,
                    &mut order.backlog_violations,
                    &mut backlog_high,
                )
            } else if a.sent_at_ns >= live_from_ns {
                let low = live_low.entry(a.device).or_insert(a.seq);
                *low = (*low).min(a.seq);
                (
                    &mut order.live_checked,
                    &mut order.live_violations,
                    &mut live_high,
                )
            } else {
                order.unchecked_near_reconnect += 1;
                continue;
            };
        *checked += 1;
        match high.get_mut(&a.device) {
            Some(h) if h.seq > a.seq => {
                *violations += 1;
                if order.first_violations.len() < MAX_VIOLATION_SAMPLES {
                    order.first_violations.push(OrderViolation {
                        device: a.device,
                        backlog: is_backlog,
                        seq: a.seq,
                        sent_ms: rel_ms(a.sent_at_ns),
                        received_ms: rel_ms(a.received_ns),
                        overtaken_by_seq: h.seq,
                        overtaken_by_sent_ms: rel_ms(h.sent_at_ns),
                        overtaken_by_received_ms: rel_ms(h.received_ns),
                    });
                }
            }
            Some(h) => *h = *a,
            None => {
                high.insert(a.device, *a);
            }
        }
    }
    order.devices_with_live_before_backlog = interleaved.len() as u64;
    let mut per_second: Vec<SecondCounts> = Vec::new();
    for a in &firsts {
        let t = a.received_ns.saturating_sub(e.started_ns) / 1_000_000_000;
        let Ok(i) = usize::try_from(t) else { continue };
        if i >= 100_000 {
            continue;
        }
        while per_second.len() <= i {
            per_second.push(SecondCounts {
                t_s: per_second.len() as u64,
                sent_before_reconnect: 0,
                sent_after_reconnect: 0,
            });
        }
        if a.sent_at_ns < e.reconnect_ns {
            per_second[i].sent_before_reconnect += 1;
        } else {
            per_second[i].sent_after_reconnect += 1;
        }
    }
    let gaps = max_seq
        .iter()
        .map(|(d, &m)| (m + 1).saturating_sub(count.get(d).copied().unwrap_or(0)))
        .sum();
    Analysis {
        per_second,
        unique: firsts.len() as u64,
        gaps,
        backlog_messages: backlog_firsts.len() as u64,
        backlog_bytes: backlog_firsts
            .iter()
            .map(|a| u64::from(a.payload_bytes))
            .sum(),
        backlog_sent_during_outage: backlog_firsts
            .iter()
            .filter(|a| a.sent_at_ns >= e.cut_ns)
            .count() as u64,
        drain_end_ns,
        before,
        live_during_drain,
        live_after_drain,
        backlog,
        near_reconnect,
        order,
    }
}
