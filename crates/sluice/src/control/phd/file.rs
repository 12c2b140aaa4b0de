//! `phd-configs.json`: loading and saving the learnt configurations (format in the parent
//! module's docs). A file that does not parse is logged and ignored.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use sluice_proto::phd::config::ObjectTable;

use super::{hex, PhdSnapshot};

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// One configuration of the file: system id, table, who taught it (address, identity).
pub(super) type Stored = ([u8; 8], ObjectTable, Option<SocketAddr>, Option<Arc<str>>);

pub(super) fn load(file: &std::path::Path) -> Vec<Stored> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(error) => {
            tracing::warn!(file = %file.display(), %error, "cannot read the learnt PHD configurations; agents will configure again");
            return Vec::new();
        }
    };
    let parsed = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| {
            v["configs"]
                .as_array()?
                .iter()
                .map(|c| {
                    let id: [u8; 8] = unhex(c["system_id"].as_str()?)?.try_into().ok()?;
                    let table =
                        ObjectTable::decode_report(Bytes::from(unhex(c["config"].as_str()?)?))
                            .ok()?;
                    table.check().ok()?;
                    let by = c["taught_by"].as_str().and_then(|a| a.parse().ok());
                    let owner = c["identity"].as_str().map(Arc::from);
                    Some((id, table, by, owner))
                })
                .collect::<Option<Vec<_>>>()
        });
    parsed.unwrap_or_else(|| {
        tracing::warn!(file = %file.display(), "learnt PHD configurations do not parse; ignored (agents will configure again)");
        Vec::new()
    })
}

pub(super) fn save(
    file: &std::path::Path,
    order: &VecDeque<([u8; 8], u16)>,
    taught_by: &HashMap<([u8; 8], u16), SocketAddr>,
    tables: &PhdSnapshot,
) {
    let configs: Vec<_> = order
        .iter()
        .filter_map(|k| {
            let t = tables.get(k)?;
            let mut c =
                serde_json::json!({ "system_id": hex(&k.0), "config": hex(&t.encode_report()) });
            if let Some(by) = taught_by.get(k) {
                c["taught_by"] = by.to_string().into();
            }
            if let Some(owner) = tables.owner(k) {
                c["identity"] = owner.to_string().into();
            }
            Some(c)
        })
        .collect();
    let text = serde_json::json!({ "version": 1, "configs": configs }).to_string();
    let tmp = file.with_extension("json.tmp");
    let result = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, file));
    if let Err(error) = result {
        tracing::warn!(file = %file.display(), %error, "cannot save the learnt PHD configurations");
    }
}
