//! The shared harness every scenario runs on: systems under test as processes ([`sut`]: sluice,
//! the Mosquitto bridge, the floor; [`agents`]: one process per device), the cloud broker and
//! its PKI ([`cloud`]), network namespaces, veth links and tc ([`netns`]), `/proc` sampling ([`procfs`]) and the machine and commit header
//! ([`machine`]).

pub mod agents;
pub mod cloud;
pub mod machine;
pub mod netns;
pub mod procfs;
pub mod sut;
