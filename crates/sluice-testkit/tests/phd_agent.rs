//! `PhdAgent` and its encoders against the fact sheet's vectors (`phd_*.hex`): every APDU the
//! agent can send is pinned byte for byte where a vector exists, and over real TCP an in-test
//! manager that answers with the vectors' bytes sees exactly the vectors' sessions.

use std::time::Duration;

use sluice_testkit::phd::{
    aarq, aarq_with, abrt, bcd_time, config_report, mds_get_response, rlre, rlrq, scan_report,
    scan_report_fixed, scan_report_mp_fixed, scan_report_var, AarqFields, ReportHeader, ScanForm,
    VECTOR_SYSTEM_ID,
};
use sluice_testkit::{AgentSpec, Association, PhdAgent, PhdDevice, Reading};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const WAIT: Duration = Duration::from_secs(5);
/// 2007-12-06 12:10:00.00, the time stamp of vectors B5, D2, E1.
const VECTOR_TIME: [u8; 8] = [0x20, 0x07, 0x12, 0x06, 0x12, 0x10, 0x00, 0x00];
const OXIMETER_98_72: Reading = Reading::Oximeter {
    spo2: (98, 0),
    pulse: (72, 0),
};

fn vector(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/../sluice-proto/tests/vectors/{name}.hex",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.split_whitespace()
        .map(|byte| u8::from_str_radix(byte, 16).expect("hex byte"))
        .collect()
}

fn hex(text: &str) -> Vec<u8> {
    text.split_whitespace()
        .map(|byte| u8::from_str_radix(byte, 16).expect("hex byte"))
        .collect()
}

/// `bytes` with u16 fields at the given offsets replaced (length fields grown by an appended
/// element, an invoke id, a choice …).
fn patched(mut bytes: Vec<u8>, fields: &[(usize, u16)]) -> Vec<u8> {
    for &(at, value) in fields {
        bytes[at..at + 2].copy_from_slice(&value.to_be_bytes());
    }
    bytes
}

fn oximeter(config_id: u16) -> AgentSpec {
    AgentSpec {
        config_id,
        ..AgentSpec::new(PhdDevice::PulseOximeter)
    }
}

/// Vector A1's association fields: the default plus have-test-capability.
fn a1_fields() -> AarqFields {
    AarqFields {
        functional_units: 0x4000_0000,
        ..AarqFields::default()
    }
}

// ----- encoders ------------------------------------------------------------------------------

#[test]
fn aarq_reproduces_a1_for_0190_and_b1_for_extended_4000() {
    assert_eq!(
        aarq_with(&oximeter(0x0190), &a1_fields()),
        vector("phd_po_A1_aarq_std0190")
    );
    assert_eq!(
        aarq_with(&oximeter(0x4000), &a1_fields()),
        vector("phd_po_B1_aarq_ext4000")
    );
    // The default agent differs from A1 only in functional units (0, as Antidote's plain H211).
    assert_eq!(
        aarq(&oximeter(0x0190)),
        patched(vector("phd_po_A1_aarq_std0190"), &[(26, 0x0000)])
    );
    assert_eq!(
        AgentSpec::new(PhdDevice::PulseOximeter).system_id,
        VECTOR_SYSTEM_ID
    );
}

#[test]
fn antidote_aarq_is_mder_only_with_the_standard_config_id() {
    let spec = AgentSpec {
        config_id: 0x4000, // ignored: Antidote always announces the standard id
        ..AgentSpec::antidote(PhdDevice::WeighingScale)
    };
    let expected = patched(
        vector("phd_po_A1_aarq_std0190"),
        &[(20, 0x8000), (26, 0x0000), (44, 0x05DC)],
    );
    assert_eq!(aarq(&spec), expected);
}

#[test]
fn config_report_reproduces_c1_for_0190_and_b3_for_extended_4000() {
    assert_eq!(
        config_report(&oximeter(0x0190), 0x1237),
        vector("phd_po_C1_config_report_std0190")
    );
    assert_eq!(
        config_report(&oximeter(0x4000), 0x1237),
        vector("phd_po_B3_config_report_ext4000")
    );
}

/// D1 is Antidote's `0x05DC` table, which has handle 1 (body mass) only; ours adds handle 3
/// (BMI, MDC_RATIO_MASS_BODY_LEN_SQ, kg/m²). So the expectation is D1 with that 44-byte object
/// appended and every enclosing length grown by 44: handle 1 is D1's bytes exactly.
#[test]
fn scale_config_report_is_d1_plus_the_bmi_object() {
    let bmi_object = hex(
        "00 06 00 03 00 04 00 24 09 2f 00 04 00 02 e1 50 0a 46 00 02 f0 40 09 96 00 02 07 a0
         0a 55 00 0c 00 02 00 08 0a 56 00 04 09 90 00 08",
    );
    let mut expected = patched(
        vector("phd_ws_D1_config_report_std05dc"),
        &[
            (2, 0x44 + 44),
            (4, 0x42 + 44),
            (10, 0x3C + 44),
            (20, 0x32 + 44),
            (24, 2),
            (26, 0x2C + 44),
        ],
    );
    expected.extend_from_slice(&bmi_object);
    let spec = AgentSpec::new(PhdDevice::WeighingScale);
    assert_eq!(config_report(&spec, 0x1245), expected);
}

#[test]
fn blood_pressure_and_glucometer_config_reports_list_their_tables() {
    let bp = config_report(&AgentSpec::new(PhdDevice::BloodPressure), 0x0001);
    let expected_bp = hex(
        "e7 00 00 84 00 82 00 01 01 01 00 7c 00 00 ff ff ff ff 0d 1c 00 72
         02 bc 00 02 00 6c
         00 06 00 01 00 06 00 38
           09 2f 00 04 00 02 4a 04  0a 46 00 02 f0 40  0a 73 00 02 03 03
           0a 76 00 0a 00 03 00 06 4a 05 4a 06 4a 07  09 96 00 02 0f 20
           0a 55 00 0c 00 02 00 08 0a 75 00 0a 09 90 00 08
         00 06 00 02 00 04 00 24
           09 2f 00 04 00 02 48 2a  0a 46 00 02 f0 40  09 96 00 02 0a a0
           0a 55 00 0c 00 02 00 08 0a 4c 00 02 09 90 00 08",
    );
    assert_eq!(bp, expected_bp);
    let glucose = config_report(&AgentSpec::new(PhdDevice::Glucometer), 0x0002);
    let expected_glucose = hex(
        "e7 00 00 44 00 42 00 02 01 01 00 3c 00 00 ff ff ff ff 0d 1c 00 32
         06 a4 00 01 00 2c
         00 06 00 01 00 04 00 24
           09 2f 00 04 00 02 71 b8  0a 46 00 02 f0 40  09 96 00 02 08 52
           0a 55 00 0c 00 02 00 08 0a 4c 00 02 09 90 00 08",
    );
    assert_eq!(glucose, expected_glucose);
}

#[test]
fn scan_report_fixed_reproduces_a3_and_b5() {
    assert_eq!(
        scan_report_fixed(&oximeter(0x0190), 0x1236, 0, &OXIMETER_98_72, VECTOR_TIME),
        vector("phd_po_A3_scan_fixed_std0190")
    );
    assert_eq!(
        scan_report_fixed(&oximeter(0x4000), 0x1238, 0, &OXIMETER_98_72, VECTOR_TIME),
        vector("phd_po_B5_scan_fixed_ext4000")
    );
}

#[test]
fn scan_report_fixed_reproduces_e1_blood_pressure() {
    let spec = AgentSpec::new(PhdDevice::BloodPressure);
    let reading = Reading::BloodPressure {
        systolic: (120, 0),
        diastolic: (80, 0),
        mean: (100, 0),
        pulse: (600, -1),
    };
    let header = ReportHeader {
        event_time: 0x0049_0050, // as in Antidote's H241_ID_02BC
        ..ReportHeader::new(0x0054, 0)
    };
    let e1 = vector("phd_bp_E1_scan_fixed_std02bc");
    assert_eq!(
        scan_report(&spec, ScanForm::Fixed, &header, &reading, VECTOR_TIME),
        e1
    );
    // The default header differs only in the event-time (0xFFFFFFFF = not used).
    assert_eq!(
        scan_report_fixed(&spec, 0x0054, 0, &reading, VECTOR_TIME),
        patched(e1, &[(14, 0xFFFF), (16, 0xFFFF)])
    );
}

/// D2 reports body mass (handle 1) only; our scale also reports BMI (handle 3), 16 more bytes.
#[test]
fn scale_scan_report_is_d2_plus_the_bmi_observation() {
    let reading = Reading::Scale {
        mass_kg: (762, -1),
        bmi: (243, -1),
    };
    let mut expected = patched(
        vector("phd_ws_D2_scan_fixed_std05dc"),
        &[
            (2, 0x2A + 16),
            (4, 0x28 + 16),
            (10, 0x22 + 16),
            (20, 0x18 + 16),
            (26, 2),
            (28, 0x10 + 16),
        ],
    );
    expected.extend_from_slice(&hex("00 03 00 0c ff 00 00 f3 20 07 12 06 12 10 00 00"));
    let spec = AgentSpec::new(PhdDevice::WeighingScale);
    assert_eq!(
        scan_report_fixed(&spec, 0x1246, 0, &reading, VECTOR_TIME),
        expected
    );
}

#[test]
fn unconfirmed_spec_sends_roiv_event_report_0100() {
    let spec = AgentSpec {
        confirmed: false,
        ..oximeter(0x0190)
    };
    assert_eq!(
        scan_report_fixed(&spec, 0x1236, 0, &OXIMETER_98_72, VECTOR_TIME),
        patched(vector("phd_po_A3_scan_fixed_std0190"), &[(8, 0x0100)])
    );
}

#[test]
fn variable_and_multi_person_reports_carry_the_same_values() {
    let spec = oximeter(0x0190);
    let var = hex(
        "e7 00 00 32 00 30 12 36 01 01 00 2a 00 00 ff ff ff ff 0d 1e 00 20
         f0 00 00 00 00 02 00 18
         00 01 00 01 00 06 0a 4c 00 02 00 62
         00 0a 00 01 00 06 0a 4c 00 02 00 48",
    );
    assert_eq!(
        scan_report_var(&spec, 0x1236, 0, &OXIMETER_98_72, VECTOR_TIME),
        var
    );
    // MP-fixed = A3's observations under one person id.
    let mp = hex(
        "e7 00 00 2c 00 2a 12 36 01 01 00 24 00 00 ff ff ff ff 0d 1f 00 1a
         f0 00 00 00 00 01 00 12 00 07
         00 02 00 0c 00 01 00 02 00 62 00 0a 00 02 00 48",
    );
    assert_eq!(
        scan_report_mp_fixed(&spec, 0x1236, 0, 7, &OXIMETER_98_72, VECTOR_TIME),
        mp
    );
    // Time-stamped value maps put the time stamp in the var form as an AVA too.
    let glucose = AgentSpec::new(PhdDevice::Glucometer);
    let var_glucose = hex(
        "e7 00 00 32 00 30 00 09 01 01 00 2a 00 00 ff ff ff ff 0d 1e 00 20
         f0 00 00 03 00 01 00 18
         00 01 00 02 00 12 0a 4c 00 02 00 69 09 90 00 08 20 07 12 06 12 10 00 00",
    );
    let reading = Reading::Glucose { mg_dl: (105, 0) };
    assert_eq!(
        scan_report_var(&glucose, 0x0009, 3, &reading, VECTOR_TIME),
        var_glucose
    );
}

#[test]
fn antidote_quirks_shape_the_scan_reports() {
    // Oximeter: unconfirmed, invoke 0x1111 (set by the agent), SFLOAT + time stamp even under
    // 0x0190 — B5's bytes with that invoke id and choice.
    let oxi = AgentSpec::antidote(PhdDevice::PulseOximeter);
    assert_eq!(
        scan_report_fixed(&oxi, 0x1111, 0, &OXIMETER_98_72, VECTOR_TIME),
        patched(
            vector("phd_po_B5_scan_fixed_ext4000"),
            &[(6, 0x1111), (8, 0x0100)]
        )
    );
    // Glucometer: two zero bytes after the scan report, counted by every enclosing length.
    let glucometer = AgentSpec::antidote(PhdDevice::Glucometer);
    let reading = Reading::Glucose { mg_dl: (105, 0) };
    let expected = hex(
        "e7 00 00 2a 00 28 00 05 01 01 00 22 00 00 ff ff ff ff 0d 1d 00 18
         f0 00 00 00 00 01 00 0e 00 01 00 0a 00 69 20 07 12 06 12 10 00 00
         00 00",
    );
    assert_eq!(
        scan_report_fixed(&glucometer, 0x0005, 0, &reading, VECTOR_TIME),
        expected
    );
    // Scale: confirmed even when the spec says otherwise; mass, BMI, mass, BMI.
    let scale = AgentSpec {
        confirmed: false,
        ..AgentSpec::antidote(PhdDevice::WeighingScale)
    };
    let reading = Reading::Scale {
        mass_kg: (762, -1),
        bmi: (243, -1),
    };
    let report = scan_report_fixed(&scale, 0x0006, 0, &reading, VECTOR_TIME);
    assert_eq!(report.len(), 30 + 4 * 16);
    assert_eq!(report[8..10], [0x01, 0x01], "confirmed");
    assert_eq!(
        report[26..30],
        [0x00, 0x04, 0x00, 0x40],
        "4 observations, 64 bytes"
    );
    let handles: Vec<u16> = (0..4)
        .map(|i| u16::from_be_bytes([report[30 + 16 * i], report[31 + 16 * i]]))
        .collect();
    assert_eq!(handles, [1, 3, 1, 3]);
    assert_eq!(report[34..38], [0xFF, 0x00, 0x02, 0xFA], "76.2 kg");
    assert_eq!(report[50..54], [0xFF, 0x00, 0x00, 0xF3], "24.3 kg/m²");
}

#[test]
fn release_and_abort_apdus_match_their_vectors() {
    assert_eq!(rlrq(0), vector("phd_po_A5_rlrq_normal"));
    assert_eq!(rlrq(1), vector("phd_rlrq_no_more_configurations"));
    assert_eq!(rlrq(2), vector("phd_rlrq_configuration_changed"));
    assert_eq!(rlre(0), vector("phd_po_A6_rlre_normal"));
    assert_eq!(abrt(0), vector("phd_abrt_undefined"));
    assert_eq!(abrt(1), vector("phd_abrt_buffer_overflow"));
    assert_eq!(abrt(2), vector("phd_abrt_response_timeout"));
    assert_eq!(abrt(3), vector("phd_abrt_configuration_timeout"));
}

#[test]
fn mds_get_response_reproduces_c5() {
    let clock = bcd_time(2007, 2, 1, 12, 5, 0, 0);
    assert_eq!(
        mds_get_response(&oximeter(0x0190), 0x3456, clock),
        vector("phd_po_C5_get_mds_response")
    );
}

#[test]
fn bcd_time_writes_two_digits_per_byte() {
    assert_eq!(bcd_time(2007, 12, 6, 12, 10, 0, 0), VECTOR_TIME);
    assert_eq!(
        bcd_time(1999, 1, 31, 23, 59, 58, 99),
        [0x19, 0x99, 0x01, 0x31, 0x23, 0x59, 0x58, 0x99]
    );
}

#[test]
fn readings_that_do_not_fit_their_fields_are_rejected() {
    assert!(OXIMETER_98_72.check().is_ok());
    assert!(Reading::Oximeter {
        spo2: (2048, 0),
        pulse: (72, 0)
    }
    .check()
    .is_err());
    assert!(Reading::Glucose { mg_dl: (100, 8) }.check().is_err());
    assert!(Reading::Glucose { mg_dl: (-2048, -8) }.check().is_ok());
    assert!(Reading::Scale {
        mass_kg: (8_388_608, -1),
        bmi: (1, 0)
    }
    .check()
    .is_err());
    assert!(Reading::Scale {
        mass_kg: (-8_388_608, -128),
        bmi: (1, 127)
    }
    .check()
    .is_ok());
}

// ----- over TCP against an in-test manager ---------------------------------------------------

/// Read one whole APDU (header + body) or panic.
async fn read_apdu(stream: &mut TcpStream) -> Vec<u8> {
    let mut apdu = vec![0u8; 4];
    stream.read_exact(&mut apdu).await.expect("APDU header");
    let len = usize::from(u16::from_be_bytes([apdu[2], apdu[3]]));
    apdu.resize(4 + len, 0);
    stream.read_exact(&mut apdu[4..]).await.expect("APDU body");
    apdu
}

async fn manager() -> (TcpListener, std::net::SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    (listener, addr)
}

/// Vector C5 with the Dev-Configuration-Id attribute (`0A 44 00 02 xx xx`) set to `config_id`.
fn c5_with_config(config_id: u16) -> Vec<u8> {
    let mut c5 = vector("phd_po_C5_get_mds_response");
    let at = c5
        .windows(4)
        .position(|w| w == [0x0A, 0x44, 0x00, 0x02])
        .expect("C5 has Dev-Configuration-Id")
        + 4;
    c5[at..at + 2].copy_from_slice(&config_id.to_be_bytes());
    c5
}

/// Session B of the fact sheet, byte for byte in both directions: AARQ → accepted-unknown-config
/// (sent in two pieces) → config report → accepted → scan report → a GET from the manager,
/// answered while the agent waits for the confirmation, and the confirmation (both in one
/// write) → RLRQ → RLRE.
#[tokio::test]
async fn session_b_over_tcp_matches_the_vectors_and_answers_a_get() {
    let (listener, addr) = manager().await;
    let manager = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        assert_eq!(read_apdu(&mut s).await, vector("phd_po_B1_aarq_ext4000"));
        let b2 = vector("phd_po_B2_aare_accepted_unknown_config");
        s.write_all(&b2[..3]).await.unwrap();
        s.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        s.write_all(&b2[3..]).await.unwrap();
        assert_eq!(
            read_apdu(&mut s).await,
            vector("phd_po_B3_config_report_ext4000")
        );
        s.write_all(&vector("phd_po_B4_config_response_accepted"))
            .await
            .unwrap();
        assert_eq!(
            read_apdu(&mut s).await,
            vector("phd_po_B5_scan_fixed_ext4000")
        );
        // GET and confirmation in one write: the agent answers the first, then takes the second.
        let mut both = vector("phd_po_C4_get_mds_request");
        both.extend_from_slice(&vector("phd_po_B6_scan_fixed_confirm"));
        s.write_all(&both).await.unwrap();
        assert_eq!(read_apdu(&mut s).await, c5_with_config(0x4000));
        assert_eq!(read_apdu(&mut s).await, vector("phd_po_B7_rlrq_normal"));
        s.write_all(&vector("phd_po_B8_rlre_normal")).await.unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "nothing after RLRQ: {rest:02x?}");
    });

    let mut agent = PhdAgent::connect(addr, oximeter(0x4000))
        .await
        .expect("connect");
    agent.set_aarq_fields(a1_fields());
    agent.set_next_invoke_id(0x1237);
    let association = agent.associate().await.expect("associate");
    assert_eq!(
        association,
        Association {
            aare_result: 3,
            config_result: Some(0)
        }
    );
    let took = agent
        .report(&OXIMETER_98_72, VECTOR_TIME, WAIT)
        .await
        .expect("report confirmed");
    assert!(
        took.is_some_and(|d| d < WAIT),
        "confirmed within the timeout: {took:?}"
    );
    assert_eq!(agent.gets_answered(), 1);
    assert_eq!(agent.confirmations_received(), 1);
    assert_eq!(agent.release().await.expect("release"), 0);
    drop(agent);
    manager.await.expect("manager saw session B");
}

/// Session A with Antidote's oximeter: standard id announced although an extended one is set,
/// AARE accepted, two unconfirmed reports with invoke-id 0x1111 and counting report numbers,
/// and a GET during the release answered with C5.
#[tokio::test]
async fn antidote_oximeter_session_sends_unconfirmed_reports_with_invoke_1111() {
    let (listener, addr) = manager().await;
    let manager = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        let aarq = read_apdu(&mut s).await;
        assert_eq!(aarq[44..46], [0x01, 0x90], "standard config id");
        assert_eq!(aarq[20..22], [0x80, 0x00], "MDER only");
        s.write_all(&vector("phd_po_A2_aare_accepted"))
            .await
            .unwrap();
        let b5_unconfirmed = patched(
            vector("phd_po_B5_scan_fixed_ext4000"),
            &[(6, 0x1111), (8, 0x0100)],
        );
        assert_eq!(read_apdu(&mut s).await, b5_unconfirmed);
        assert_eq!(
            read_apdu(&mut s).await,
            patched(b5_unconfirmed, &[(24, 1)]),
            "report no 1"
        );
        assert_eq!(read_apdu(&mut s).await, vector("phd_po_A5_rlrq_normal"));
        s.write_all(&vector("phd_po_C4_get_mds_request"))
            .await
            .unwrap();
        assert_eq!(
            read_apdu(&mut s).await,
            vector("phd_po_C5_get_mds_response")
        );
        s.write_all(&vector("phd_po_A6_rlre_normal")).await.unwrap();
    });

    let spec = AgentSpec {
        config_id: 0x4000,
        ..AgentSpec::antidote(PhdDevice::PulseOximeter)
    };
    let mut agent = PhdAgent::connect(addr, spec).await.expect("connect");
    let association = agent.associate().await.expect("associate");
    assert_eq!(
        association,
        Association {
            aare_result: 0,
            config_result: None
        }
    );
    for _ in 0..2 {
        let took = agent
            .report(&OXIMETER_98_72, VECTOR_TIME, WAIT)
            .await
            .expect("report");
        assert_eq!(took, None, "unconfirmed");
    }
    assert_eq!(agent.release().await.expect("release"), 0);
    assert_eq!(agent.gets_answered(), 1);
    assert_eq!(agent.confirmations_received(), 0);
    assert_eq!(agent.reports_sent(), 2);
    manager.await.expect("manager saw the Antidote session");
}

/// No confirmation in time: the agent aborts with response-timeout and fails; an unrelated
/// APDU that arrived meanwhile is still there for `read_apdu`, and then EOF reads as `None`.
#[tokio::test]
async fn missing_confirmation_fails_the_report_and_aborts() {
    let (listener, addr) = manager().await;
    let manager = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        read_apdu(&mut s).await;
        s.write_all(&vector("phd_po_A2_aare_accepted"))
            .await
            .unwrap();
        let report = read_apdu(&mut s).await;
        assert_eq!(report[8..10], [0x01, 0x01], "confirmed report");
        // A confirmation for another invoke id does not count.
        s.write_all(&vector("phd_po_A4_scan_fixed_confirm"))
            .await
            .unwrap();
        assert_eq!(read_apdu(&mut s).await, vector("phd_abrt_response_timeout"));
    });

    let mut agent = PhdAgent::connect(addr, AgentSpec::new(PhdDevice::BloodPressure))
        .await
        .expect("connect");
    agent.associate().await.expect("associate");
    let reading = Reading::BloodPressure {
        systolic: (120, 0),
        diastolic: (80, 0),
        mean: (100, 0),
        pulse: (60, 0),
    };
    let err = agent
        .report(&reading, VECTOR_TIME, Duration::from_millis(300))
        .await
        .expect_err("no confirmation");
    assert!(
        format!("{err:#}").contains("no scan report confirmation"),
        "{err:#}"
    );
    manager.await.expect("manager saw the ABRT");
    assert_eq!(
        agent.read_apdu(WAIT).await.expect("kept APDU"),
        Some(vector("phd_po_A4_scan_fixed_confirm"))
    );
    assert_eq!(agent.read_apdu(WAIT).await.expect("EOF"), None);
    assert_eq!(agent.confirmations_received(), 0);
}

/// Antidote's glucometer (like its other confirmed devices) waits 3 s at most (whatever the caller allows), then
/// aborts with reason undefined as Antidote does.
#[tokio::test]
async fn antidote_agent_gives_up_on_a_confirmation_after_3_s() {
    let (listener, addr) = manager().await;
    let manager = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        read_apdu(&mut s).await;
        s.write_all(&vector("phd_po_A2_aare_accepted"))
            .await
            .unwrap();
        read_apdu(&mut s).await;
        assert_eq!(read_apdu(&mut s).await, vector("phd_abrt_undefined"));
    });
    let mut agent = PhdAgent::connect(addr, AgentSpec::antidote(PhdDevice::Glucometer))
        .await
        .expect("connect");
    agent.associate().await.expect("associate");
    let started = std::time::Instant::now();
    let result = agent
        .report(
            &Reading::Glucose { mg_dl: (105, 0) },
            VECTOR_TIME,
            Duration::from_secs(30),
        )
        .await;
    assert!(result.is_err(), "{result:?}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(3) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    manager.await.expect("manager saw the ABRT");
}

/// A manager's ABRT ends the wait at once with an error that says so; an RLRQ is answered.
#[tokio::test]
async fn manager_abort_and_release_end_the_wait() {
    let (listener, addr) = manager().await;
    let manager = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        read_apdu(&mut s).await;
        s.write_all(&vector("phd_po_B2_aare_accepted_unknown_config"))
            .await
            .unwrap();
        read_apdu(&mut s).await; // config report
        s.write_all(&vector("phd_abrt_configuration_timeout"))
            .await
            .unwrap();
        // The test re-associates on the same connection; this time the manager releases.
        read_apdu(&mut s).await;
        s.write_all(&vector("phd_po_A2_aare_accepted"))
            .await
            .unwrap();
        read_apdu(&mut s).await; // confirmed scan report
        s.write_all(&vector("phd_rlrq_configuration_changed"))
            .await
            .unwrap();
        assert_eq!(read_apdu(&mut s).await, vector("phd_po_A6_rlre_normal"));
    });
    let mut agent = PhdAgent::connect(addr, AgentSpec::new(PhdDevice::WeighingScale))
        .await
        .expect("connect");
    let err = agent.associate().await.expect_err("aborted");
    assert!(
        format!("{err:#}").contains("ABRT reason Some(3)"),
        "{err:#}"
    );
    agent.associate().await.expect("associate again");
    let reading = Reading::Scale {
        mass_kg: (762, -1),
        bmi: (243, -1),
    };
    let err = agent
        .report(&reading, VECTOR_TIME, WAIT)
        .await
        .expect_err("released");
    assert!(
        format!("{err:#}").contains("RLRQ reason Some(2)"),
        "{err:#}"
    );
    manager.await.expect("manager got its RLRE");
}

/// A GET with an attribute-id list gets just those MDS attributes; a GET on another handle gets
/// ROER no-such-object-instance (not counted as answered); both are consumed by `read_apdu`,
/// which returns the manager's RLRQ unanswered.
#[tokio::test]
async fn gets_are_answered_by_attribute_list_and_handle() {
    let (listener, addr) = manager().await;
    let manager = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        read_apdu(&mut s).await;
        s.write_all(&vector("phd_po_A2_aare_accepted"))
            .await
            .unwrap();
        s.write_all(&hex(
            "e7 00 00 12 00 10 00 07 01 03 00 0a 00 00 00 02 00 04 09 84 0a 44",
        ))
        .await
        .unwrap();
        let system_id_and_config = hex("e7 00 00 22 00 20 00 07 02 03 00 1a 00 00 00 02 00 14
             09 84 00 0a 00 08 11 22 33 44 55 66 77 04 0a 44 00 02 01 90");
        assert_eq!(read_apdu(&mut s).await, system_id_and_config);
        s.write_all(&hex(
            "e7 00 00 0e 00 0c 00 08 01 03 00 06 00 05 00 00 00 00",
        ))
        .await
        .unwrap();
        let roer = hex("e7 00 00 0c 00 0a 00 08 03 00 00 04 00 01 00 00");
        assert_eq!(read_apdu(&mut s).await, roer);
        s.write_all(&vector("phd_po_A5_rlrq_normal")).await.unwrap();
        assert_eq!(read_apdu(&mut s).await, vector("phd_po_A6_rlre_normal"));
    });
    let mut agent = PhdAgent::connect(addr, oximeter(0x0190))
        .await
        .expect("connect");
    agent.associate().await.expect("associate");
    assert_eq!(
        agent.read_apdu(WAIT).await.expect("RLRQ"),
        Some(vector("phd_po_A5_rlrq_normal"))
    );
    assert_eq!(agent.gets_answered(), 1);
    agent.send_raw(&rlre(0)).await.expect("RLRE");
    manager.await.expect("manager saw both answers");
}

/// Malformed APDUs from the manager never panic the agent: a PRST too short for a Data APDU is
/// kept for `read_apdu`, an AARE without a result fails `associate`, and EOF inside an APDU
/// is an error.
#[tokio::test]
async fn malformed_manager_apdus_become_errors() {
    let (listener, addr) = manager().await;
    let manager = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        read_apdu(&mut s).await;
        s.write_all(&hex("e7 00 00 03 00 01 12  e3 00 00 01 00  e6 00 00 04 00"))
            .await
            .unwrap();
    });
    let mut agent = PhdAgent::connect(addr, oximeter(0x0190))
        .await
        .expect("connect");
    let err = agent.associate().await.expect_err("AARE without a result");
    assert!(format!("{err:#}").contains("without a result"), "{err:#}");
    assert_eq!(
        agent.read_apdu(WAIT).await.expect("short PRST"),
        Some(hex("e7 00 00 03 00 01 12"))
    );
    manager.await.expect("manager wrote");
    let err = agent.read_apdu(WAIT).await.expect_err("EOF inside an APDU");
    assert!(format!("{err:#}").contains("inside an APDU"), "{err:#}");
}
