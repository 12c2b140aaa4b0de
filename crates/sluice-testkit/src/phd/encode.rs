//! The pure APDU encoders (what an agent sends), usable without a socket.

use super::*;

// ---------------------------------------------------------------------------------------------
// Pure encoders.

/// AARQ of `spec` with [`AarqFields::for_spec`].
pub fn aarq(spec: &AgentSpec) -> Vec<u8> {
    aarq_with(spec, &AarqFields::for_spec(spec))
}

/// AARQ of `spec` (system id, effective config id) with `fields` as given.
pub fn aarq_with(spec: &AgentSpec, fields: &AarqFields) -> Vec<u8> {
    let mut w = Mder::new();
    w.u16(apdu::AARQ);
    w.with_len(|w| {
        w.u32(fields.assoc_version);
        w.seq(1, |w| {
            w.u16(DATA_PROTO_ID_20601);
            w.with_len(|w| {
                w.u32(fields.protocol_version);
                w.u16(fields.encoding_rules);
                w.u32(fields.nomenclature_version);
                w.u32(fields.functional_units);
                w.u32(fields.system_type);
                w.octets(&spec.system_id);
                w.u16(spec.effective_config_id());
                w.u16(fields.data_req_mode_flags);
                w.u8(fields.data_req_init_agent_count);
                w.u8(fields.data_req_init_manager_count);
                w.seq(0, |_| {}); // option-list
            });
        });
    });
    w.finish()
}

/// The config report (MDC_NOTI_CONFIG, confirmed, obj-handle 0): report id = the effective
/// config id, the device's object table (see the module documentation).
pub fn config_report(spec: &AgentSpec, invoke_id: u16) -> Vec<u8> {
    let objects = object_table(spec);
    prst(invoke_id, data_choice::ROIV_CONFIRMED_EVENT_REPORT, |w| {
        event_report_body(w, EVENT_TIME_UNUSED, event_type::CONFIG, |w| {
            w.u16(spec.effective_config_id());
            w.seq(objects.len(), |w| {
                for object in &objects {
                    w.u16(MOC_VMO_METRIC_NU);
                    w.u16(object.handle);
                    w.seq(object.attributes.len(), |w| {
                        for (id, value) in &object.attributes {
                            w.u16(*id);
                            w.octets(value);
                        }
                    });
                }
            });
        });
    })
}

/// One fixed-format scan report with default header fields (event-time `0xFFFFFFFF`,
/// agent-initiated), confirmed or not per [`AgentSpec::sends_confirmed`].
///
/// # Panics
/// If a value of `reading` does not fit its field ([`Reading::check`]).
pub fn scan_report_fixed(
    spec: &AgentSpec,
    invoke_id: u16,
    report_no: u16,
    reading: &Reading,
    time: [u8; 8],
) -> Vec<u8> {
    scan_report(
        spec,
        ScanForm::Fixed,
        &ReportHeader::new(invoke_id, report_no),
        reading,
        time,
    )
}

/// [`scan_report_fixed`] in the variable format.
///
/// # Panics
/// If a value of `reading` does not fit its field ([`Reading::check`]).
pub fn scan_report_var(
    spec: &AgentSpec,
    invoke_id: u16,
    report_no: u16,
    reading: &Reading,
    time: [u8; 8],
) -> Vec<u8> {
    scan_report(
        spec,
        ScanForm::Var,
        &ReportHeader::new(invoke_id, report_no),
        reading,
        time,
    )
}

/// [`scan_report_fixed`] in the multi-person fixed format, for `person_id`.
///
/// # Panics
/// If a value of `reading` does not fit its field ([`Reading::check`]).
pub fn scan_report_mp_fixed(
    spec: &AgentSpec,
    invoke_id: u16,
    report_no: u16,
    person_id: u16,
    reading: &Reading,
    time: [u8; 8],
) -> Vec<u8> {
    scan_report(
        spec,
        ScanForm::MpFixed { person_id },
        &ReportHeader::new(invoke_id, report_no),
        reading,
        time,
    )
}

/// Any scan report. The reading decides the handles and their layout (a reading of another
/// device than `spec.device` is encoded anyway — handy for negative tests); `spec` decides
/// confirmed or not, the oximeter's time stamps, and the quirks.
///
/// # Panics
/// If a value of `reading` does not fit its field ([`Reading::check`]).
pub fn scan_report(
    spec: &AgentSpec,
    form: ScanForm,
    header: &ReportHeader,
    reading: &Reading,
    time: [u8; 8],
) -> Vec<u8> {
    if let Err(e) = reading.check() {
        panic!("scan_report: {e}");
    }
    let observations = observations(spec, reading, time);
    let choice = if spec.sends_confirmed() {
        data_choice::ROIV_CONFIRMED_EVENT_REPORT
    } else {
        data_choice::ROIV_EVENT_REPORT
    };
    let event = match form {
        ScanForm::Fixed => event_type::SCAN_REPORT_FIXED,
        ScanForm::Var => event_type::SCAN_REPORT_VAR,
        ScanForm::MpFixed { .. } => event_type::SCAN_REPORT_MP_FIXED,
    };
    let fixed = |w: &mut Mder| {
        w.seq(observations.len(), |w| {
            for obs in &observations {
                w.u16(obs.handle);
                w.with_len(|w| {
                    for (_, value) in &obs.attributes {
                        w.bytes(value);
                    }
                });
            }
        });
    };
    prst(header.invoke_id, choice, |w| {
        event_report_body(w, header.event_time, event, |w| {
            w.u16(header.data_req_id);
            w.u16(header.report_no);
            match form {
                ScanForm::Fixed => fixed(w),
                ScanForm::Var => w.seq(observations.len(), |w| {
                    for obs in &observations {
                        w.u16(obs.handle);
                        w.seq(obs.attributes.len(), |w| {
                            for (id, value) in &obs.attributes {
                                w.u16(*id);
                                w.octets(value);
                            }
                        });
                    }
                }),
                ScanForm::MpFixed { person_id } => w.seq(1, |w| {
                    w.u16(person_id);
                    fixed(w);
                }),
            }
            if spec.antidote_quirks && spec.device == PhdDevice::Glucometer {
                w.bytes(&[0, 0]);
            }
        });
    })
}

/// GET response (rors-cmip-get, handle 0) with all MDS attributes; for the oximeter with the
/// vectors' system id, config `0x0190` and `clock` 2007-02-01 12:05 this is vector C5.
pub fn mds_get_response(spec: &AgentSpec, invoke_id: u16, clock: [u8; 8]) -> Vec<u8> {
    mds_get_response_filtered(spec, invoke_id, &[], clock)
}

/// [`mds_get_response`] limited to the attribute ids in `ids` (empty = all).
pub fn mds_get_response_filtered(
    spec: &AgentSpec,
    invoke_id: u16,
    ids: &[u16],
    clock: [u8; 8],
) -> Vec<u8> {
    let attributes: Vec<(u16, Vec<u8>)> = mds_attributes(spec, clock)
        .into_iter()
        .filter(|(id, _)| ids.is_empty() || ids.contains(id))
        .collect();
    prst(invoke_id, data_choice::RORS_GET, |w| {
        w.u16(0); // obj-handle: the MDS
        w.seq(attributes.len(), |w| {
            for (id, value) in &attributes {
                w.u16(*id);
                w.octets(value);
            }
        });
    })
}

/// RLRQ with `reason`.
pub fn rlrq(reason: u16) -> Vec<u8> {
    short_apdu(apdu::RLRQ, reason)
}

/// RLRE with `reason`.
pub fn rlre(reason: u16) -> Vec<u8> {
    short_apdu(apdu::RLRE, reason)
}

/// ABRT with `reason`.
pub fn abrt(reason: u16) -> Vec<u8> {
    short_apdu(apdu::ABRT, reason)
}

/// ROER with `error_value` and an empty parameter.
pub(super) fn roer(invoke_id: u16, error_value: u16) -> Vec<u8> {
    prst(invoke_id, data_choice::ROER, |w| {
        w.u16(error_value);
        w.u16(0);
    })
}

pub(super) fn short_apdu(tag: u16, reason: u16) -> Vec<u8> {
    let mut w = Mder::new();
    w.u16(tag);
    w.with_len(|w| w.u16(reason));
    w.finish()
}

/// PRST around a Data APDU: `E7 00 | L | L-2 | invoke-id | choice | length | message`.
pub(super) fn prst(invoke_id: u16, choice: u16, message: impl FnOnce(&mut Mder)) -> Vec<u8> {
    let mut w = Mder::new();
    w.u16(apdu::PRST);
    w.with_len(|w| {
        w.with_len(|w| {
            w.u16(invoke_id);
            w.u16(choice);
            w.with_len(message);
        });
    });
    w.finish()
}

/// EventReportArgumentSimple on the MDS (obj-handle 0).
pub(super) fn event_report_body(
    w: &mut Mder,
    event_time: u32,
    event: u16,
    info: impl FnOnce(&mut Mder),
) {
    w.u16(0);
    w.u32(event_time);
    w.u16(event);
    w.with_len(info);
}

/// One configuration object: handle and its attributes in wire order.
pub(super) struct ConfigObject {
    handle: u16,
    attributes: Vec<(u16, Vec<u8>)>,
}

pub(super) fn be(values: &[u16]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_be_bytes()).collect()
}

/// A SEQUENCE OF u16 pairs / u16 values as an attribute value: count · length · items.
pub(super) fn seq_value(count: usize, items: &[u16]) -> Vec<u8> {
    let mut w = Mder::new();
    w.seq(count, |w| {
        for item in items {
            w.u16(*item);
        }
    });
    w.finish()
}

/// Metric-Spec-Small of the oximeter (`0x4040`) and of the other devices (`0xF040`).
pub(super) fn numeric(
    handle: u16,
    code: u16,
    spec_small: u16,
    unit: u16,
    value_map: &[(u16, u16)],
) -> ConfigObject {
    let map: Vec<u16> = value_map.iter().flat_map(|(id, len)| [*id, *len]).collect();
    ConfigObject {
        handle,
        attributes: vec![
            (ATTR_ID_TYPE, be(&[PART_SCADA, code])),
            (ATTR_METRIC_SPEC_SMALL, be(&[spec_small])),
            (ATTR_UNIT_CODE, be(&[unit])),
            (ATTR_ATTRIBUTE_VAL_MAP, seq_value(value_map.len(), &map)),
        ],
    }
}

pub(super) fn object_table(spec: &AgentSpec) -> Vec<ConfigObject> {
    const SFLOAT: (u16, u16) = (ATTR_NU_VAL_OBS_BASIC, 2);
    const FLOAT: (u16, u16) = (ATTR_NU_VAL_OBS_SIMP, 4);
    const TIME: (u16, u16) = (ATTR_TIME_STAMP_ABS, 8);
    match spec.device {
        PhdDevice::PulseOximeter => {
            // Under 0x0190 Antidote's table (C1), also with quirks; extended: B3.
            let map: &[(u16, u16)] = if spec.effective_config_id() == 0x0190 {
                &[SFLOAT]
            } else {
                &[SFLOAT, TIME]
            };
            vec![
                numeric(1, 0x4BB8, 0x4040, 0x0220, map),
                numeric(10, 0x481A, 0x4040, 0x0AA0, map),
            ]
        }
        PhdDevice::BloodPressure => {
            let mut nibp = numeric(
                1,
                0x4A04,
                0xF040,
                0x0F20,
                &[(ATTR_NU_CMPD_VAL_OBS_BASIC, 10), TIME],
            );
            nibp.attributes
                .insert(2, (ATTR_METRIC_STRUCT_SMALL, be(&[0x0303])));
            nibp.attributes.insert(
                3,
                (ATTR_ID_PHYSIO_LIST, seq_value(3, &[0x4A05, 0x4A06, 0x4A07])),
            );
            vec![nibp, numeric(2, 0x482A, 0xF040, 0x0AA0, &[SFLOAT, TIME])]
        }
        PhdDevice::WeighingScale => vec![
            numeric(1, 0xE140, 0xF040, 0x06C3, &[FLOAT, TIME]),
            numeric(3, 0xE150, 0xF040, 0x07A0, &[FLOAT, TIME]),
        ],
        PhdDevice::Glucometer => vec![numeric(1, 0x71B8, 0xF040, 0x0852, &[SFLOAT, TIME])],
    }
}

/// One observation: handle and its value-map attributes (id, encoded value) in order.
pub(super) struct Observation {
    handle: u16,
    attributes: Vec<(u16, Vec<u8>)>,
}

pub(super) fn observations(spec: &AgentSpec, reading: &Reading, time: [u8; 8]) -> Vec<Observation> {
    let sf = |v: (i32, i8)| (ATTR_NU_VAL_OBS_BASIC, sfloat(v).to_be_bytes().to_vec());
    let fl = |v: (i32, i8)| (ATTR_NU_VAL_OBS_SIMP, float(v).to_be_bytes().to_vec());
    let ts = (ATTR_TIME_STAMP_ABS, time.to_vec());
    let obs = |handle: u16, attributes: Vec<(u16, Vec<u8>)>| Observation { handle, attributes };
    match *reading {
        Reading::Oximeter { spo2, pulse } => {
            let with_time = |v| {
                let mut attributes = vec![sf(v)];
                if spec.oximeter_time_stamped() {
                    attributes.push(ts.clone());
                }
                attributes
            };
            vec![obs(1, with_time(spo2)), obs(10, with_time(pulse))]
        }
        Reading::BloodPressure {
            systolic,
            diastolic,
            mean,
            pulse,
        } => {
            let compound = seq_value(3, &[sfloat(systolic), sfloat(diastolic), sfloat(mean)]);
            vec![
                obs(1, vec![(ATTR_NU_CMPD_VAL_OBS_BASIC, compound), ts.clone()]),
                obs(2, vec![sf(pulse), ts.clone()]),
            ]
        }
        Reading::Scale { mass_kg, bmi } => {
            let once = [
                obs(1, vec![fl(mass_kg), ts.clone()]),
                obs(3, vec![fl(bmi), ts.clone()]),
            ];
            let times = if spec.antidote_quirks { 2 } else { 1 };
            (0..times)
                .flat_map(|_| {
                    once.iter().map(|o| Observation {
                        handle: o.handle,
                        attributes: o.attributes.clone(),
                    })
                })
                .collect()
        }
        Reading::Glucose { mg_dl } => vec![obs(1, vec![sf(mg_dl), ts])],
    }
}

/// The MDS attributes a GET returns, in the order of vector C5.
pub(super) fn mds_attributes(spec: &AgentSpec, clock: [u8; 8]) -> Vec<(u16, Vec<u8>)> {
    let mut model = Mder::new();
    model.text(b"TheCompany");
    model.text(spec.device.model());
    let mut system_id = Mder::new();
    system_id.octets(&spec.system_id);
    let mut prod_spec = Mder::new();
    prod_spec.seq(1, |w| {
        w.u16(1); // spec-type: serial-number
        w.u16(0); // component-id
        w.octets(b"DE124567");
    });
    vec![
        (
            ATTR_SYS_TYPE_SPEC_LIST,
            seq_value(1, &[spec.device.spec_profile(), 1]),
        ),
        (ATTR_ID_MODEL, model.finish()),
        (ATTR_SYS_ID, system_id.finish()),
        (ATTR_DEV_CONFIG_ID, be(&[spec.effective_config_id()])),
        (ATTR_ID_PROD_SPECN, prod_spec.finish()),
        (ATTR_TIME_ABS, clock.to_vec()),
    ]
}

pub(super) fn sfloat_fits((mantissa, exponent): (i32, i8)) -> bool {
    (-2048..=2047).contains(&mantissa) && (-8..=7).contains(&exponent)
}

pub(super) fn float_fits((mantissa, _): (i32, i8)) -> bool {
    (-8_388_608..=8_388_607).contains(&mantissa)
}

/// SFLOAT: exponent in the high 4 bits, mantissa in the low 12, both two's complement.
/// Callers check [`sfloat_fits`] first (via [`Reading::check`]).
pub(super) fn sfloat((mantissa, exponent): (i32, i8)) -> u16 {
    ((exponent as u16 & 0x000F) << 12) | (mantissa as u16 & 0x0FFF)
}

/// FLOAT: exponent in the high 8 bits, mantissa in the low 24.
pub(super) fn float((mantissa, exponent): (i32, i8)) -> u32 {
    (u32::from(exponent as u8) << 24) | (mantissa as u32 & 0x00FF_FFFF)
}

/// A tiny MDER writer: big-endian integers and back-patched u16 length fields.
pub(super) struct Mder {
    buf: Vec<u8>,
}

impl Mder {
    fn new() -> Mder {
        Mder {
            buf: Vec::with_capacity(128),
        }
    }
    fn finish(self) -> Vec<u8> {
        self.buf
    }
    fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_be_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_be_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
    }
    /// A u16 length, then what `body` writes; the length is patched in afterwards.
    fn with_len(&mut self, body: impl FnOnce(&mut Mder)) {
        let at = self.buf.len();
        self.u16(0);
        body(self);
        let len = self.buf.len() - at - 2;
        // Invariant: every APDU this module builds is a few hundred bytes at most (fixed tables,
        // one reading, up to 4 observations), far below the 16-bit limit.
        let len = u16::try_from(len).expect("PHD APDU part longer than 65535 bytes");
        self.buf[at..at + 2].copy_from_slice(&len.to_be_bytes());
    }
    /// SEQUENCE OF: count, then a length around what `items` writes.
    fn seq(&mut self, count: usize, items: impl FnOnce(&mut Mder)) {
        // Same invariant as in `with_len`: counts are tiny.
        self.u16(u16::try_from(count).expect("PHD sequence longer than 65535 items"));
        self.with_len(items);
    }
    /// OCTET STRING: length + bytes.
    fn octets(&mut self, v: &[u8]) {
        self.with_len(|w| w.bytes(v));
    }
    /// Text as an OCTET STRING padded to even length with one zero byte (Annex H style, C5).
    fn text(&mut self, v: &[u8]) {
        self.with_len(|w| {
            w.bytes(v);
            if v.len() % 2 == 1 {
                w.u8(0);
            }
        });
    }
}
