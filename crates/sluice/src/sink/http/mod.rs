//! HTTP sinks for edge functions (issue 19): one adaptor for every topic, each message an
//! HTTP POST in CloudEvents 1.0 binary mode, so the same function runs unchanged on sluice
//! and on Knative.
//!
//! Owns today: [`cloudevents`] — the event's attributes and their binary-mode HTTP form.
//! Still to come (issue 19): the transport (pooled keep-alive HTTP/1.1 to a function's URL or
//! a local instance), retries and dead letters, the local runtime and the autoscaler.

pub mod cloudevents;
