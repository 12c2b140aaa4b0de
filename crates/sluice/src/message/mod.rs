//! The neutral messages every part of the data plane passes on, in no protocol's shape: what
//! an edge hands the router ([`DeviceMessage`], with its [`ack::AckToken`]) and what the
//! router hands a local subscriber ([`OutMessage`], through
//! `crate::shard::subscriber::LocalSubscriber`).
//!
//! Owns: these types and the acknowledgement flow from sinks back to the device ([`ack`]).
//! Does not own: producing them (the edges, `crate::edge`), routing them (`crate::shard::router`)
//! or carrying them to the cloud (`crate::sink`). This module sits below the edges, the router
//! and the sinks, and imports none of them, so a sink never depends on an edge.
//!
//! # Invariants
//! - A [`DeviceMessage`] owns its bytes (no slice of a read buffer), so what it pins is what
//!   the bounds count.
//! - A token's acknowledgement reaches the device only after every sink that took the
//!   message is done with it (see [`ack`]); local subscribers never delay it.

pub mod ack;

use std::time::Instant;

use bytes::Bytes;
use bytestring::ByteString;
use sluice_proto::mqtt::{Properties, QoS};

use ack::AckToken;

/// One application message from a device, in no protocol's shape: what every edge hands the
/// router, and all the router and the sinks see of it.
#[derive(Debug)]
pub struct DeviceMessage {
    /// The device's identity (its MQTT client id; `{device}` in uplink topic templates).
    pub device: ByteString,
    /// The local topic (validated by the edge).
    pub topic: ByteString,
    pub payload: Bytes,
    /// The delivery guarantee the device asked for (local subscribers get at most this).
    pub qos: QoS,
    /// Keep it as the topic's retained message.
    pub retain: bool,
    /// MQTT 5 application properties carried to local subscribers and the retained store
    /// (Message Expiry, Content Type, User Properties, …); per-connection ones (topic alias,
    /// subscription identifiers) already removed. Other edges set what maps onto them.
    pub properties: Option<Box<Properties>>,
    /// When the gateway read it from the device (start of the ack-latency histogram, the
    /// spool record's time).
    pub received_at: Instant,
    /// `Some` when the device expects an acknowledgement: completed once every sink is done
    /// with the message (see [`ack`]).
    pub ack: Option<AckToken>,
}

/// A message on its way to a device.
#[derive(Debug, Clone)]
pub struct OutMessage {
    pub topic: ByteString,
    pub payload: Bytes,
    pub qos: QoS,
    pub retain: bool,
    pub properties: Option<Box<Properties>>,
    /// When the message expires (MQTT 5 Message Expiry Interval, counted from when the
    /// gateway received it): an expired message still queued is dropped, counted.
    pub expires_at: Option<Instant>,
}

impl OutMessage {
    /// The message's properties as sent now: the Message Expiry Interval lowered by the time
    /// the message waited in the gateway (at least 1 s, so it never reads as "no expiry").
    pub fn properties_now(&self, now: Instant) -> Option<Box<Properties>> {
        let Some(at) = self.expires_at else {
            return self.properties.clone();
        };
        let left = at.saturating_duration_since(now);
        let secs = (left.as_millis().div_ceil(1000)).clamp(1, u32::MAX as u128) as u32;
        let mut p = self.properties.clone().unwrap_or_default();
        p.message_expiry_interval = Some(secs);
        Some(p)
    }
    pub fn is_expired(&self, now: Instant) -> bool {
        self.expires_at.is_some_and(|at| at <= now)
    }
}

/// Why a message was not queued for a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueRefusal {
    Full,
    Offline,
}
