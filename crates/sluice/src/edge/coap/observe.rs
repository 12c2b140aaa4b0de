//! Observe (RFC 7641) subscriptions on the pub/sub resource: `GET {pubsub_path}/{filter}`
//! with Observe=0 registers, every routed message matching `filter` becomes a notification.
