//! The scenarios, one module each: only what is particular to it (parameters, set-up, what it
//! measures, its verdict); the rest comes from [`crate::harness`], [`crate::load`],
//! [`crate::sinks`] and [`crate::report`].

pub mod connections;
pub mod core;
pub mod outage;
pub mod priority;
pub mod seganet;
pub mod storage;
pub mod throughput;
