//! Which path of an upstream a request goes to (`[[coap.proxy]] paths`, ADR 0012): the live
//! path with room and the fewest request bytes outstanding ÷ weight, ties broken by the lower
//! smoothed RTT; a request a dead path gave back avoids that path while another can take it.
//!
//! The idea is `sink::paths::sched`'s (each path its own window, the least loaded live path
//! first), without its coupling to MQTT flows: CoAP requests carry no per-device order to
//! keep (each is answered on its own token), so no stickiness is needed. Least outstanding
//! bytes rather than minRTT first: over links that queue, a path's RTT rises only after its
//! queue has filled, so minRTT keeps loading the path that looked fast; outstanding bytes are
//! known at once (see the ADR's measurements).
//!
//! Owns: [`PathView`] and [`pick`]. Does not own: path state (`conn.rs`).

use std::time::Duration;

/// What the scheduler looks at of one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathView {
    /// Connected (CSM exchanged) and serving.
    pub up: bool,
    /// Fewer than `max_outstanding` requests written and unanswered.
    pub room: bool,
    /// Bytes of requests written and unanswered.
    pub bytes: usize,
    pub srtt: Option<Duration>,
    pub weight: u32,
}

/// The path the next request goes to, `None`: it waits (no live path has room). `avoid`: the
/// path that lost it, used only when no other can take it.
pub fn pick(paths: &[PathView], avoid: Option<usize>) -> Option<usize> {
    let best = |skip: Option<usize>| {
        paths
            .iter()
            .enumerate()
            .filter(|(i, p)| p.up && p.room && Some(*i) != skip)
            .min_by_key(|(_, p)| key(p))
            .map(|(i, _)| i)
    };
    best(avoid).or_else(|| best(None))
}

fn key(p: &PathView) -> (u64, u128) {
    (
        (p.bytes as u64).saturating_mul(1000) / u64::from(p.weight.max(1)),
        p.srtt.map_or(0, |s| s.as_micros()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(up: bool, room: bool, bytes: usize, srtt_ms: u64) -> PathView {
        PathView {
            up,
            room,
            bytes,
            srtt: Some(Duration::from_millis(srtt_ms)),
            weight: 1,
        }
    }

    #[test]
    fn the_least_loaded_live_path_with_room_wins() {
        let paths = [
            v(true, true, 9000, 10),
            v(true, true, 900, 300),
            v(false, true, 0, 1),
        ];
        assert_eq!(
            pick(&paths, None),
            Some(1),
            "fewest bytes outstanding, though slower"
        );
        let paths = [v(true, true, 900, 50), v(true, true, 900, 20)];
        assert_eq!(pick(&paths, None), Some(1), "equal bytes: lower srtt");
        let paths = [v(true, false, 0, 1), v(false, true, 0, 1)];
        assert_eq!(pick(&paths, None), None, "no live path with room: wait");
    }

    #[test]
    fn weight_scales_the_load_and_a_retry_avoids_the_path_that_lost_it() {
        let mut heavy = v(true, true, 1800, 10);
        heavy.weight = 3;
        assert_eq!(pick(&[v(true, true, 900, 10), heavy], None), Some(1));
        let paths = [v(true, true, 0, 1), v(true, true, 5000, 100)];
        assert_eq!(pick(&paths, Some(0)), Some(1));
        let paths = [v(true, true, 0, 1), v(false, true, 0, 1)];
        assert_eq!(
            pick(&paths, Some(0)),
            Some(0),
            "no other path: the same one"
        );
    }
}
