//! Which path a unit goes to (see the module docs of `sink::paths`): stickiness first, then
//! the pack rule, then `lane_path`, then minRTT among the live paths with room.
//!
//! Owns: [`PathsTransport::pick`] and the ordering key of a free choice. Does not own: path
//! state (the transport).

use std::time::Duration;

use super::{Path, PathsTransport};
use crate::sink::transport::Flow;

/// Smoothed RTTs within this of each other count as equally good (then inflight ÷ weight
/// decides, so equal paths share the load).
const SRTT_BUCKET: Duration = Duration::from_micros(500);

impl PathsTransport {
    /// The path a unit of `flow` goes to now; `None`: it must wait (its path has no room, or
    /// no path has).
    pub(super) fn pick(&self, flow: Flow) -> Option<usize> {
        let room = |i: usize| self.paths[i].room().then_some(i);
        if let Some(&(i, _)) = self.flows.get(&flow) {
            if self.paths[i].is_up() {
                return room(i);
            }
        }
        match flow {
            Flow::Device(_) => {
                if let Some(&(i, _)) = self.flows.get(&Flow::Packs) {
                    if self.paths[i].is_up() {
                        return room(i);
                    }
                }
            }
            Flow::Packs => {
                let mut with_devices = self
                    .paths
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.device_units > 0)
                    .map(|(i, _)| i);
                match (with_devices.next(), with_devices.next()) {
                    (Some(_), Some(_)) => return None,
                    (Some(i), None) => return room(i),
                    _ => {}
                }
            }
        }
        if let Some(i) = self.pinned {
            if self.paths[i].is_up() {
                return room(i);
            }
        }
        best(&self.paths)
    }
}

/// The live path with room and the lowest (srtt bucket, inflight ÷ weight).
fn best(paths: &[Path]) -> Option<usize> {
    paths
        .iter()
        .enumerate()
        .filter(|(_, p)| p.room())
        .min_by_key(|(_, p)| key(p.srtt, p.inflight.len(), p.weight))
        .map(|(i, _)| i)
}

fn key(srtt: Option<Duration>, inflight: usize, weight: u32) -> (u128, u64) {
    let bucket = srtt.map_or(0, |s| s.as_micros() / SRTT_BUCKET.as_micros());
    (bucket, (inflight as u64 * 1000) / u64::from(weight.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lower_rtt_wins_and_equal_rtts_share_by_weight() {
        let fast = key(Some(Duration::from_millis(10)), 50, 1);
        let slow = key(Some(Duration::from_millis(40)), 0, 1);
        assert!(
            fast < slow,
            "minRTT: the faster path first while it has room"
        );
        let a = key(Some(Duration::from_micros(100)), 4, 1);
        let b = key(Some(Duration::from_micros(300)), 4, 2);
        assert!(b < a, "equally good: the heavier weight takes more");
        assert!(key(None, 0, 1) <= key(Some(Duration::from_millis(1)), 0, 1));
    }
}
