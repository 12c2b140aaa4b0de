//! [`PackWriter`]: builds a pack one record at a time, knowing its exact encoded size at
//! every step, so a caller can stop before a size limit.
//!
//! Records are encoded as they are pushed into one body buffer (JSON: objects separated by
//! commas; CBOR: the maps back to back). [`PackWriter::finish`] adds the frame: `[` … `]`, or
//! the CBOR definite-length array head, whose size (1, 2, 3, 5 or 9 bytes) depends on the
//! record count — [`PackWriter::encoded_len`] counts it the same way.

use bytes::Bytes;

use super::{cbor, json, valid_name, Format, Record, SenmlError, Value};

/// Where a [`PackWriter`] stood, to go back to with [`PackWriter::rollback`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackMark {
    records: usize,
    body: usize,
}

/// Incremental pack encoder: records are appended one by one; the gateway checks
/// encoded_len() against a size limit before/after pushing.
#[derive(Clone, Debug)]
pub struct PackWriter {
    format: Format,
    records: usize,
    body: Vec<u8>,
}

impl PackWriter {
    pub fn new(format: Format) -> PackWriter {
        PackWriter {
            format,
            records: 0,
            body: Vec::new(),
        }
    }

    /// Append one record. Emits only fields that are present: n (always), t (omitted when
    /// time == 0.0), u, v/vs/vb/vd, s, ut. No base fields. Errors on a non-finite number or an
    /// invalid name (valid_name), leaving the writer unchanged.
    pub fn push(&mut self, record: &Record) -> Result<(), SenmlError> {
        let index = self.records;
        if !valid_name(&record.name) {
            return Err(SenmlError::InvalidName {
                record: index,
                name: record.name.clone(),
            });
        }
        let numbers = [
            ("t", Some(record.time)),
            (
                "v",
                match record.value {
                    Some(Value::Number(v)) => Some(v),
                    _ => None,
                },
            ),
            ("s", record.sum),
            ("ut", record.update_time),
        ];
        for (label, n) in numbers {
            if n.is_some_and(|n| !n.is_finite()) {
                return Err(SenmlError::NotFinite {
                    record: index,
                    label,
                });
            }
        }
        match self.format {
            Format::Json => {
                if index > 0 {
                    self.body.push(b',');
                }
                json::write_record(record, &mut self.body);
            }
            Format::Cbor => cbor::write_record(record, &mut self.body),
        }
        self.records += 1;
        Ok(())
    }

    /// The writer's position now (see [`PackWriter::rollback`]).
    pub fn mark(&self) -> PackMark {
        PackMark {
            records: self.records,
            body: self.body.len(),
        }
    }

    /// Remove every record pushed since `mark` was taken (so a caller can try a record and
    /// take it back when the pack would grow past a limit). A mark from before the last
    /// `finish` (or from another writer) that lies ahead of the writer does nothing.
    pub fn rollback(&mut self, mark: PackMark) {
        if mark.records <= self.records && mark.body <= self.body.len() {
            self.records = mark.records;
            self.body.truncate(mark.body);
        }
    }

    /// Exact number of bytes finish() would return right now (including array brackets /
    /// CBOR array head).
    pub fn encoded_len(&self) -> usize {
        self.frame_len() + self.body.len()
    }

    /// Records pushed so far.
    pub fn len(&self) -> usize {
        self.records
    }

    pub fn is_empty(&self) -> bool {
        self.records == 0
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// The encoded pack (definite-length CBOR array; JSON array). Resets the writer to empty
    /// so it can be reused.
    pub fn finish(&mut self) -> Bytes {
        let mut out = Vec::with_capacity(self.encoded_len());
        match self.format {
            Format::Json => {
                out.push(b'[');
                out.extend_from_slice(&self.body);
                out.push(b']');
            }
            Format::Cbor => {
                cbor::write_array_head(self.records as u64, &mut out);
                out.extend_from_slice(&self.body);
            }
        }
        self.body.clear();
        self.records = 0;
        Bytes::from(out)
    }

    fn frame_len(&self) -> usize {
        match self.format {
            Format::Json => 2,
            Format::Cbor => cbor::head_len(self.records as u64),
        }
    }
}
