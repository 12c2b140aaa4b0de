//! Device edges, one file per protocol. Each listener runs on the control plane: it accepts,
//! reads the protocol's hello, asks admission, and hands the connection to its shard.

pub mod mqtt;
