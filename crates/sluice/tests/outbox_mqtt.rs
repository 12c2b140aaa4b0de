//! The outbox suite run over the MQTT transport, against the small fault-injecting broker
//! (`common/fault_broker.rs`): the same ordering, retry and failover cases as every transport.

mod common;
mod outbox_suite;

use std::rc::Rc;
use std::sync::Arc;

use common::fault_broker::{self, FaultBroker};
use outbox_suite::{Harness, Received};
use sluice::config::{UplinkConfig, UplinkUrl};
use sluice::sink::mqtt::MqttTransport;
use sluice::sink::transport::RefusalClass;
use sluice::sink::{DownlinkDelivery, Lane, UplinkMetrics};

impl Harness for FaultBroker {
    type T = MqttTransport;

    async fn start() -> Self {
        fault_broker::start().await
    }

    fn url(&self) -> UplinkUrl {
        UplinkUrl {
            tls: false,
            host: "127.0.0.1".into(),
            port: self.addr.port(),
        }
    }

    fn transport(&self, cfg: Rc<UplinkConfig>, metrics: Arc<UplinkMetrics>) -> MqttTransport {
        let downlink = Rc::new(|_| -> DownlinkDelivery { Box::pin(async {}) });
        MqttTransport::new(0, Lane::Normal, cfg, None, downlink, metrics)
    }

    fn cut_link(&self) {
        self.cut();
    }

    /// The broker answers with `code`; the transport classifies it itself.
    fn refuse_next(&self, n: usize, code: u8, _class: RefusalClass) {
        FaultBroker::refuse_next(self, n, code);
    }

    fn hold_acks(&self, hold: bool) {
        FaultBroker::hold_acks(self, hold);
    }

    fn received(&self) -> Vec<Received> {
        let log = self.log.lock().unwrap();
        log.received
            .iter()
            .map(|g| Received {
                payload: g.payload.clone(),
                dup: g.dup,
                accepted: g.accepted,
            })
            .collect()
    }
}

outbox_cases!(FaultBroker);
