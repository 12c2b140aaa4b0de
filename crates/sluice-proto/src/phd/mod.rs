//! IEEE 11073-20601 (personal health devices, "optimized exchange protocol"): the APDU layer a
//! manager needs, sans-IO.
//!
//! Owns: MDER primitives ([`mder`]), observed-value encodings — SFLOAT, FLOAT, AbsoluteTime
//! ([`values`]) — the APDUs — association (AARQ/AARE), release
//! (RLRQ/RLRE), abort (ABRT) and presentation (PRST) with its Data APDU ([`apdu`]) — and their
//! framing on a byte stream ([`frame`]). Every decoder checks each count and length against
//! what encloses it; the golden vectors of `../shared/specs/vectors/phd_*.hex` decode and
//! re-encode byte for byte. Does not own (yet: issue 18 continues): the manager's state
//! machine and timers, configuration reports, scan-report observations (value maps), the
//! agent table, sockets.

pub mod apdu;
pub mod frame;
pub mod mder;
pub mod values;

pub use apdu::{Aare, Aarq, Apdu, DataApdu, DataMessage, DataProto, PhdAssociationInformation};
pub use frame::decode_apdu;
pub use mder::DecodeError;
pub use values::{AbsoluteTime, Decimal};
