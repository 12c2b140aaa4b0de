use super::*;
use sluice_proto::phd::config::{attr, class, MetricObject};

fn table(config_id: u16) -> Arc<ObjectTable> {
    Arc::new(ObjectTable {
        config_id,
        objects: vec![MetricObject {
            class: class::METRIC_NU,
            handle: 1,
            kind: (2, 0x4BB8),
            unit: Some(0x0220),
            value_map: vec![(attr::NU_VAL_OBS_BASIC, 2)],
            components: vec![],
        }],
    })
}

#[test]
fn learnt_configs_are_bounded_persisted_and_reloaded() {
    let dir = tempfile::tempdir().unwrap();
    let room = PhdRoom::new(10, 2, Some(dir.path().to_path_buf()), false);
    for (i, id) in [0x4000u16, 0x4001, 0x4002].into_iter().enumerate() {
        assert_eq!(room.learn([i as u8; 8], table(id), None, None), Taught::New);
    }
    room.flush(); // the last ones came within a second of the first save
    let snap = room.snapshot();
    assert!(
        snap.known(&[0; 8], 0x4000).is_none(),
        "the oldest is forgotten"
    );
    assert!(snap.known(&[2; 8], 0x4002).is_some());
    assert!(snap.known(&[2; 8], 0x4001).is_none(), "kept per agent");
    assert!(
        snap.known(&[9; 8], 0x0190).is_some(),
        "standard ones for everybody"
    );
    let again = PhdRoom::new(10, 2, Some(dir.path().to_path_buf()), false);
    let snap = again.snapshot();
    assert_eq!(snap.known(&[1; 8], 0x4001), Some(table(0x4001)));
    assert_eq!(snap.known(&[2; 8], 0x4002), Some(table(0x4002)));
    assert_eq!(again.metrics.configs.get(), 2);
}

#[test]
fn a_learnt_configuration_is_not_replaced_by_another_table_unless_relearning_is_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let by: SocketAddr = "192.0.2.1:4000".parse().unwrap();
    let mut other = (*table(0x4000)).clone();
    other.objects[0].unit = Some(0x17A0); // the same handle in °C
    let other = Arc::new(other);
    let room = PhdRoom::new(10, 10, Some(dir.path().to_path_buf()), false);
    assert_eq!(
        room.learn([7; 8], table(0x4000), Some(by), Some(Arc::from("ox-1"))),
        Taught::New
    );
    let snap = room.snapshot();
    assert!(
        snap.may_learn(&[7; 8], &table(0x4000)),
        "the same table again"
    );
    assert!(!snap.may_learn(&[7; 8], &other), "another table: refused");
    assert!(snap.may_learn(&[8; 8], &other), "another agent's own");
    assert_eq!(
        room.learn([7; 8], other.clone(), None, None),
        Taught::Conflict
    );
    assert!(!snap.owned_by_another(&[7; 8], Some("ox-1")));
    assert!(
        snap.owned_by_another(&[7; 8], Some("ox-2")),
        "another identity"
    );
    assert!(snap.owned_by_another(&[7; 8], None), "no identity");
    assert!(
        !snap.owned_by_another(&[8; 8], None),
        "nothing learnt: no owner"
    );
    assert_eq!(room.snapshot().known(&[7; 8], 0x4000), Some(table(0x4000)));
    assert_eq!(room.taught_by(&[7; 8], 0x4000), Some(by));
    room.flush();
    drop(room);
    let again = PhdRoom::new(10, 10, Some(dir.path().to_path_buf()), false);
    assert!(
        !again.snapshot().may_learn(&[7; 8], &other),
        "bound after a restart"
    );
    assert!(again.snapshot().owned_by_another(&[7; 8], None));
    assert!(!again.snapshot().owned_by_another(&[7; 8], Some("ox-1")));
    assert_eq!(again.taught_by(&[7; 8], 0x4000), Some(by));
    drop(again);
    let open = PhdRoom::new(10, 10, Some(dir.path().to_path_buf()), true);
    assert!(open.snapshot().may_learn(&[7; 8], &other));
    assert_eq!(open.learn([7; 8], other.clone(), None, None), Taught::New);
    assert_eq!(open.snapshot().known(&[7; 8], 0x4000), Some(other));
}

#[test]
fn a_learnt_configuration_is_known_only_to_its_teachers_address_or_identity() {
    let dir = tempfile::tempdir().unwrap();
    let by: SocketAddr = "192.0.2.1:4000".parse().unwrap();
    let same_ip: IpAddr = "192.0.2.1".parse().unwrap();
    let other_ip: IpAddr = "192.0.2.2".parse().unwrap();
    let room = PhdRoom::new(10, 10, Some(dir.path().to_path_buf()), false);
    assert_eq!(
        room.learn([7; 8], table(0x4000), Some(by), None),
        Taught::New
    );
    assert_eq!(
        room.learn([9; 8], table(0x4000), Some(by), Some(Arc::from("ox-9"))),
        Taught::New
    );
    let check = |room: &PhdRoom| {
        let snap = room.snapshot();
        let claim = |peer: IpAddr, identity: Option<&'static str>| {
            Claim {
                snapshot: &snap,
                peer: Some(peer),
                identity,
            }
            .known(&[7; 8], 0x4000)
            .is_some()
        };
        assert!(claim(same_ip, None), "the teacher's IP (any port)");
        assert!(!claim(other_ip, None), "another IP: asked for its table");
        let unknown_peer = Claim {
            snapshot: &snap,
            peer: None,
            identity: None,
        };
        assert!(unknown_peer.known(&[7; 8], 0x4000).is_none());
        let far = Claim {
            snapshot: &snap,
            peer: Some(other_ip),
            identity: Some("ox-9"),
        };
        assert!(
            far.known(&[9; 8], 0x4000).is_some(),
            "a certificate identity is trusted from anywhere"
        );
        assert!(far.known(&[1; 8], 0x0190).is_some(), "standard: everybody");
        let not_ox9 = Claim {
            snapshot: &snap,
            peer: Some(same_ip),
            identity: Some("ox-8"),
        };
        assert!(not_ox9.known(&[9; 8], 0x4000).is_none());
        assert!(far.may_learn(&[7; 8], &table(0x4000)), "the same table");
    };
    check(&room);
    // The same table from another address: nothing changes, the teacher stays.
    let moved: SocketAddr = "192.0.2.2:5000".parse().unwrap();
    assert_eq!(
        room.learn([7; 8], table(0x4000), Some(moved), None),
        Taught::Same
    );
    assert_eq!(room.taught_by(&[7; 8], 0x4000), Some(by));
    check(&room);
    room.flush();
    drop(room);
    check(&PhdRoom::new(10, 10, Some(dir.path().to_path_buf()), false));
}

/// An operating pulse oximeter on connection 1, no model string.
fn oximeter() -> AgentEntry {
    AgentEntry {
        specialization: "pulse-oximeter",
        config_id: 0x0190,
        state: "operating",
        model: None,
        shard: None,
        since: Instant::now(),
        conn: 1,
    }
}

#[test]
fn agent_strings_are_cut_to_64_bytes_and_the_table_counts_its_bytes() {
    let room = PhdRoom::new(10, 1, None, false);
    let entry = oximeter();
    assert!(room.agent_up([1; 8], entry.clone()));
    let empty = room.metrics.agent_table_bytes.get();
    assert!(empty > 0 && empty as usize <= AGENT_BYTES_MAX);
    // 63 ASCII bytes then a 3-byte character: cut before it, never inside.
    room.update(&[1; 8], |e| {
        e.model = Some(format!("{}€{}", "m".repeat(63), "x".repeat(65_000)))
    });
    assert_eq!(room.metrics.agent_strings_truncated.get(), 1);
    let status = room.status(STATUS_AGENTS);
    assert_eq!(status["list"][0]["model"], "m".repeat(63));
    let bytes = room.metrics.agent_table_bytes.get() as usize;
    assert!(bytes <= AGENT_BYTES_MAX, "{bytes}");
    room.update(&[1; 8], |e| e.model = Some("short".into()));
    assert_eq!(room.metrics.agent_strings_truncated.get(), 1);
    room.agent_down(&[1; 8], 1);
    assert_eq!(room.metrics.agent_table_bytes.get(), 0);
}

#[test]
fn the_status_lists_a_bounded_number_of_agents_and_counts_all() {
    let room = PhdRoom::new(1000, 1, None, false);
    for i in 0..300u16 {
        let mut id = [0; 8];
        id[..2].copy_from_slice(&i.to_be_bytes());
        room.agent_up(
            id,
            AgentEntry {
                model: Some("M".repeat(1000)),
                ..oximeter()
            },
        );
    }
    let status = room.status(STATUS_AGENTS);
    assert_eq!(status["agents"], 300);
    assert_eq!(status["listed"], STATUS_AGENTS);
    assert_eq!(status["list"].as_array().unwrap().len(), STATUS_AGENTS);
    assert!(status.to_string().len() < STATUS_AGENTS * 400);
}

#[test]
fn the_agent_table_is_bounded() {
    let room = PhdRoom::new(1, 1, None, false);
    let entry = oximeter();
    assert!(room.agent_up([1; 8], entry.clone()));
    assert!(!room.agent_up([2; 8], entry.clone()));
    assert!(
        room.agent_up([1; 8], AgentEntry { conn: 2, ..entry }),
        "the same agent again"
    );
    room.agent_down(&[1; 8], 1);
    assert_eq!(
        room.metrics.agents.get(),
        1,
        "the old connection's close leaves the new one"
    );
    room.agent_down(&[1; 8], 2);
    assert_eq!(room.metrics.agents.get(), 0);
}
