//! The drain share: how the backlog stream (spool records from before the link's last
//! connect) and the live stream share one window.
//!
//! Owns: the decision whether the backlog goes next ([`drain_turn`]). Does not own: the two
//! streams (`queue.rs`) or the share's configuration (`spool.drain_share`, handed to the
//! outbox with its [`super::Feeders`]). Invariant: neither stream starves.

use super::Outbox;
use crate::sink::transport::Transport;

/// What [`drain_turn`] looks at.
#[derive(Debug, Clone, Copy)]
pub(super) struct DrainState {
    pub live_waiting: bool,
    pub aggregating: bool,
    pub window: usize,
    pub inflight: usize,
    pub inflight_backlog: usize,
    pub last_took_backlog: bool,
    /// (backlog, all) records in the open pack.
    pub pack_mix: (usize, usize),
}

impl<T: Transport> Outbox<T> {
    /// Whether the backlog stream goes next (see [`drain_turn`]).
    pub(super) fn backlog_turn(&self, w: usize, aggregating: bool) -> bool {
        let Some(share) = self.feeders.drain_share else {
            return false;
        };
        drain_turn(
            share,
            DrainState {
                live_waiting: self.queue.live_waiting(),
                aggregating,
                window: w,
                inflight: self.inflight.len(),
                inflight_backlog: self.inflight_backlog,
                last_took_backlog: self.last_took_backlog,
                pack_mix: self.pack_mix,
            },
        )
    }
}

/// Whether the backlog stream goes next when both streams may have messages (the drain
/// share). With nothing live waiting the backlog may use the whole window. Otherwise, window
/// `w`, backlog cap `cap = clamp(ceil(share × w), 1, w − 1)`: live messages take the window
/// up to `w − cap` inflight, then the backlog up to `cap`; so live messages always find
/// `w − cap ≥ 1` slots and the backlog `cap ≥ 1`, and neither starves. With a window of one
/// the two alternate. While aggregating, the share applies to the records of each pack.
pub(super) fn drain_turn(share: crate::config::Share, s: DrainState) -> bool {
    if !s.live_waiting {
        return true;
    }
    if s.aggregating {
        let (b, all) = s.pack_mix;
        return b * 1000 < usize::from(share.permille()) * (all + 1);
    }
    let w = s.window;
    if w <= 1 {
        return !s.last_took_backlog;
    }
    let cap = share.of(w).clamp(1, w - 1);
    let b = s.inflight_backlog;
    let live = s.inflight.saturating_sub(b);
    live >= w - cap && b < cap
}

#[cfg(test)]
mod tests {
    use super::*;
    /// Simulates a saturated window: both streams always have messages; each step frees
    /// one random slot. Returns (backlog, live) sends.
    fn simulate(share: u16, w: usize, steps: usize) -> (usize, usize) {
        let share = crate::config::Share::from_permille(share);
        let mut inflight: Vec<bool> = Vec::new();
        let mut last = false;
        let (mut b, mut l) = (0, 0);
        for step in 0..steps {
            while inflight.len() < w {
                let s = DrainState {
                    live_waiting: true,
                    aggregating: false,
                    window: w,
                    inflight: inflight.len(),
                    inflight_backlog: inflight.iter().filter(|x| **x).count(),
                    last_took_backlog: last,
                    pack_mix: (0, 0),
                };
                last = drain_turn(share, s);
                inflight.push(last);
                if last {
                    b += 1;
                } else {
                    l += 1;
                }
            }
            inflight.remove(step * 7919 % inflight.len());
        }
        (b, l)
    }

    #[test]
    fn the_backlog_gets_its_share_of_a_saturated_window_and_live_messages_the_rest() {
        for (share, w) in [
            (500, 10),
            (250, 8),
            (100, 100),
            (900, 10),
            (1000, 4),
            (1, 4),
            (500, 1),
            (500, 2),
        ] {
            let (b, l) = simulate(share, w, 2000);
            assert!(
                b > 0 && l > 0,
                "share {share} window {w}: neither starves ({b} backlog, {l} live)"
            );
            if w > 2 && share < 1000 {
                let got = b as f64 / (b + l) as f64;
                let cap = crate::config::Share::from_permille(share)
                    .of(w)
                    .clamp(1, w - 1) as f64
                    / w as f64;
                assert!(
                    (got - cap).abs() < 0.1,
                    "share {share} window {w}: backlog got {got:.2}, cap {cap:.2}"
                );
            }
        }
    }

    #[test]
    fn without_live_messages_the_backlog_uses_the_whole_window() {
        let s = DrainState {
            live_waiting: false,
            aggregating: false,
            window: 10,
            inflight: 9,
            inflight_backlog: 9,
            last_took_backlog: true,
            pack_mix: (0, 0),
        };
        assert!(drain_turn(crate::config::Share::from_permille(100), s));
    }

    #[test]
    fn while_aggregating_each_pack_holds_about_the_share_of_backlog_records() {
        let share = crate::config::Share::from_permille(250);
        let mut mix = (0usize, 0usize);
        for _ in 0..400 {
            let s = DrainState {
                live_waiting: true,
                aggregating: true,
                window: 1,
                inflight: 0,
                inflight_backlog: 0,
                last_took_backlog: false,
                pack_mix: mix,
            };
            mix.0 += usize::from(drain_turn(share, s));
            mix.1 += 1;
        }
        assert!((95..=105).contains(&mix.0), "{mix:?}");
    }
}
