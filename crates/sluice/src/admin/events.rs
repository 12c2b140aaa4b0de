//! The live side of the admin endpoint: one overview snapshot per tick, its short history, and
//! the server-sent-event streams that carry it to dashboards.
//!
//! Owns: the [`EventHub`] — a ticker that asks the [`AdminSource`] for its overview once per
//! [`TICK`], serialises it once, keeps the last [`HISTORY_POINTS`] values of the document's
//! `series` object, and publishes the frame through a `watch` channel that every open stream
//! reads — and [`EventBody`], the body of one `GET /api/v1/events` response. Does not own:
//! what the overview contains (the source), access rules and routing (`admin/mod.rs`).
//!
//! Invariants and bounds:
//! - One snapshot per tick, whatever the number of viewers: the overview is computed and
//!   serialised by the ticker, and each stream only clones the shared `Bytes` (a reference
//!   count). `GET /api/v1/overview` serves the same latest frame's JSON.
//! - At most [`MAX_STREAMS`] streams are open at once; one more is answered 503 with
//!   `Retry-After` and counted in `sluice_admin_event_streams_refused_total`. A stream holds
//!   one admin connection slot (of `admin::MAX_CONNECTIONS`), one `watch` receiver and hyper's
//!   buffers (capped at `MAX_HEADER_BYTES` each way), so streams cost at most
//!   `MAX_STREAMS × (2 × 16 KiB + a frame)` — see docs/memory bounds.
//! - A reader never makes the gateway buffer for it: the channel holds only the latest frame,
//!   so a slow reader skips frames. One that fell [`MAX_LAG`] frames behind, or took no frame
//!   for [`STALL_TIMEOUT`] (its socket full), is disconnected and counted in
//!   `sluice_admin_event_streams_dropped_total{reason="slow"|"stalled"}`.
//! - History: `series` holds at most [`MAX_SERIES`] numbers; each keeps [`HISTORY_POINTS`]
//!   values (5 minutes at 1 s): at most `MAX_SERIES × HISTORY_POINTS × 8` bytes.
//! - On shutdown the ticker stops and every stream ends (its body returns end-of-stream).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::{watch, Notify};

use super::AdminSource;
use crate::telemetry::metrics::{Counter, PromWriter};

/// How often the overview is computed and sent.
pub const TICK: Duration = Duration::from_secs(1);
/// Most event streams open at once.
pub const MAX_STREAMS: usize = 8;
/// A stream that skipped more frames than this in one go is disconnected.
pub const MAX_LAG: u64 = 5;
/// A stream that took no frame for this long is disconnected.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(15);
/// Points kept per history series (5 minutes at [`TICK`]).
pub const HISTORY_POINTS: usize = 300;
/// Most series kept (further ones in the overview's `series` are ignored).
pub const MAX_SERIES: usize = 48;

/// The `seq` of the frame that ends every stream (shutdown).
const END: u64 = u64::MAX;

/// One published tick.
#[derive(Debug)]
pub struct Published {
    pub seq: u64,
    /// The overview document as JSON (with a trailing newline).
    pub json: Bytes,
    /// The same as one server-sent event: `id`, `event: overview`, `data`.
    pub frame: Bytes,
}

/// The ticker's shared state: latest frame, history, streams.
pub struct EventHub {
    tx: watch::Sender<Arc<Published>>,
    history: Mutex<History>,
    open: AtomicUsize,
    streams: Mutex<Vec<Arc<StreamState>>>,
    refused: Counter,
    dropped_slow: Counter,
    dropped_stalled: Counter,
    served: Counter,
    epoch: Instant,
    max_streams: usize,
}

#[derive(Default)]
struct History {
    /// Milliseconds since the Unix epoch of each point.
    times: VecDeque<u64>,
    series: Vec<(String, VecDeque<f64>)>,
}

/// What the hub knows of one open stream.
struct StreamState {
    /// Milliseconds since the hub's epoch when it last took a frame.
    last_frame: AtomicU64,
    /// Notified to close the stream's connection (it stopped reading).
    kill: Arc<Notify>,
}

impl EventHub {
    pub fn new() -> Arc<EventHub> {
        EventHub::with_max_streams(MAX_STREAMS)
    }

    pub fn with_max_streams(max_streams: usize) -> Arc<EventHub> {
        let empty = Arc::new(Published {
            seq: 0,
            json: Bytes::from_static(b"{}\n"),
            frame: Bytes::from_static(b": starting\n\n"),
        });
        Arc::new(EventHub {
            tx: watch::channel(empty).0,
            history: Mutex::new(History::default()),
            open: AtomicUsize::new(0),
            streams: Mutex::new(Vec::new()),
            refused: Counter::default(),
            dropped_slow: Counter::default(),
            dropped_stalled: Counter::default(),
            served: Counter::default(),
            epoch: Instant::now(),
            max_streams,
        })
    }

    /// Runs the ticker until `shutdown` becomes true: one overview per [`TICK`].
    pub async fn run(
        self: Arc<Self>,
        source: Arc<dyn AdminSource>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        // The caller published the first tick (`serve_with`); the next one is a tick away.
        let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + TICK, TICK);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.wait_for(|s| *s) => break,
                _ = interval.tick() => self.tick(source.as_ref()),
            }
        }
        // Ends every stream: their receivers see the sender closed.
        self.close();
    }

    /// Computes and publishes one snapshot; checks the streams for stalls.
    pub fn tick(&self, source: &dyn AdminSource) {
        let seq = self.tx.borrow().seq + 1;
        let mut doc = source.overview();
        if let Some(obj) = doc.as_object_mut() {
            obj.insert("seq".into(), seq.into());
        }
        self.record_history(&doc);
        let mut json = doc.to_string();
        let mut frame = String::with_capacity(json.len() + 40);
        frame.push_str("id: ");
        frame.push_str(&seq.to_string());
        frame.push_str("\nevent: overview\ndata: ");
        frame.push_str(&json);
        frame.push_str("\n\n");
        json.push('\n');
        self.tx.send_replace(Arc::new(Published {
            seq,
            json: Bytes::from(json),
            frame: Bytes::from(frame),
        }));
        self.reap_stalled();
    }

    /// Ends every stream (shutdown): they see the [`END`] frame and finish their response.
    fn close(&self) {
        self.tx.send_replace(Arc::new(Published {
            seq: END,
            json: self.latest_json(),
            frame: Bytes::new(),
        }));
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn reap_stalled(&self) {
        self.reap_stalled_at(self.now_ms());
    }

    fn reap_stalled_at(&self, now: u64) {
        let stall = STALL_TIMEOUT.as_millis() as u64;
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        streams.retain(|s| {
            if now.saturating_sub(s.last_frame.load(Ordering::Relaxed)) >= stall {
                self.dropped_stalled.inc();
                tracing::debug!("admin event stream stalled; closing it");
                s.kill.notify_one();
                false
            } else {
                true
            }
        });
    }

    fn record_history(&self, doc: &serde_json::Value) {
        let Some(series) = doc.get("series").and_then(|s| s.as_object()) else {
            return;
        };
        let time = doc.get("time_ms").and_then(|t| t.as_u64()).unwrap_or(0);
        let mut h = self.history.lock().unwrap_or_else(|e| e.into_inner());
        if h.times.len() == HISTORY_POINTS {
            h.times.pop_front();
            for (_, v) in h.series.iter_mut() {
                v.pop_front();
            }
        }
        h.times.push_back(time);
        let points = h.times.len();
        for (name, value) in series.iter() {
            let v = value.as_f64().unwrap_or(0.0);
            if let Some((_, values)) = h.series.iter_mut().find(|(n, _)| n == name) {
                values.push_back(v);
            } else if h.series.len() < MAX_SERIES {
                // A series that appears late is padded so every series lines up with `times`.
                let mut values: VecDeque<f64> = std::iter::repeat_n(0.0, points - 1).collect();
                values.push_back(v);
                h.series.push((name.clone(), values));
            }
        }
        // A series missing from this document keeps its length in step.
        for (_, values) in h.series.iter_mut() {
            if values.len() < points {
                values.push_back(0.0);
            }
        }
    }

    /// The latest overview as JSON (`GET /api/v1/overview`).
    pub fn latest_json(&self) -> Bytes {
        self.tx.borrow().json.clone()
    }

    /// The history as JSON (`GET /api/v1/history`):
    /// `{"interval_seconds":1,"times_ms":[..],"series":{"name":[..],..}}`.
    pub fn history_json(&self) -> Bytes {
        let h = self.history.lock().unwrap_or_else(|e| e.into_inner());
        let series: serde_json::Map<String, serde_json::Value> = h
            .series
            .iter()
            .map(|(n, v)| (n.clone(), serde_json::json!(v)))
            .collect();
        let doc = serde_json::json!({
            "interval_seconds": TICK.as_secs_f64(),
            "times_ms": h.times,
            "series": series,
        });
        let mut s = doc.to_string();
        s.push('\n');
        Bytes::from(s)
    }

    /// Opens a stream whose connection is closed through `kill` if it stalls; `None` when
    /// [`MAX_STREAMS`] are open (counted).
    pub fn open_stream(self: &Arc<Self>, kill: Arc<Notify>) -> Option<EventBody> {
        let reserved = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_streams).then_some(n + 1)
            })
            .is_ok();
        if !reserved {
            self.refused.inc();
            return None;
        }
        self.served.inc();
        let state = Arc::new(StreamState {
            last_frame: AtomicU64::new(self.now_ms()),
            kill,
        });
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(state.clone());
        let rx = self.tx.subscribe();
        Some(EventBody {
            hub: self.clone(),
            state,
            last_seq: None,
            next: Some(Box::pin(first(rx))),
        })
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Adds the hub's own series to `/metrics`.
    pub fn render(&self, w: &mut PromWriter) {
        w.gauge(
            "sluice_admin_event_streams",
            "Server-sent event streams (/api/v1/events, dashboards) open now.",
            &[],
            self.open_streams() as i64,
        );
        w.counter(
            "sluice_admin_event_streams_opened_total",
            "Server-sent event streams opened.",
            &[],
            self.served.get(),
        );
        w.counter(
            "sluice_admin_event_streams_refused_total",
            "Event streams refused because the most allowed were open (503).",
            &[],
            self.refused.get(),
        );
        for (reason, c) in [
            ("slow", &self.dropped_slow),
            ("stalled", &self.dropped_stalled),
        ] {
            w.counter(
                "sluice_admin_event_streams_dropped_total",
                "Event streams the gateway closed because the reader fell behind (slow) or stopped reading (stalled).",
                &[("reason", reason)],
                c.get(),
            );
        }
    }

    fn release(&self, state: &Arc<StreamState>) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|s| !Arc::ptr_eq(s, state));
    }
}

type Next =
    Pin<Box<dyn Future<Output = Option<(watch::Receiver<Arc<Published>>, Arc<Published>)>> + Send>>;

/// The current frame at once (a new viewer sees data without waiting for the next tick).
async fn first(
    mut rx: watch::Receiver<Arc<Published>>,
) -> Option<(watch::Receiver<Arc<Published>>, Arc<Published>)> {
    let p = rx.borrow_and_update().clone();
    Some((rx, p))
}

/// The next published frame, or `None` when the hub is gone.
async fn next(
    mut rx: watch::Receiver<Arc<Published>>,
) -> Option<(watch::Receiver<Arc<Published>>, Arc<Published>)> {
    rx.changed().await.ok()?;
    let p = rx.borrow_and_update().clone();
    Some((rx, p))
}

/// The body of one `GET /api/v1/events` response: `text/event-stream`, one event per tick.
pub struct EventBody {
    hub: Arc<EventHub>,
    state: Arc<StreamState>,
    last_seq: Option<u64>,
    next: Option<Next>,
}

impl Drop for EventBody {
    fn drop(&mut self) {
        self.hub.release(&self.state);
    }
}

impl Body for EventBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let Some(fut) = self.next.as_mut() else {
            return Poll::Ready(None);
        };
        let Some((rx, published)) = std::task::ready!(fut.as_mut().poll(cx)) else {
            self.next = None;
            return Poll::Ready(None);
        };
        if published.seq == END {
            self.next = None;
            return Poll::Ready(None);
        }
        if let Some(last) = self.last_seq {
            if published.seq.saturating_sub(last) > MAX_LAG {
                self.hub.dropped_slow.inc();
                tracing::debug!(
                    skipped = published.seq - last,
                    "admin event stream fell behind; closing it"
                );
                self.next = None;
                return Poll::Ready(None);
            }
        }
        self.last_seq = Some(published.seq);
        self.state
            .last_frame
            .store(self.hub.now_ms(), Ordering::Relaxed);
        self.next = Some(Box::pin(next(rx)));
        Poll::Ready(Some(Ok(Frame::data(published.frame.clone()))))
    }

    fn is_end_stream(&self) -> bool {
        self.next.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64 as Count;

    struct Ticking(Count);

    impl AdminSource for Ticking {
        fn render_metrics(&self, _: &mut PromWriter) {}
        fn status(&self) -> serde_json::Value {
            serde_json::json!({})
        }
        fn overview(&self) -> serde_json::Value {
            let n = self.0.fetch_add(1, Ordering::Relaxed);
            serde_json::json!({ "time_ms": 1000 + n, "series": { "n": n, "twice": 2 * n } })
        }
    }

    async fn frame(body: &mut EventBody) -> Option<Bytes> {
        std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx))
            .await
            .map(|f| f.unwrap().into_data().unwrap())
    }

    #[tokio::test]
    async fn every_stream_gets_the_one_snapshot_of_each_tick() {
        let hub = EventHub::new();
        let source = Ticking(Count::new(0));
        hub.tick(&source);
        let mut a = hub.open_stream(Arc::new(Notify::new())).unwrap();
        let mut b = hub.open_stream(Arc::new(Notify::new())).unwrap();
        let fa = frame(&mut a).await.unwrap();
        assert_eq!(fa, frame(&mut b).await.unwrap());
        assert!(fa.starts_with(b"id: 1\nevent: overview\ndata: {"), "{fa:?}");
        assert!(fa.ends_with(b"}\n\n"));
        hub.tick(&source);
        let fa = frame(&mut a).await.unwrap();
        let fb = frame(&mut b).await.unwrap();
        // The same allocation: serialised once, shared.
        assert_eq!(fa.as_ptr(), fb.as_ptr());
        assert_eq!(source.0.load(Ordering::Relaxed), 2, "one overview per tick");
    }

    #[tokio::test]
    async fn streams_beyond_the_bound_are_refused_and_a_closed_one_frees_its_place() {
        let hub = EventHub::with_max_streams(2);
        let a = hub.open_stream(Arc::new(Notify::new())).unwrap();
        let _b = hub.open_stream(Arc::new(Notify::new())).unwrap();
        assert!(hub.open_stream(Arc::new(Notify::new())).is_none());
        assert_eq!(hub.refused.get(), 1);
        drop(a);
        assert_eq!(hub.open_streams(), 1);
        assert!(hub.open_stream(Arc::new(Notify::new())).is_some());
    }

    #[tokio::test]
    async fn a_reader_that_falls_behind_is_disconnected() {
        let hub = EventHub::new();
        let source = Ticking(Count::new(0));
        hub.tick(&source);
        let mut slow = hub.open_stream(Arc::new(Notify::new())).unwrap();
        assert!(frame(&mut slow).await.is_some());
        for _ in 0..=MAX_LAG {
            hub.tick(&source);
        }
        assert!(frame(&mut slow).await.is_none(), "the slow stream ended");
        assert_eq!(hub.dropped_slow.get(), 1);
    }

    #[tokio::test]
    async fn a_reader_that_stops_reading_has_its_connection_closed() {
        let hub = EventHub::new();
        let kill = Arc::new(Notify::new());
        let _stuck = hub.open_stream(kill.clone()).unwrap();
        let _reading = hub.open_stream(Arc::new(Notify::new())).unwrap();
        hub.streams.lock().unwrap()[1]
            .last_frame
            .store(STALL_TIMEOUT.as_millis() as u64, Ordering::Relaxed);
        // Its last frame (at open, ~0 ms) is STALL_TIMEOUT old at this "now"; the other's is not.
        hub.reap_stalled_at(STALL_TIMEOUT.as_millis() as u64 + 10);
        tokio::time::timeout(Duration::from_secs(1), kill.notified())
            .await
            .expect("the stalled stream's connection is told to close");
        assert_eq!(hub.dropped_stalled.get(), 1);
        assert_eq!(hub.streams.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn shutdown_ends_every_stream() {
        let hub = EventHub::new();
        let mut s = hub.open_stream(Arc::new(Notify::new())).unwrap();
        assert!(frame(&mut s).await.is_some());
        hub.close();
        assert!(frame(&mut s).await.is_none());
    }

    #[test]
    fn history_keeps_the_last_points_of_every_series() {
        let hub = EventHub::new();
        let source = Ticking(Count::new(0));
        for _ in 0..HISTORY_POINTS + 10 {
            hub.tick(&source);
        }
        let h: serde_json::Value = serde_json::from_slice(&hub.history_json()).unwrap();
        let n = h["series"]["n"].as_array().unwrap();
        assert_eq!(n.len(), HISTORY_POINTS);
        assert_eq!(n[0], 10.0);
        assert_eq!(h["times_ms"].as_array().unwrap().len(), HISTORY_POINTS);
        assert_eq!(h["series"]["twice"][HISTORY_POINTS - 1], 2.0 * 309.0);
    }
}
