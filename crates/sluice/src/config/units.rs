//! Values with units in the config file: byte sizes (`"64MiB"`), durations (`"30s"`) and
//! socket addresses (`"127.0.0.1:1883"`).
//!
//! Owns: parsing and printing of these values, and their serde glue. Does not own: range
//! checks (see `validate.rs`).
//!
//! Invariants: a bare number is never accepted for a size or a duration — the unit is part of
//! the value, so `max_packet_size = 1048576` is an error that says to write `"1MiB"`. Printing
//! then parsing yields the same value exactly (sizes use the largest unit that divides them;
//! durations use `humantime::format_duration`).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A number of bytes. In TOML it is a string with a unit: binary (`"512B"`, `"1KiB"`,
/// `"64MiB"`, `"2GiB"`, `"1TiB"`) or SI (`"1kB"`/`"1KB"`, `"1MB"`, `"1GB"`, `"1TB"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

/// Units, largest first within each family; `(suffix, multiplier)`.
const BINARY_UNITS: [(&str, u64); 4] = [
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
];
const SI_UNITS: [(&str, u64); 4] = [
    ("TB", 1_000_000_000_000),
    ("GB", 1_000_000_000),
    ("MB", 1_000_000),
    ("kB", 1_000),
];

const SIZE_NEEDS_UNIT: &str = "sizes need a unit, e.g. \"64MiB\"";
const DURATION_NEEDS_UNIT: &str = "durations need a unit, e.g. \"30s\" or \"100ms\"";

impl ByteSize {
    pub const fn b(n: u64) -> Self {
        ByteSize(n)
    }
    pub const fn kib(n: u64) -> Self {
        ByteSize(n << 10)
    }
    pub const fn mib(n: u64) -> Self {
        ByteSize(n << 20)
    }
    pub const fn gib(n: u64) -> Self {
        ByteSize(n << 30)
    }
    pub const fn as_u64(self) -> u64 {
        self.0
    }
    /// The size as a `usize`, saturating on 32-bit targets.
    pub fn as_usize(self) -> usize {
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }
}

/// Why a size string did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: {reason}")]
pub struct ParseByteSizeError {
    input: String,
    reason: &'static str,
}

impl FromStr for ByteSize {
    type Err = ParseByteSizeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseByteSizeError {
            input: s.to_string(),
            reason,
        };
        let t = s.trim();
        let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (digits, unit) = t.split_at(digits_end);
        if digits.is_empty() {
            return Err(err(
                "expected a whole number followed by a unit, e.g. \"64MiB\"",
            ));
        }
        let unit = unit.trim_start();
        if unit.is_empty() {
            return Err(err(SIZE_NEEDS_UNIT));
        }
        let multiplier =
            match unit {
                "B" => 1,
                "KB" => 1_000,
                u => match BINARY_UNITS
                    .iter()
                    .chain(SI_UNITS.iter())
                    .find(|(name, _)| *name == u)
                {
                    Some((_, m)) => *m,
                    None => return Err(err(
                        "unknown unit; use B, KiB, MiB, GiB, TiB (binary) or kB, MB, GB, TB (SI)",
                    )),
                },
            };
        let n: u64 = digits.parse().map_err(|_| err("number too large"))?;
        n.checked_mul(multiplier)
            .map(ByteSize)
            .ok_or_else(|| err("number too large"))
    }
}

impl fmt::Display for ByteSize {
    /// The most readable exact form: the unit that leaves the smallest whole number
    /// (binary preferred on a tie), else bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0;
        let best = BINARY_UNITS
            .iter()
            .chain(SI_UNITS.iter())
            .filter(|(_, m)| n != 0 && n.checked_rem(*m) == Some(0))
            .min_by_key(|(_, m)| n / m);
        match best {
            Some((unit, m)) => write!(f, "{}{unit}", n / m),
            None => write!(f, "{n}B"),
        }
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct SizeVisitor;
        impl Visitor<'_> for SizeVisitor {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size with a unit, e.g. \"64MiB\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<ByteSize, E> {
                Err(E::custom(SIZE_NEEDS_UNIT))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<ByteSize, E> {
                Err(E::custom(SIZE_NEEDS_UNIT))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<ByteSize, E> {
                Err(E::custom(SIZE_NEEDS_UNIT))
            }
        }
        d.deserialize_any(SizeVisitor)
    }
}

/// Parses a duration such as `"30s"`, `"100ms"`, `"2h"` or `"1m 30s"`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if !t.is_empty() && t.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("invalid duration {s:?}: {DURATION_NEEDS_UNIT}"));
    }
    humantime::parse_duration(t).map_err(|e| format!("invalid duration {s:?}: {e}"))
}

/// serde glue for `std::time::Duration` fields: `#[serde(with = "units::duration")]`.
pub mod duration {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_duration(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        struct DurationVisitor;
        impl Visitor<'_> for DurationVisitor {
            type Value = Duration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration with a unit, e.g. \"30s\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
                parse_duration(v).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Duration, E> {
                Err(E::custom(DURATION_NEEDS_UNIT))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Duration, E> {
                Err(E::custom(DURATION_NEEDS_UNIT))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Duration, E> {
                Err(E::custom(DURATION_NEEDS_UNIT))
            }
        }
        d.deserialize_any(DurationVisitor)
    }
}

/// serde glue for `SocketAddr` fields with a message that says host names are not resolved.
pub mod socket_addr {
    use super::*;
    use std::net::SocketAddr;

    pub fn serialize<S: Serializer>(a: &SocketAddr, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(a)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
        struct AddrVisitor;
        impl Visitor<'_> for AddrVisitor {
            type Value = SocketAddr;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an IP address and port, e.g. \"0.0.0.0:1883\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SocketAddr, E> {
                v.trim().parse().map_err(|_| {
                    E::custom(format!(
                        "invalid address {v:?}: expected an IP address and port such as \
                         \"0.0.0.0:1883\" or \"[::]:1883\" (host names are not resolved)"
                    ))
                })
            }
        }
        d.deserialize_any(AddrVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_binary_and_si_units() {
        assert_eq!("512B".parse(), Ok(ByteSize(512)));
        assert_eq!("1KiB".parse(), Ok(ByteSize(1024)));
        assert_eq!("64MiB".parse(), Ok(ByteSize::mib(64)));
        assert_eq!("64 MiB".parse(), Ok(ByteSize::mib(64)));
        assert_eq!("2GiB".parse(), Ok(ByteSize::gib(2)));
        assert_eq!("1MB".parse(), Ok(ByteSize(1_000_000)));
        assert_eq!("3kB".parse(), Ok(ByteSize(3_000)));
        assert_eq!("3KB".parse(), Ok(ByteSize(3_000)));
    }

    #[test]
    fn sizes_without_a_unit_or_with_an_unknown_unit_are_rejected() {
        let e = "1048576".parse::<ByteSize>().unwrap_err().to_string();
        assert!(e.contains("need a unit"), "{e}");
        let e = "64M".parse::<ByteSize>().unwrap_err().to_string();
        assert!(e.contains("unknown unit"), "{e}");
        assert!("MiB".parse::<ByteSize>().is_err());
        assert!("-1MiB".parse::<ByteSize>().is_err());
        assert!("1.5MiB".parse::<ByteSize>().is_err());
        assert!("99999999999TiB".parse::<ByteSize>().is_err());
    }

    #[test]
    fn sizes_print_in_the_most_readable_exact_unit() {
        assert_eq!(ByteSize::mib(64).to_string(), "64MiB");
        assert_eq!(ByteSize(1_000_000).to_string(), "1MB");
        assert_eq!(ByteSize(1536).to_string(), "1536B");
        assert_eq!(ByteSize(3072).to_string(), "3KiB");
        assert_eq!(ByteSize(1_024_000).to_string(), "1000KiB");
        assert_eq!(ByteSize(1023).to_string(), "1023B");
        assert_eq!(ByteSize(0).to_string(), "0B");
        assert_eq!(ByteSize(1 << 40).to_string(), "1TiB");
    }

    #[test]
    fn every_size_survives_print_then_parse() {
        for n in [
            0,
            1,
            999,
            1000,
            1024,
            1536,
            1_000_000,
            1 << 20,
            3 << 30,
            5_000_000_000_000,
            u64::MAX,
        ] {
            let printed = ByteSize(n).to_string();
            assert_eq!(printed.parse(), Ok(ByteSize(n)), "{printed}");
        }
    }

    #[test]
    fn bare_number_durations_are_rejected_with_advice_to_add_a_unit() {
        let e = parse_duration("30").unwrap_err();
        assert!(e.contains("need a unit"), "{e}");
        assert_eq!(parse_duration("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("1m 30s"), Ok(Duration::from_secs(90)));
    }
}
