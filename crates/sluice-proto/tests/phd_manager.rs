//! The PHD manager state machine replayed against the fact sheet's sessions: every agent
//! vector fed to a [`Manager`] gets the manager vector the sheet specifies, byte for byte;
//! configurations are learnt, reports decoded into the right observations and SenML; timers
//! and violations abort with the right reason; arbitrary APDU sequences never panic.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use sluice_proto::phd::config::{self, config_result, ObjectTable};
use sluice_proto::phd::manager::{ConfigLookup, StandardOnly, Violation};
use sluice_proto::phd::measure::{measurements, senml_json};
use sluice_proto::phd::scan::{ObservedValue, ScanReport};
use sluice_proto::phd::{decode_apdu, Apdu, Decimal, Manager, ManagerConfig, Output, State};

fn vector(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/vectors/{name}.hex", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let digits: Vec<u8> = text.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

fn apdu(name: &str) -> Apdu {
    let mut buf = BytesMut::from(&vector(name)[..]);
    let a = decode_apdu(&mut buf, 65_539).unwrap().unwrap();
    assert!(buf.is_empty(), "{name}: one APDU");
    a
}

fn wire(a: &Apdu) -> Vec<u8> {
    let mut b = BytesMut::new();
    a.encode(&mut b);
    b.to_vec()
}

/// A lookup that knows what the test stored.
#[derive(Default)]
struct Stored(HashMap<([u8; 8], u16), Arc<ObjectTable>>);

impl ConfigLookup for Stored {
    fn known(&self, system_id: &[u8], config_id: u16) -> Option<Arc<ObjectTable>> {
        let id: [u8; 8] = system_id.try_into().ok()?;
        self.0.get(&(id, config_id)).cloned()
    }
}

struct Nothing;
impl ConfigLookup for Nothing {
    fn known(&self, _: &[u8], _: u16) -> Option<Arc<ObjectTable>> {
        None
    }
}

fn manager(get_mds: bool, now: Instant) -> Manager {
    let config = ManagerConfig {
        get_mds,
        ..ManagerConfig::default()
    };
    Manager::new(Arc::new(config), now)
}

fn feed(m: &mut Manager, name: &str, lookup: &dyn ConfigLookup, now: Instant) -> Vec<Output> {
    let mut out = Vec::new();
    m.on_apdu(apdu(name), now, lookup, &mut out);
    out
}

fn sent(out: &[Output]) -> Vec<Vec<u8>> {
    out.iter()
        .filter_map(|o| match o {
            Output::Send(a) => Some(wire(a)),
            _ => None,
        })
        .collect()
}

fn report(out: &[Output]) -> (u16, bool, u16, u16, ScanReport) {
    out.iter()
        .find_map(|o| match o {
            Output::Report {
                invoke_id,
                confirmed,
                obj_handle,
                event_type,
                report,
            } => Some((
                *invoke_id,
                *confirmed,
                *obj_handle,
                *event_type,
                report.clone(),
            )),
            _ => None,
        })
        .expect("a report")
}

fn num(m: i32, e: i8) -> ObservedValue {
    ObservedValue::Numeric(Decimal::Value {
        mantissa: m,
        exponent: e,
    })
}

#[test]
fn session_a_standard_config_is_accepted_reported_confirmed_and_released() {
    let now = Instant::now();
    let mut m = manager(false, now);
    let out = feed(&mut m, "phd_po_A1_aarq_std0190", &StandardOnly, now);
    assert_eq!(sent(&out), vec![vector("phd_po_A2_aare_accepted")]);
    assert_eq!(m.state(), State::Operating);
    let out = feed(&mut m, "phd_po_A3_scan_fixed_std0190", &StandardOnly, now);
    assert!(sent(&out).is_empty(), "confirmed only once delivered");
    let (invoke, confirmed, handle, event, r) = report(&out);
    assert!(confirmed);
    assert_eq!(r.observations.len(), 2);
    assert_eq!(r.observations[0].value, num(98, 0));
    assert_eq!(r.observations[1].value, num(72, 0));
    let confirm = sluice_proto::phd::manager::confirmation(invoke, handle, event);
    assert_eq!(wire(&confirm), vector("phd_po_A4_scan_fixed_confirm"));
    let out = feed(&mut m, "phd_po_A5_rlrq_normal", &StandardOnly, now);
    assert_eq!(sent(&out), vec![vector("phd_po_A6_rlre_normal")]);
    assert!(out.contains(&Output::Released));
    assert_eq!(m.state(), State::Unassociated);
}

#[test]
fn session_b_extended_config_is_learnt_then_known_on_the_next_association() {
    let now = Instant::now();
    let mut stored = Stored::default();
    let mut m = manager(false, now);
    let out = feed(&mut m, "phd_po_B1_aarq_ext4000", &stored, now);
    assert_eq!(
        sent(&out),
        vec![vector("phd_po_B2_aare_accepted_unknown_config")]
    );
    assert_eq!(m.state(), State::Configuring);
    let out = feed(&mut m, "phd_po_B3_config_report_ext4000", &stored, now);
    assert_eq!(
        sent(&out),
        vec![vector("phd_po_B4_config_response_accepted")]
    );
    let (agent, table) = out
        .iter()
        .find_map(|o| match o {
            Output::ConfigAccepted { agent, table } => Some((agent.clone(), table.clone())),
            _ => None,
        })
        .expect("accepted");
    assert_eq!(agent.config_id, 0x4000);
    stored.0.insert((agent.system_id, 0x4000), table.clone());
    let out = feed(&mut m, "phd_po_B5_scan_fixed_ext4000", &stored, now);
    let (invoke, _, handle, event, r) = report(&out);
    assert_eq!(r.observations[0].value, num(98, 0));
    let t = r.observations[0].time.expect("time stamp");
    assert_eq!(
        (t.year, t.month, t.day, t.hour, t.minute),
        (2007, 12, 6, 12, 10)
    );
    let confirm = sluice_proto::phd::manager::confirmation(invoke, handle, event);
    assert_eq!(wire(&confirm), vector("phd_po_B6_scan_fixed_confirm"));
    // SenML: SpO2 as a ratio, pulse in beat/min, the agent's time.
    let (ms, skipped) = measurements(&agent.system_id, &table, &r, 0.0, 0);
    assert_eq!(skipped, 0);
    let json = String::from_utf8(senml_json(&ms[0].records).to_vec()).unwrap();
    assert!(
        json.contains("\"u\":\"/\"") && json.contains("\"v\":0.98"),
        "{json}"
    );
    assert!(
        json.contains("\"t\":1196943000"),
        "2007-12-06T12:10:00Z: {json}"
    );
    assert_eq!(ms[1].metric, "pulse");
    let out = feed(&mut m, "phd_po_B7_rlrq_normal", &stored, now);
    assert_eq!(sent(&out), vec![vector("phd_po_B8_rlre_normal")]);
    // The same agent again: its stored config is known, AARE accepted at once.
    let out = feed(&mut m, "phd_po_B1_aarq_ext4000", &stored, now);
    assert_eq!(wire_result(&out), 0);
    assert_eq!(m.state(), State::Operating);
}

/// A lookup that refuses to learn anything (a gateway holding another table for the key).
struct Bound;
impl ConfigLookup for Bound {
    fn known(&self, _: &[u8], _: u16) -> Option<Arc<ObjectTable>> {
        None
    }
    fn may_learn(&self, _: &[u8], _: &ObjectTable) -> bool {
        false
    }
}

#[test]
fn a_config_report_the_lookup_refuses_is_answered_unsupported_and_aborted() {
    let now = Instant::now();
    let mut m = manager(false, now);
    feed(&mut m, "phd_po_B1_aarq_ext4000", &Bound, now);
    let out = feed(&mut m, "phd_po_B3_config_report_ext4000", &Bound, now);
    let sent = sent(&out);
    assert_eq!(sent.len(), 2, "{out:?}");
    // ConfigReportRsp {config-report-id 0x4000, unsupported-config (1)} …
    assert_eq!(&sent[0][22..26], [0x40, 0x00, 0x00, 0x01]);
    // … then ABRT undefined.
    assert_eq!(sent[1], vector("phd_abrt_undefined"));
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::ConfigConflict { agent } if agent.config_id == 0x4000)));
    assert!(!out
        .iter()
        .any(|o| matches!(o, Output::ConfigAccepted { .. })));
    assert_eq!(m.state(), State::Unassociated);
}

fn wire_result(out: &[Output]) -> u16 {
    let aare = &sent(out)[0];
    u16::from_be_bytes([aare[4], aare[5]])
}

#[test]
fn standard_config_report_and_weighing_scale_and_quirk_are_accepted() {
    let now = Instant::now();
    for (aarq, report_vec, config_id) in [
        (
            "phd_po_A1_aarq_std0190",
            "phd_po_C1_config_report_std0190",
            0x0190,
        ),
        (
            "phd_po_A1_aarq_std0190",
            "phd_ws_D1_config_report_std05dc",
            0x05DC,
        ),
        (
            "phd_po_A1_aarq_std0190",
            "phd_quirk_po_config_report_0191_time_abs",
            0x0191,
        ),
    ] {
        let mut m = manager(false, now);
        let out = feed(&mut m, aarq, &Nothing, now);
        assert_eq!(
            sent(&out),
            vec![vector("phd_po_B2_aare_accepted_unknown_config")]
        );
        let out = feed(&mut m, report_vec, &Nothing, now);
        let rsp = &sent(&out)[0];
        let n = rsp.len();
        assert_eq!(
            (
                u16::from_be_bytes([rsp[n - 4], rsp[n - 3]]),
                u16::from_be_bytes([rsp[n - 2], rsp[n - 1]])
            ),
            (config_id, config_result::ACCEPTED),
            "{report_vec}"
        );
        assert_eq!(m.state(), State::Operating, "{report_vec}");
    }
    // D2 on the learnt 0x05DC table: 76.2 kg, confirmed as D3.
    let mut m = manager(false, now);
    feed(&mut m, "phd_po_A1_aarq_std0190", &Nothing, now);
    feed(&mut m, "phd_ws_D1_config_report_std05dc", &Nothing, now);
    let out = feed(&mut m, "phd_ws_D2_scan_fixed_std05dc", &Nothing, now);
    let (invoke, _, handle, event, r) = report(&out);
    assert_eq!(r.observations[0].value, num(762, -1));
    let confirm = sluice_proto::phd::manager::confirmation(invoke, handle, event);
    assert_eq!(wire(&confirm), vector("phd_ws_D3_scan_fixed_confirm"));
}

#[test]
fn blood_pressure_compound_becomes_sys_dia_mean_in_pascal() {
    let table = config::standard(0x02BC).unwrap();
    let Apdu::Prst(d) = apdu("phd_bp_E1_scan_fixed_std02bc") else {
        panic!()
    };
    let sluice_proto::phd::DataMessage::EventReport {
        info, event_type, ..
    } = d.message
    else {
        panic!()
    };
    let layout = sluice_proto::phd::scan::layout(event_type).unwrap();
    let r = sluice_proto::phd::scan::decode(layout, info, table).unwrap();
    assert!(r.skipped.is_empty());
    let id = [0, 0x22, 0x09, 0x22, 0x58, 0x08, 0x03, 0xcc];
    let (ms, _) = measurements(&id, table, &r, 0.0, 0);
    assert_eq!(ms[0].metric, "bp");
    let names: Vec<_> = ms[0].records.iter().map(|r| r.name.clone()).collect();
    assert_eq!(
        names,
        [
            "urn:dev:mac:00220922580803cc:sys",
            "urn:dev:mac:00220922580803cc:dia",
            "urn:dev:mac:00220922580803cc:mean"
        ]
    );
    let values: Vec<_> = ms[0]
        .records
        .iter()
        .map(|r| match r.value {
            Some(sluice_proto::senml::Value::Number(v)) => v,
            _ => f64::NAN,
        })
        .collect();
    assert_eq!(values, [15999.0, 10666.0, 13332.0]); // 120, 80, 100 mmHg → Pa (sheet's rounding)
    assert_eq!(ms[1].metric, "pulse");
    assert_eq!(
        ms[1].records[0].value,
        Some(sluice_proto::senml::Value::Number(60.0))
    );
}

#[test]
fn manager_requests_mds_attributes_and_reads_the_answer() {
    let now = Instant::now();
    let mut m = manager(true, now);
    let out = feed(&mut m, "phd_po_A1_aarq_std0190", &StandardOnly, now);
    assert_eq!(
        sent(&out),
        vec![
            vector("phd_po_A2_aare_accepted"),
            vector("phd_po_C4_get_mds_request")
        ]
    );
    let out = feed(&mut m, "phd_po_C5_get_mds_response", &StandardOnly, now);
    let attrs = out
        .iter()
        .find_map(|o| match o {
            Output::MdsAttributes(a) => Some(a.clone()),
            _ => None,
        })
        .expect("attributes");
    let (model, _) = sluice_proto::phd::manager::mds_summary(&attrs);
    assert!(model.is_some_and(|m| !m.is_empty()));
    assert_eq!(m.deadline(), None, "nothing more awaited");
}

#[test]
fn rejections_and_timeouts_and_violations_answer_with_the_specified_bytes() {
    let now = Instant::now();
    // No 20601 in the data-proto list: C3.
    let Apdu::Aarq(mut aarq) = apdu("phd_po_A1_aarq_std0190") else {
        panic!()
    };
    aarq.protos[0].id = 0xFFFF;
    let mut m = manager(false, now);
    let mut out = Vec::new();
    m.on_apdu(Apdu::Aarq(aarq), now, &StandardOnly, &mut out);
    assert_eq!(
        sent(&out),
        vec![vector("phd_po_C3_aare_rejected_no_common_protocol")]
    );
    // Configuration timeout.
    let mut m = manager(false, now);
    feed(&mut m, "phd_po_B1_aarq_ext4000", &Nothing, now);
    let mut out = Vec::new();
    m.on_timeout(now + Duration::from_secs(5), &mut out);
    assert!(out.is_empty(), "not yet");
    m.on_timeout(m.deadline().unwrap(), &mut out);
    assert_eq!(sent(&out), vec![vector("phd_abrt_configuration_timeout")]);
    assert_eq!(m.state(), State::Unassociated);
    // Response timeout for the MDS GET.
    let mut m = manager(true, now);
    feed(&mut m, "phd_po_A1_aarq_std0190", &StandardOnly, now);
    let mut out = Vec::new();
    m.on_timeout(m.deadline().unwrap(), &mut out);
    assert_eq!(sent(&out), vec![vector("phd_abrt_response_timeout")]);
    // A report before association: ABRT undefined, connection closed.
    let mut m = manager(false, now);
    let out = feed(&mut m, "phd_po_A3_scan_fixed_std0190", &StandardOnly, now);
    assert_eq!(sent(&out), vec![vector("phd_abrt_undefined")]);
    assert!(out.contains(&Output::Close));
    // An oversize APDU: buffer-overflow.
    let mut m = manager(false, now);
    let mut buf = BytesMut::from(&[0xE7, 0x00, 0xFF, 0xF0][..]);
    let err = decode_apdu(&mut buf, 1024).unwrap_err();
    let mut out = Vec::new();
    m.on_decode_error(&err, now, &mut out);
    assert_eq!(sent(&out), vec![vector("phd_abrt_buffer_overflow")]);
    // A config report that does not check: unsupported-config, as C2.
    let mut m = manager(false, now);
    feed(&mut m, "phd_po_B1_aarq_ext4000", &Nothing, now);
    let mut bad = vector("phd_po_B3_config_report_ext4000");
    bad[30] = 0; // first object's handle 1 → 0 (the MDS's)
    bad[31] = 0;
    let mut buf = BytesMut::from(&bad[..]);
    let a = decode_apdu(&mut buf, 65_539).unwrap().unwrap();
    let mut out = Vec::new();
    m.on_apdu(a, now, &Nothing, &mut out);
    assert_eq!(
        sent(&out),
        vec![vector("phd_po_C2_config_response_unsupported")]
    );
    assert_eq!(m.state(), State::Configuring, "the agent may send another");
    // Other release reasons are answered with RLRE normal.
    for rlrq in [
        "phd_rlrq_no_more_configurations",
        "phd_rlrq_configuration_changed",
    ] {
        let mut m = manager(false, now);
        feed(&mut m, "phd_po_B1_aarq_ext4000", &Nothing, now);
        let out = feed(&mut m, rlrq, &Nothing, now);
        assert_eq!(sent(&out), vec![vector("phd_po_A6_rlre_normal")]);
    }
    // A second AARQ while operating: ABRT undefined.
    let mut m = manager(false, now);
    feed(&mut m, "phd_po_A1_aarq_std0190", &StandardOnly, now);
    let out = feed(&mut m, "phd_po_A1_aarq_std0190", &StandardOnly, now);
    assert_eq!(sent(&out), vec![vector("phd_abrt_undefined")]);
    assert!(out.contains(&Output::Violation(Violation::UnexpectedApdu)));
}

#[test]
fn an_unknown_handle_is_skipped_not_guessed() {
    let now = Instant::now();
    let mut m = manager(false, now);
    feed(&mut m, "phd_po_A1_aarq_std0190", &StandardOnly, now);
    // B5's 10-byte observations under 0x0190's SFLOAT-only map: Antidote's agent does this
    // (fact sheet §15.1); the trailing 8 bytes are a valid time stamp, so they are read.
    let out = feed(&mut m, "phd_po_B5_scan_fixed_ext4000", &StandardOnly, now);
    let (_, _, _, _, r) = report(&out);
    assert_eq!(r.observations.len(), 2);
    assert!(r.observations[0].time.is_some());
    // A 10-byte observation whose extra bytes are not a time, and an unknown handle: skipped.
    let mut bad = vector("phd_po_B5_scan_fixed_ext4000");
    bad[36] = 0xAB; // the first time stamp's century: not BCD
    bad[44] = 0; // second observation's handle 10 → 7 (not in the table)
    bad[45] = 7;
    let mut buf = BytesMut::from(&bad[..]);
    let a = decode_apdu(&mut buf, 65_539).unwrap().unwrap();
    let mut out = Vec::new();
    m.on_apdu(a, now, &StandardOnly, &mut out);
    let (_, _, _, _, r) = report(&out);
    assert!(r.observations.is_empty());
    assert_eq!(r.skipped.len(), 2);
    assert!(out.contains(&Output::Violation(Violation::SkippedObservations)));
}

proptest! {
    #[test]
    fn arbitrary_apdu_sequences_never_panic(frames in proptest::collection::vec(
        (prop_oneof![Just(0xE200u16), Just(0xE300), Just(0xE400), Just(0xE500), Just(0xE600), Just(0xE700)],
         proptest::collection::vec(any::<u8>(), 0..80)), 0..12)) {
        let now = Instant::now();
        let mut m = manager(true, now);
        let stored = Stored::default();
        for (choice, body) in frames {
            let mut b = BytesMut::new();
            b.extend_from_slice(&choice.to_be_bytes());
            b.extend_from_slice(&(body.len() as u16).to_be_bytes());
            b.extend_from_slice(&body);
            let mut out = Vec::new();
            match decode_apdu(&mut b, 65_539) {
                Ok(Some(a)) => m.on_apdu(a, now, &stored, &mut out),
                Ok(None) => {}
                Err(e) => m.on_decode_error(&e, now, &mut out),
            }
            if let Some(table) = m.table() {
                for o in &out {
                    if let Output::Report { report, .. } = o {
                        let _ = measurements(&[0; 8], table, report, 0.0, 0);
                    }
                }
            }
        }
    }

    #[test]
    fn scan_reports_with_arbitrary_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..200)) {
        for table in [0x0190u16, 0x02BC, 0x05DC, 0x06A4].map(|id| config::standard(id).unwrap()) {
            for layout in [sluice_proto::phd::scan::Layout::Fixed, sluice_proto::phd::scan::Layout::Var,
                           sluice_proto::phd::scan::Layout::MpFixed, sluice_proto::phd::scan::Layout::MpVar] {
                let _ = sluice_proto::phd::scan::decode(layout, Bytes::from(body.clone()), table);
            }
        }
        let _ = ObjectTable::decode_report(Bytes::from(body));
    }

    #[test]
    fn config_tables_round_trip(handles in proptest::collection::btree_set(1u16..200, 1..8)) {
        let objects = handles.iter().map(|&h| config::MetricObject {
            class: config::class::METRIC_NU, handle: h, kind: (2, 0x4BB8), unit: Some(0x0220),
            value_map: vec![(config::attr::NU_VAL_OBS_BASIC, 2), (config::attr::TIME_STAMP_ABS, 8)],
            components: vec![],
        }).collect();
        let table = ObjectTable { config_id: 0x4001, objects };
        let back = ObjectTable::decode_report(table.encode_report()).unwrap();
        prop_assert_eq!(back.check(), Ok(()));
        prop_assert_eq!(back, table);
    }
}
