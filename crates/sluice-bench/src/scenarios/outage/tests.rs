use super::*;

fn a(device: u32, seq: u64, sent_s: u64, recv_s: u64) -> Arrival {
    Arrival {
        device,
        seq,
        sent_at_ns: sent_s * 1_000_000_000,
        received_ns: recv_s * 1_000_000_000 + 1_000_000,
        payload_bytes: 100,
    }
}

#[test]
fn metric_sum_adds_every_labelled_sample_and_ignores_other_names() {
    let text = "# HELP sluice_spool_bytes x\nsluice_spool_bytes{shard=\"0\",uplink=\"cloud\"} 10\n\
                sluice_spool_bytes{shard=\"1\",uplink=\"cloud\"} 5\nsluice_spool_bytes_other 99\n";
    assert_eq!(metric_sum(text, "sluice_spool_bytes"), Some(15.0));
    assert_eq!(metric_sum(text, "sluice_spool_backlog_records"), None);
}

#[test]
fn live_messages_overtaking_the_backlog_are_not_order_violations_but_reordering_within_a_stream_is()
{
    // cut at 10 s, reconnect at 20 s; device 0 sent 0..=1 before, 2..=3 during the
    // outage, 4..=5 after the reconnect (guard 1 s). Device 1's message, sent at the
    // reconnect, is the first to arrive after it (sluice's session is up by then).
    let e = Events {
        started_ns: 0,
        steady_from_ns: 0,
        cut_ns: 10_000_000_000,
        reconnect_ns: 20_000_000_000,
        load_end_ns: 40_000_000_000,
        guard_ns: 1_000_000_000,
    };
    let arrivals = vec![
        a(0, 0, 1, 1),
        a(0, 1, 2, 2),
        a(1, 0, 20, 21),
        a(0, 4, 22, 22), // live first
        a(0, 2, 12, 23), // backlog
        a(0, 3, 13, 24),
        a(0, 3, 13, 24), // duplicate
        a(0, 5, 25, 25),
    ];
    let r = analyse(&arrivals, &e);
    assert_eq!(r.unique, 7);
    assert_eq!(r.gaps, 0);
    assert_eq!(r.backlog_messages, 2);
    assert_eq!(r.backlog_sent_during_outage, 2);
    assert_eq!(r.drain_end_ns, Some(24_001_000_000));
    assert_eq!(r.order.backlog_violations, 0);
    assert_eq!(r.order.live_violations, 0);
    assert_eq!(r.order.devices_with_live_before_backlog, 1);

    let swapped = vec![
        a(0, 0, 1, 1),
        a(0, 3, 13, 23),
        a(0, 2, 12, 24),
        a(0, 5, 25, 25),
    ];
    let r = analyse(&swapped, &e);
    assert_eq!(r.order.backlog_violations, 1);
    assert_eq!(r.gaps, 2, "seqs 1 and 4 never arrived");
}

#[test]
fn messages_sent_before_the_first_arrival_after_the_reconnect_are_not_order_checked() {
    // The relay accepted at 20 s but sluice's session came up later: nothing arrived until
    // 30 s, so what was sent before then may have travelled as backlog.
    let e = Events {
        started_ns: 0,
        steady_from_ns: 0,
        cut_ns: 10_000_000_000,
        reconnect_ns: 20_000_000_000,
        load_end_ns: 40_000_000_000,
        guard_ns: 1_000_000_000,
    };
    let arrivals = vec![
        a(0, 0, 1, 1),
        a(0, 2, 25, 30),
        a(0, 3, 31, 31),
        a(0, 1, 22, 32), // sent as live by the device, read by sluice as backlog
    ];
    let r = analyse(&arrivals, &e);
    assert_eq!(r.order.live_violations, 0);
    assert_eq!(r.order.unchecked_near_reconnect, 2);
    assert_eq!(r.order.live_checked, 1);
}
