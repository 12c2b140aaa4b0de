//! CON retransmission (RFC 7252 §4.2, §4.8): the timeouts between the transmissions of a
//! confirmable message sluice sends.
//!
//! Owns: the schedule (initial timeout `ACK_TIMEOUT × [1, ACK_RANDOM_FACTOR)`, doubled per
//! retransmission, at most `MAX_RETRANSMIT` retransmissions) and EXCHANGE_LIFETIME-style
//! spans derived from it. Does not own: timers or sockets (the caller sleeps and sends).

use std::time::Duration;

/// ACK_RANDOM_FACTOR of RFC 7252 §4.8.
pub const ACK_RANDOM_FACTOR: f64 = 1.5;

/// The retransmission schedule of one CON.
#[derive(Debug, Clone)]
pub struct Retransmit {
    timeout: Duration,
    left: u8,
}

impl Retransmit {
    /// `random` in `[0, 1)` picks the initial timeout within `[ack_timeout, ack_timeout ×
    /// ACK_RANDOM_FACTOR)`.
    pub fn new(ack_timeout: Duration, max_retransmit: u8, random: f64) -> Retransmit {
        let factor = 1.0 + (ACK_RANDOM_FACTOR - 1.0) * random.clamp(0.0, 0.999_999);
        Retransmit {
            timeout: ack_timeout.mul_f64(factor),
            left: max_retransmit,
        }
    }

    /// How long to wait for the ACK of the transmission just made.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// After a timeout: `true` (and the doubled timeout) when another retransmission is due,
    /// `false` when MAX_RETRANSMIT is spent and the peer is given up.
    pub fn next(&mut self) -> bool {
        if self.left == 0 {
            return false;
        }
        self.left -= 1;
        self.timeout = self.timeout.saturating_mul(2);
        true
    }
}

/// MAX_TRANSMIT_WAIT (RFC 7252 §4.8.2): from the first transmission until the sender gives up.
pub fn max_transmit_wait(ack_timeout: Duration, max_retransmit: u8) -> Duration {
    let spans = (1u64 << (max_retransmit as u32 + 1).min(62)) - 1;
    ack_timeout
        .mul_f64(ACK_RANDOM_FACTOR)
        .saturating_mul(spans.min(u32::MAX as u64) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeout_doubles_and_stops_after_max_retransmit() {
        let mut r = Retransmit::new(Duration::from_secs(2), 4, 0.0);
        let mut waits = vec![r.timeout()];
        while r.next() {
            waits.push(r.timeout());
        }
        let secs: Vec<u64> = waits.iter().map(|d| d.as_secs()).collect();
        assert_eq!(secs, vec![2, 4, 8, 16, 32]);
    }

    #[test]
    fn the_initial_timeout_is_randomised_below_the_factor() {
        let hi = Retransmit::new(Duration::from_secs(2), 4, 0.99);
        assert!(hi.timeout() > Duration::from_millis(2900));
        assert!(hi.timeout() < Duration::from_secs(3));
        let clamped = Retransmit::new(Duration::from_secs(2), 0, 7.0);
        assert!(clamped.timeout() < Duration::from_secs(3));
    }

    #[test]
    fn max_transmit_wait_matches_rfc_7252_defaults() {
        // ACK_TIMEOUT 2 s, MAX_RETRANSMIT 4: 93 s.
        assert_eq!(
            max_transmit_wait(Duration::from_secs(2), 4),
            Duration::from_secs(93)
        );
    }
}
