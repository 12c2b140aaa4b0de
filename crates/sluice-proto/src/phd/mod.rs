//! IEEE 11073-20601 (personal health devices, "optimized exchange protocol"): what a manager
//! needs, sans-IO.
//!
//! Owns: MDER primitives ([`mder`]), observed-value encodings — SFLOAT, FLOAT, AbsoluteTime
//! ([`values`]) — the APDUs — association (AARQ/AARE), release (RLRQ/RLRE), abort (ABRT) and
//! presentation (PRST) with its Data APDU ([`apdu`]) — their framing on a byte stream
//! ([`frame`]), configurations and their reports ([`config`]), scan reports ([`scan`]), the
//! manager's state machine and timers ([`manager`]) and the SenML form of observations
//! ([`measure`]). Every decoder checks each count and length against what encloses it; the
//! golden vectors of `../shared/specs/vectors/phd_*.hex` decode and re-encode byte for byte.
//! Does not own: sockets, clocks, the agent table (the gateway's control plane).

pub mod apdu;
pub mod config;
pub mod frame;
pub mod manager;
pub mod mder;
pub mod measure;
pub mod scan;
pub mod values;

pub use apdu::{Aare, Aarq, Apdu, DataApdu, DataMessage, DataProto, PhdAssociationInformation};
pub use config::{MetricObject, ObjectTable};
pub use frame::decode_apdu;
pub use manager::{ConfigLookup, Manager, ManagerConfig, Output, State};
pub use mder::DecodeError;
pub use values::{AbsoluteTime, Decimal};
