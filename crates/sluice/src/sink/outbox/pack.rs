//! SenML aggregation (SegaNet §4.2): normal-priority messages packed into one PUBLISH.
//!
//! Owns: turning a device message into SenML records ([`records_of`]) and the open pack of one
//! session ([`Packer`]). Does not own: when to aggregate (the session asks the gateway-wide
//! connected-device count), writing packs, or their acknowledgement (the outbox, `outbox/fill.rs`).
//!
//! # One message → records
//! - A payload that already is a SenML pack (JSON or CBOR, by its first byte) keeps its own
//!   records, resolved: base fields applied, a relative time (< 2²⁸) made absolute against the
//!   time the gateway received it.
//! - Anything else becomes one record: name `"{device}/{topic}"` (characters SenML does not
//!   allow in names become `_`, and a name must start with a letter or digit, so other first
//!   characters get a `x` in front), time = when the gateway received it (Unix seconds,
//!   millisecond precision), value: `v` when the payload is a decimal number, `vs` when it is
//!   other UTF-8 text, `vd` (the exact bytes) otherwise.
//!
//! # Invariants
//! - Records enter the pack in the order their messages left the queue, so a pack preserves
//!   per-device order, and packs are published in order.
//! - A pack is sealed once its encoding reaches `max_pack` (it may exceed it by the last
//!   message's records, so a message is never split), once the uplink is idle (the outbox's
//!   decision, `outbox/fill.rs`: a lone message on an idle uplink goes in the loop turn it
//!   arrived, as a pack of one record), or at the latest once its oldest message has waited
//!   `max_delay`. The open pack holds at most `max_pack` plus one message of encoded bytes.
//! - A pack never grows past the limit its session gives [`Packer::add`] (what the broker's
//!   Maximum Packet Size leaves for the payload): a message that would take it past is handed
//!   back unpacked, so one large message can never make a whole pack unsendable.
//! - Messages stay owned by the pack until the cloud acknowledges it; their queue bytes stay
//!   reserved until then (the memory bound in queue.rs covers them).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use sluice_proto::senml::{self, Format, PackWriter, Record, Value};

use crate::config::{AggregateConfig, PackFormat};
use crate::sink::UplinkMessage;

/// Times below this are relative to "now" in SenML (RFC 8428 §4.5.3).
const SENML_RELATIVE_LIMIT: f64 = (1u64 << 28) as f64;

/// A sealed pack, ready to publish.
pub struct SealedPack {
    pub payload: Bytes,
    pub msgs: Vec<UplinkMessage>,
    pub records: usize,
    /// Sealed because it reached `max_pack` (or the most the link takes); `false`: a partial
    /// pack, sealed early because the uplink was idle, `max_delay` passed, or packing stopped.
    pub full: bool,
}

impl SealedPack {
    /// Whether the cloud must acknowledge it (any record came as QoS ≥ 1).
    pub fn needs_ack(&self) -> bool {
        self.msgs.iter().any(UplinkMessage::needs_cloud_ack)
    }
}

/// The open pack of one session.
pub struct Packer {
    writer: PackWriter,
    msgs: Vec<UplinkMessage>,
    max_pack: usize,
    max_delay: Duration,
}

impl Packer {
    pub fn new(cfg: &AggregateConfig) -> Packer {
        let format = match cfg.format {
            PackFormat::Json => Format::Json,
            PackFormat::Cbor => Format::Cbor,
        };
        Packer {
            writer: PackWriter::new(format),
            msgs: Vec::new(),
            max_pack: cfg.max_pack.as_usize(),
            max_delay: cfg.max_delay,
        }
    }

    pub fn format(&self) -> Format {
        self.writer.format()
    }

    pub fn is_empty(&self) -> bool {
        self.msgs.is_empty()
    }

    /// Whether any message in the open pack needs the cloud's acknowledgement.
    pub fn needs_ack(&self) -> bool {
        self.msgs.iter().any(UplinkMessage::needs_cloud_ack)
    }

    /// Whether the open pack reached `max_pack` (it should be sealed before more is added).
    pub fn is_full(&self) -> bool {
        !self.msgs.is_empty() && self.writer.encoded_len() >= self.max_pack
    }

    /// When the open pack must be sealed at the latest (`None` when empty).
    pub fn deadline(&self) -> Option<Instant> {
        self.msgs.first().map(|m| m.received_at + self.max_delay)
    }

    /// Add a message's records if the pack stays within `limit` encoded bytes (the most the
    /// broker's Maximum Packet Size leaves for the payload); returns whether the pack reached
    /// `max_pack` and should be sealed now. A message that would take the pack past `limit`
    /// is handed back and the pack is unchanged: the caller seals the pack and tries again
    /// with an empty one, or sends the message alone when even an empty pack cannot hold it.
    // Handing the message back by value is the point (it is never lost or copied).
    #[allow(clippy::result_large_err)]
    pub fn add(&mut self, msg: UplinkMessage, limit: usize) -> Result<bool, UplinkMessage> {
        let mark = self.writer.mark();
        for record in records_of(&msg, unix_time_of(msg.received_at)) {
            if let Err(error) = self.writer.push(&record) {
                // records_of only yields valid records; if the codec still refuses one, keep
                // the message's bytes rather than lose them.
                tracing::debug!(%error, "SenML record refused; sending the payload as vd");
                let fallback = opaque_record(&msg, unix_time_of(msg.received_at));
                let _ = self.writer.push(&fallback);
            }
        }
        if self.writer.encoded_len() > limit {
            self.writer.rollback(mark);
            return Err(msg);
        }
        self.msgs.push(msg);
        Ok(self.writer.encoded_len() >= self.max_pack)
    }

    /// Seal the open pack (`None` when empty).
    pub fn seal(&mut self) -> Option<SealedPack> {
        if self.msgs.is_empty() {
            return None;
        }
        let records = self.writer.len();
        let full = self.writer.encoded_len() >= self.max_pack;
        Some(SealedPack {
            payload: self.writer.finish(),
            msgs: std::mem::take(&mut self.msgs),
            records,
            full,
        })
    }

    /// Empty the pack without publishing it (the connection ended): its messages, in order.
    pub fn take_messages(&mut self) -> Vec<UplinkMessage> {
        let _ = self.writer.finish();
        std::mem::take(&mut self.msgs)
    }
}

/// Unix time (seconds, millisecond precision) of a monotonic instant in the recent past.
fn unix_time_of(at: Instant) -> f64 {
    let wall = SystemTime::now()
        .checked_sub(at.elapsed())
        .unwrap_or_else(SystemTime::now);
    let ms = wall.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    ms as f64 / 1000.0
}

/// The SenML records one device message becomes (see the module docs).
pub fn records_of(msg: &UplinkMessage, received_unix: f64) -> Vec<Record> {
    if let Some(format) = senml::sniff(&msg.payload) {
        if let Ok(mut records) = senml::decode(format, &msg.payload) {
            if !records.is_empty() {
                for r in &mut records {
                    if r.time < SENML_RELATIVE_LIMIT {
                        r.time += received_unix;
                    }
                }
                return records;
            }
        }
    }
    vec![opaque_record(msg, received_unix)]
}

fn opaque_record(msg: &UplinkMessage, received_unix: f64) -> Record {
    let value = match std::str::from_utf8(&msg.payload) {
        Ok(text) => match text.trim().parse::<f64>() {
            Ok(n) if n.is_finite() && looks_numeric(text.trim()) => Value::Number(n),
            _ => Value::String(text.to_owned()),
        },
        Err(_) => Value::Data(msg.payload.clone()),
    };
    Record {
        name: record_name(&msg.device, &msg.topic),
        time: received_unix,
        unit: None,
        value: Some(value),
        sum: None,
        update_time: None,
    }
}

/// Decimal notation only: `parse::<f64>` also takes "inf", "NaN" and "1e5", which are text.
fn looks_numeric(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    !digits.is_empty()
        && digits.chars().all(|c| c.is_ascii_digit() || c == '.')
        && digits.matches('.').count() <= 1
        && digits.chars().next().is_some_and(|c| c.is_ascii_digit())
}

/// `"{device}/{topic}"` with every character SenML names do not allow replaced by `_`.
pub fn record_name(device: &str, topic: &str) -> String {
    let mut name = String::with_capacity(device.len() + topic.len() + 2);
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | ':' | '.' | '/' | '_');
    for c in device
        .chars()
        .chain(std::iter::once('/'))
        .chain(topic.chars())
    {
        name.push(if allowed(c) { c } else { '_' });
    }
    if !name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        name.insert(0, 'x');
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ByteSize;
    use bytestring::ByteString;
    use sluice_proto::mqtt::QoS;

    fn msg(device: &str, topic: &str, payload: &[u8]) -> UplinkMessage {
        UplinkMessage {
            device: ByteString::from(device),
            topic: ByteString::from(topic),
            payload: Bytes::copy_from_slice(payload),
            qos: QoS::AtLeastOnce,
            retain: false,
            received_at: Instant::now(),
            ack: None,
            content_type: None,
            user_properties: None,
            stored: None,
        }
    }

    #[test]
    fn names_are_valid_senml_names() {
        assert_eq!(record_name("dev-1", "a/b"), "dev-1/a/b");
        assert_eq!(record_name("dév 1", "a+b"), "d_v_1/a_b");
        assert_eq!(record_name("_x", "t"), "x_x/t");
        for (d, t) in [("", "t"), ("$", "#"), ("é", "ü/ß"), ("a", "\u{0}")] {
            assert!(senml::valid_name(&record_name(d, t)), "{d:?} {t:?}");
        }
    }

    #[test]
    fn opaque_payloads_keep_their_value_kind_and_bytes() {
        let t = 1_700_000_000.5;
        let r = &records_of(&msg("d", "temp", b"21.5"), t)[0];
        assert_eq!(r.value, Some(Value::Number(21.5)));
        assert_eq!(r.time, t);
        assert_eq!(r.name, "d/temp");
        let r = &records_of(&msg("d", "s", b"open"), t)[0];
        assert_eq!(r.value, Some(Value::String("open".into())));
        let r = &records_of(&msg("d", "s", b"inf"), t)[0];
        assert_eq!(r.value, Some(Value::String("inf".into())));
        let raw = [0xff, 0x00, 0x10];
        let r = &records_of(&msg("d", "s", &raw), t)[0];
        assert_eq!(r.value, Some(Value::Data(Bytes::copy_from_slice(&raw))));
    }

    #[test]
    fn senml_payloads_keep_their_records_with_absolute_times() {
        let payload = br#"[{"bn":"urn:dev:x:","bt":-2,"n":"spo2","v":0.98},{"n":"pulse","t":1700000000,"v":72}]"#;
        let records = records_of(&msg("d", "s", payload), 1_800_000_000.0);
        assert_eq!(records.len(), 2);
        assert_eq!(records[0].name, "urn:dev:x:spo2");
        assert_eq!(records[0].time, 1_799_999_998.0);
        assert_eq!(records[1].name, "urn:dev:x:pulse");
        // bt (-2) + t (1700000000) is absolute already.
        assert_eq!(records[1].time, 1_699_999_998.0);
    }

    #[test]
    fn packer_seals_at_size_and_round_trips_in_order() {
        for format in [PackFormat::Json, PackFormat::Cbor] {
            let cfg = AggregateConfig {
                format,
                max_pack: ByteSize::b(300),
                ..AggregateConfig::default()
            };
            let mut p = Packer::new(&cfg);
            assert!(p.deadline().is_none());
            let mut full_after = None;
            for i in 0..20u8 {
                if p.add(
                    msg("dev", "t", &[0x80, i, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
                    usize::MAX,
                )
                .unwrap()
                {
                    full_after = Some(i);
                    break;
                }
            }
            let n = usize::from(full_after.expect("a 300-byte pack fills")) + 1;
            assert!(p.deadline().is_some());
            let sealed = p.seal().unwrap();
            assert!(p.is_empty());
            assert!(sealed.payload.len() >= 300, "{}", sealed.payload.len());
            assert!(sealed.full, "sealed at max_pack");
            assert_eq!(sealed.msgs.len(), n);
            assert_eq!(sealed.records, n);
            assert!(sealed.needs_ack());
            let fmt = match format {
                PackFormat::Json => Format::Json,
                PackFormat::Cbor => Format::Cbor,
            };
            let back = senml::decode(fmt, &sealed.payload).unwrap();
            for (i, r) in back.iter().enumerate() {
                assert_eq!(
                    r.value,
                    Some(Value::Data(Bytes::copy_from_slice(&[
                        0x80, i as u8, 1, 2, 3, 4, 5, 6, 7, 8, 9
                    ])))
                );
                assert_eq!(r.name, "dev/t");
            }
            assert!(p.seal().is_none());
        }
    }

    #[test]
    fn a_message_that_would_take_the_pack_past_the_limit_is_handed_back_and_the_pack_kept() {
        for format in [PackFormat::Json, PackFormat::Cbor] {
            let cfg = AggregateConfig {
                format,
                max_pack: ByteSize::kib(16),
                ..AggregateConfig::default()
            };
            let mut p = Packer::new(&cfg);
            assert_eq!(p.add(msg("dev", "t", b"one"), 200).ok(), Some(false));
            assert_eq!(p.add(msg("dev", "t", b"two"), 200).ok(), Some(false));
            let big = p
                .add(msg("dev", "t", &[b'x'; 300]), 200)
                .expect_err("300 bytes cannot fit in 200");
            assert_eq!(big.payload.len(), 300, "handed back whole");
            // Alone it does not fit either: the caller sends it unpacked.
            let mut empty = Packer::new(&cfg);
            assert!(empty.add(big, 200).is_err());
            let sealed = p.seal().unwrap();
            assert!(sealed.payload.len() <= 200);
            assert!(
                !sealed.full,
                "below max_pack: partial (the outbox marks it full)"
            );
            let fmt = match format {
                PackFormat::Json => Format::Json,
                PackFormat::Cbor => Format::Cbor,
            };
            let back = senml::decode(fmt, &sealed.payload).unwrap();
            let values: Vec<_> = back.into_iter().map(|r| r.value).collect();
            assert_eq!(
                values,
                vec![
                    Some(Value::String("one".into())),
                    Some(Value::String("two".into()))
                ],
                "the pack is exactly what it was before the refused message"
            );
            assert_eq!(sealed.msgs.len(), 2);
        }
    }
}
