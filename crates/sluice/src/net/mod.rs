//! Sockets and links below the transports: how an outgoing connection is dialled (source
//! address, interface, MPTCP), what MPTCP says about a connection, and the link state of
//! the interfaces multipath uplinks use.
//!
//! Owns: [`dial`] (socket creation for uplinks and the CoAP proxy), [`mptcp`] (MPTCP
//! socket information: active or fallen back, subflows), [`links`] (the netlink watcher
//! thread and the MPTCP endpoint refresh). Does not own: anything above TCP (transports,
//! outboxes, sessions).

pub mod dial;
pub mod links;
pub mod listen;
pub mod mptcp;
