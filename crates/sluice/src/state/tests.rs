//! The state format: records round-trip, a torn or damaged file loads a state that existed,
//! compaction keeps the image, deadlines survive a restart and a clock step.

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
use proptest::prelude::*;
use sluice_proto::mqtt::{Properties, QoS, SubscriptionOptions};

use super::image::{Bounds, Image};
use super::record::{encode_frame, next_frame, Frame, Record, StoredMessage};
use super::store::{self, StateClock};

fn msg(topic: &str, payload: &[u8], qos: QoS) -> StoredMessage {
    StoredMessage {
        topic: topic.into(),
        payload: Bytes::copy_from_slice(payload),
        qos,
        retain: false,
        properties: None,
        expires_at: None,
    }
}

fn arb_str() -> impl Strategy<Value = ByteString> {
    "[a-z0-9/+#]{1,12}".prop_map(ByteString::from)
}

fn arb_msg() -> impl Strategy<Value = StoredMessage> {
    (
        arb_str().prop_filter("a topic has no wildcard", |t| !t.contains(['+', '#'])),
        proptest::collection::vec(any::<u8>(), 0..40),
        0u8..3,
        any::<bool>(),
        proptest::option::of(any::<i64>()),
        proptest::option::of((1u32..100_000, "[a-z]{0,8}")),
    )
        .prop_map(
            |(topic, payload, qos, retain, expires_at, props)| StoredMessage {
                topic,
                payload: Bytes::from(payload),
                qos: QoS::from_u8(qos).unwrap(),
                retain,
                properties: props.map(|(expiry, ct)| {
                    Box::new(Properties {
                        message_expiry_interval: Some(expiry),
                        content_type: if ct.is_empty() { None } else { Some(ct.into()) },
                        ..Properties::default()
                    })
                }),
                expires_at,
            },
        )
}

fn arb_record() -> impl Strategy<Value = Record> {
    let client = prop_oneof![
        Just(ByteString::from("a")),
        Just(ByteString::from("b")),
        Just(ByteString::from("c"))
    ];
    let id = 1u16..6;
    prop_oneof![
        (any::<i64>(), any::<u64>())
            .prop_map(|(mono_ms, wall_ms)| Record::Clock { mono_ms, wall_ms }),
        arb_msg().prop_map(Record::Retain),
        (client.clone(), any::<u32>())
            .prop_map(|(client, expiry_s)| Record::SessionOpen { client, expiry_s }),
        (client.clone(), any::<i64>())
            .prop_map(|(client, expires_at)| Record::SessionOffline { client, expires_at }),
        client
            .clone()
            .prop_map(|client| Record::SessionEnd { client }),
        (
            client.clone(),
            arb_str(),
            0u8..3,
            any::<bool>(),
            any::<bool>(),
            0u8..3,
            any::<u32>()
        )
            .prop_map(
                |(client, filter, q, nl, rap, rh, sub_id)| Record::Subscribe {
                    client,
                    filter,
                    options: SubscriptionOptions {
                        qos: QoS::from_u8(q).unwrap(),
                        no_local: nl,
                        retain_as_published: rap,
                        retain_handling: rh,
                    },
                    sub_id,
                }
            ),
        (client.clone(), arb_str())
            .prop_map(|(client, filter)| Record::Unsubscribe { client, filter }),
        (
            client.clone(),
            arb_msg().prop_filter("queued is QoS 1/2", |m| m.qos != QoS::AtMostOnce)
        )
            .prop_map(|(client, msg)| Record::Enqueue { client, msg }),
        client
            .clone()
            .prop_map(|client| Record::PopOutbox { client }),
        (client.clone(), id.clone())
            .prop_map(|(client, packet_id)| Record::Send { client, packet_id }),
        (client.clone(), id.clone())
            .prop_map(|(client, packet_id)| Record::Released { client, packet_id }),
        (client.clone(), id.clone())
            .prop_map(|(client, packet_id)| Record::Acked { client, packet_id }),
        (client.clone(), id.clone(), 1u16..4).prop_map(|(client, packet_id, bound)| {
            Record::AwaitRel {
                client,
                packet_id,
                bound,
            }
        }),
        (client.clone(), id).prop_map(|(client, packet_id)| Record::RelDone { client, packet_id }),
        (client.clone(), arb_msg(), any::<i64>()).prop_map(|(client, msg, publish_at)| {
            Record::Will {
                client,
                msg,
                publish_at,
            }
        }),
        client
            .clone()
            .prop_map(|client| Record::WillDone { client }),
        client.prop_map(|client| Record::DropQueued { client }),
    ]
}

fn frames(records: &[Record]) -> BytesMut {
    let mut b = BytesMut::new();
    for (i, r) in records.iter().enumerate() {
        encode_frame(&mut b, i as u64, r);
    }
    b
}

fn image_of(records: &[Record]) -> Image {
    let mut image = Image::new(Bounds::unbounded());
    for r in records {
        image.apply(r.clone());
    }
    image
}

proptest! {
    #[test]
    fn every_record_decodes_to_itself(r in arb_record()) {
        let mut b = BytesMut::new();
        r.encode(&mut b);
        prop_assert_eq!(Record::decode(&b), Ok(r.clone()));
        let f = frames(std::slice::from_ref(&r));
        match next_frame(&f) {
            Frame::Record { record, seq, len } => {
                prop_assert_eq!(record, Ok(r));
                prop_assert_eq!((seq, len), (0, f.len()));
            }
            other => prop_assert!(false, "{:?}", other),
        }
    }

    #[test]
    fn any_bytes_decode_or_fail_without_panicking(b in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = Record::decode(&b);
        let _ = next_frame(&b);
        let mut image = Image::new(Bounds::unbounded());
        let _ = store::apply_frames(&mut image, &b);
    }

    /// A log cut at any byte (a `kill -9` mid-write) loads exactly the records before the cut.
    #[test]
    fn a_log_cut_anywhere_loads_a_state_that_existed(
        records in proptest::collection::vec(arb_record(), 1..30),
        cut in any::<prop::sample::Index>(),
    ) {
        let b = frames(&records);
        let cut = cut.index(b.len() + 1);
        let mut image = Image::new(Bounds::unbounded());
        let (good, bad, torn) = store::apply_frames(&mut image, &b[..cut]);
        prop_assert_eq!(bad, 0);
        let whole = records.iter().take(good as usize).map(|r| {
            let mut f = BytesMut::new();
            encode_frame(&mut f, 0, r);
            f.len()
        }).sum::<usize>();
        prop_assert_eq!(whole + torn as usize, cut, "only the torn tail is left out");
        prop_assert_eq!(image, image_of(&records[..good as usize]));
    }

    /// A flipped byte anywhere never makes a load apply a record that was not written: the
    /// damaged record and everything after it are left out, what comes before is kept.
    #[test]
    fn a_flipped_byte_keeps_the_records_before_it(
        records in proptest::collection::vec(arb_record(), 1..20),
        at in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let mut b = frames(&records);
        let at = at.index(b.len());
        b[at] ^= 1 << bit;
        let mut image = Image::new(Bounds::unbounded());
        let (good, _, _) = store::apply_frames(&mut image, &b);
        let mut offset = 0;
        let mut before = 0;
        for r in &records {
            let mut f = BytesMut::new();
            encode_frame(&mut f, 0, r);
            if offset + f.len() > at { break; }
            offset += f.len();
            before += 1;
        }
        prop_assert_eq!(good, before);
        prop_assert_eq!(image, image_of(&records[..before as usize]));
    }

    /// A snapshot (the image as records) rebuilds the same image.
    #[test]
    fn a_snapshot_rebuilds_the_image(records in proptest::collection::vec(arb_record(), 0..60)) {
        let image = image_of(&records);
        let mut again = Image::new(Bounds::unbounded());
        image.to_records(|r| again.apply(r));
        prop_assert_eq!(again, image);
    }
}

#[test]
fn the_image_keeps_the_live_stores_bounds() {
    let mut image = Image::new(Bounds {
        max_retained_messages: 2,
        max_retained_bytes: usize::MAX,
        max_sessions: 1,
        max_queued_messages: 1,
        max_subscriptions: 1,
    });
    for t in ["a", "b", "c"] {
        image.apply(Record::Retain(msg(t, b"1", QoS::AtMostOnce)));
    }
    assert_eq!(image.retained.len(), 2);
    image.apply(Record::Retain(msg("a", b"", QoS::AtMostOnce)));
    assert_eq!(image.retained.len(), 1, "an empty payload deletes");
    for c in ["x", "y"] {
        image.apply(Record::SessionOpen {
            client: c.into(),
            expiry_s: 60,
        });
    }
    assert_eq!(image.sessions.len(), 1);
    for _ in 0..2 {
        image.apply(Record::Enqueue {
            client: "x".into(),
            msg: msg("t", b"1", QoS::AtLeastOnce),
        });
    }
    assert_eq!(image.sessions["x"].outbox.len(), 1);
    assert_eq!(image.refused, 3);
}

#[test]
fn files_survive_a_reload_and_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let clock = StateClock::new();
    let (image, report) = store::load(dir.path(), Bounds::unbounded(), &clock).unwrap();
    assert_eq!(report, store::LoadReport::default());
    let (mut log, _) = store::compact(dir.path(), 1, &image, &clock).unwrap();
    let records = vec![
        Record::Retain(msg("r/1", b"hello", QoS::AtLeastOnce)),
        Record::SessionOpen {
            client: "dev".into(),
            expiry_s: 3600,
        },
        Record::Enqueue {
            client: "dev".into(),
            msg: msg("t", b"q", QoS::AtLeastOnce),
        },
        Record::Enqueue {
            client: "dev".into(),
            msg: msg("t", b"r", QoS::ExactlyOnce),
        },
        Record::Send {
            client: "dev".into(),
            packet_id: 7,
        },
        Record::AwaitRel {
            client: "dev".into(),
            packet_id: 9,
            bound: 10,
        },
    ];
    let mut buf = BytesMut::new();
    log.commit(&clock, &records, &mut buf).unwrap();
    let expected = image_of(&records);
    let (loaded, report) =
        store::load(dir.path(), Bounds::unbounded(), &StateClock::new()).unwrap();
    assert_eq!(report.generation, 1);
    assert_eq!(report.log_records, 7, "one clock record and six changes");
    // Online at the crash: offline from now, ending expiry_s later.
    assert!(!loaded.sessions["dev"].online);
    let mut loaded_online = loaded.clone();
    loaded_online.sessions.get_mut("dev").unwrap().online = true;
    loaded_online.sessions.get_mut("dev").unwrap().expires_at = None;
    assert_eq!(loaded_online, expected);
    // Compaction to generation 2 keeps it and removes generation 1's log.
    store::compact(dir.path(), 2, &loaded, &clock).unwrap();
    assert!(!dir.path().join(format!("log.{:020}", 1)).exists());
    let (again, report) = store::load(dir.path(), Bounds::unbounded(), &StateClock::new()).unwrap();
    assert_eq!((report.generation, report.log_records), (2, 0));
    let left = |i: &Image| i.sessions["dev"].expires_at.unwrap();
    assert!(
        (left(&again) - left(&loaded)).abs() < 2_000,
        "the deadline moved with the clocks"
    );
    let mut again = again;
    again.sessions.get_mut("dev").unwrap().expires_at = loaded.sessions["dev"].expires_at;
    assert_eq!(again, loaded);
}

/// A deadline keeps what was left of it at the last commit, minus the wall-clock time since;
/// a wall clock that went back counts as no time at all.
#[test]
fn deadlines_are_moved_to_the_new_process_and_a_clock_step_back_expires_nothing() {
    let now_wall = StateClock::wall_ms();
    for (wall_last, expect_left_ms) in [
        (now_wall - 10_000, 50_000i64),    // down 10 s: 60 s left becomes 50 s
        (now_wall + 3_600_000, 60_000i64), // the clock is now 1 h behind: still 60 s
    ] {
        let mut image = Image::new(Bounds::unbounded());
        image.apply(Record::Clock {
            mono_ms: 1_000_000,
            wall_ms: wall_last,
        });
        image.apply(Record::SessionOpen {
            client: "d".into(),
            expiry_s: 3600,
        });
        image.apply(Record::SessionOffline {
            client: "d".into(),
            expires_at: 1_060_000,
        });
        let clock = StateClock::new();
        store::rebase(&mut image, &clock);
        let left = image.sessions["d"].expires_at.unwrap() - clock.now();
        assert!(
            (left - expect_left_ms).abs() < 2_000,
            "left {left} ms, expected about {expect_left_ms}"
        );
    }
}

#[test]
fn a_damaged_snapshot_header_or_stray_files_do_not_stop_a_load() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("snapshot"), b"not a snapshot").unwrap();
    std::fs::write(dir.path().join("snapshot.tmp"), b"half").unwrap();
    std::fs::write(dir.path().join("log.00000000000000000007"), b"old").unwrap();
    let (image, report) = store::load(dir.path(), Bounds::unbounded(), &StateClock::new()).unwrap();
    assert!(image.sessions.is_empty() && image.retained.is_empty());
    assert_eq!(report.bad_files, 1);
    assert!(!dir.path().join("snapshot.tmp").exists());
    assert!(!dir.path().join("log.00000000000000000007").exists());
}

/// `kill -9` mid-write, on real files: the log cut at every byte still loads, and what it
/// loads grows commit by commit (never a record that was not whole on disk).
#[test]
fn a_log_file_truncated_at_every_byte_loads() {
    let dir = tempfile::tempdir().unwrap();
    let clock = StateClock::new();
    let (image, _) = store::load(dir.path(), Bounds::unbounded(), &clock).unwrap();
    let (mut log, _) = store::compact(dir.path(), 1, &image, &clock).unwrap();
    let mut buf = BytesMut::new();
    log.commit(
        &clock,
        &[Record::SessionOpen {
            client: "d".into(),
            expiry_s: 60,
        }],
        &mut buf,
    )
    .unwrap();
    for i in 0..3u8 {
        log.commit(
            &clock,
            &[
                Record::Enqueue {
                    client: "d".into(),
                    msg: msg("t", &[i], QoS::AtLeastOnce),
                },
                Record::Retain(msg(&format!("r/{i}"), b"v", QoS::AtMostOnce)),
            ],
            &mut buf,
        )
        .unwrap();
    }
    let path = dir.path().join(format!("log.{:020}", 1));
    let whole = std::fs::read(&path).unwrap();
    let mut last = 0;
    for cut in 0..=whole.len() {
        std::fs::write(&path, &whole[..cut]).unwrap();
        let (image, report) =
            store::load(dir.path(), Bounds::unbounded(), &StateClock::new()).unwrap();
        let queued = image.sessions.get("d").map_or(0, |s| s.outbox.len());
        let applied = report.log_records;
        assert!(applied >= last, "a longer file never loads less");
        last = applied;
        assert!(queued <= 3 && image.retained.len() <= 3);
        if cut == whole.len() {
            assert_eq!((queued, image.retained.len(), report.torn_bytes), (3, 3, 0));
        }
    }
}
