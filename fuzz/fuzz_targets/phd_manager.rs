//! Fuzz target for the PHD manager (crates/sluice-proto/src/phd/manager.rs, scan.rs,
//! config.rs, measure.rs): the input is a stream of APDUs from an agent, fed to a manager that
//! knows the standard configurations and learns extended ones; every report is turned into
//! SenML. Checks, besides "no panic": a manager in Operating always has a table, and every
//! confirmed report it yields can be confirmed.
#![no_main]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use sluice_proto::phd::config::{standard, ObjectTable};
use sluice_proto::phd::manager::{confirmation, ConfigLookup};
use sluice_proto::phd::measure::{measurements, senml_json};
use sluice_proto::phd::{decode_apdu, Manager, ManagerConfig, Output, State};

struct Learnt(HashMap<([u8; 8], u16), Arc<ObjectTable>>);

impl ConfigLookup for Learnt {
    fn known(&self, id: &[u8], config_id: u16) -> Option<Arc<ObjectTable>> {
        let id: [u8; 8] = id.try_into().ok()?;
        self.0
            .get(&(id, config_id))
            .cloned()
            .or_else(|| standard(config_id).map(|t| Arc::new(t.clone())))
    }
}

fuzz_target!(|data: &[u8]| {
    let now = Instant::now();
    let mut m = Manager::new(Arc::new(ManagerConfig::default()), now);
    let mut learnt = Learnt(HashMap::new());
    let mut buf = BytesMut::from(data);
    let mut out = Vec::new();
    for step in 0..64u64 {
        let t = now + Duration::from_millis(step * 500);
        match decode_apdu(&mut buf, 65_539) {
            Ok(Some(a)) => m.on_apdu(a, t, &learnt, &mut out),
            Ok(None) => break,
            Err(e) => m.on_decode_error(&e, t, &mut out),
        }
        m.on_timeout(t, &mut out);
        if m.state() == State::Operating {
            assert!(m.table().is_some(), "operating without a table");
        }
        for o in out.drain(..) {
            match o {
                Output::ConfigAccepted { agent, table } => {
                    learnt.0.insert((agent.system_id, agent.config_id), table);
                }
                Output::Report {
                    invoke_id,
                    confirmed,
                    obj_handle,
                    event_type,
                    report,
                } => {
                    if let Some(table) = m.table() {
                        let (ms, _) = measurements(&[1; 8], table, &report, 0.0, 0);
                        for mm in ms {
                            let _ = senml_json(&mm.records);
                        }
                    }
                    if confirmed {
                        let mut w = BytesMut::new();
                        confirmation(invoke_id, obj_handle, event_type).encode(&mut w);
                    }
                }
                _ => {}
            }
        }
    }
});
