//! Observed-value encodings of IEEE 11073-20601 (fact sheet §10–§11): SFLOAT-Type (16 bits),
//! FLOAT-Type (32 bits) and AbsoluteTime (8 BCD bytes).
//!
//! Owns: decoding and encoding these exactly. A number is kept as mantissa × 10^exponent
//! ([`Decimal`]), never as a binary float, so 97.5 stays 97.5 on its way to SenML. Special
//! values (NaN, NRes, ±INFINITY, reserved) are recognised by the mantissa alone, as Antidote
//! does, and always encoded with exponent 0. Does not own: which attribute holds which
//! encoding (the value maps of a configuration).

/// A base-10 number: `mantissa × 10^exponent`, or a special value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decimal {
    Value {
        mantissa: i32,
        exponent: i8,
    },
    NaN,
    /// Not at this resolution.
    NRes,
    PosInfinity,
    NegInfinity,
    Reserved,
}

impl Decimal {
    /// The value as an `f64` (NaN / ±∞ for the specials; NRes and reserved are NaN).
    pub fn to_f64(self) -> f64 {
        match self {
            Decimal::Value { mantissa, exponent } => {
                // Exact for the decimal text: format then parse, e.g. 975e-1 → 97.5.
                format!("{mantissa}e{exponent}").parse().unwrap_or(f64::NAN)
            }
            Decimal::PosInfinity => f64::INFINITY,
            Decimal::NegInfinity => f64::NEG_INFINITY,
            Decimal::NaN | Decimal::NRes | Decimal::Reserved => f64::NAN,
        }
    }
}

/// SFLOAT-Type: 4-bit exponent, 12-bit mantissa.
pub fn sfloat(raw: u16) -> Decimal {
    let m = raw & 0x0FFF;
    match m {
        0x07FF => return Decimal::NaN,
        0x0800 => return Decimal::NRes,
        0x07FE => return Decimal::PosInfinity,
        0x0802 => return Decimal::NegInfinity,
        0x0801 => return Decimal::Reserved,
        _ => {}
    }
    let e = (raw >> 12) as i8;
    let exponent = if e >= 8 { e - 16 } else { e };
    let mantissa = if m >= 0x0800 {
        i32::from(m) - 0x1000
    } else {
        i32::from(m)
    };
    Decimal::Value { mantissa, exponent }
}

/// FLOAT-Type: 8-bit exponent, 24-bit mantissa.
pub fn float(raw: u32) -> Decimal {
    let m = raw & 0x00FF_FFFF;
    match m {
        0x007F_FFFF => return Decimal::NaN,
        0x0080_0000 => return Decimal::NRes,
        0x007F_FFFE => return Decimal::PosInfinity,
        0x0080_0002 => return Decimal::NegInfinity,
        0x0080_0001 => return Decimal::Reserved,
        _ => {}
    }
    let exponent = (raw >> 24) as u8 as i8;
    let mantissa = if m >= 0x0080_0000 {
        m as i32 - 0x0100_0000
    } else {
        m as i32
    };
    Decimal::Value { mantissa, exponent }
}

/// Encode as SFLOAT; `None` when the mantissa or exponent does not fit (or it would collide
/// with a special value).
pub fn to_sfloat(d: Decimal) -> Option<u16> {
    let special = |m: u16| Some(m);
    match d {
        Decimal::NaN => special(0x07FF),
        Decimal::NRes => special(0x0800),
        Decimal::PosInfinity => special(0x07FE),
        Decimal::NegInfinity => special(0x0802),
        Decimal::Reserved => special(0x0801),
        Decimal::Value { mantissa, exponent } => {
            if !(-2045..=2045).contains(&mantissa) || !(-8..=7).contains(&exponent) {
                return None;
            }
            Some((((exponent as u16) & 0xF) << 12) | ((mantissa as u16) & 0x0FFF))
        }
    }
}

/// Encode as FLOAT; `None` when it does not fit.
pub fn to_float(d: Decimal) -> Option<u32> {
    match d {
        Decimal::NaN => Some(0x007F_FFFF),
        Decimal::NRes => Some(0x0080_0000),
        Decimal::PosInfinity => Some(0x007F_FFFE),
        Decimal::NegInfinity => Some(0x0080_0002),
        Decimal::Reserved => Some(0x0080_0001),
        Decimal::Value { mantissa, exponent } => {
            if !(-8_388_605..=8_388_605).contains(&mantissa) {
                return None;
            }
            Some((u32::from(exponent as u8) << 24) | ((mantissa as u32) & 0x00FF_FFFF))
        }
    }
}

/// AbsoluteTime: century, year, month, day, hour, minute, second, hundredths — each one BCD
/// byte. No time zone is carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbsoluteTime {
    pub year: u16,
    pub month: u8,
    pub day: u8,
    pub hour: u8,
    pub minute: u8,
    pub second: u8,
    pub hundredths: u8,
}

fn bcd(b: u8) -> Option<u8> {
    let (hi, lo) = (b >> 4, b & 0x0F);
    (hi <= 9 && lo <= 9).then_some(hi * 10 + lo)
}

fn to_bcd(v: u8) -> u8 {
    ((v / 10) << 4) | (v % 10)
}

impl AbsoluteTime {
    /// `None` for a digit that is not BCD or a field out of its range.
    pub fn decode(b: [u8; 8]) -> Option<AbsoluteTime> {
        let t = AbsoluteTime {
            year: u16::from(bcd(b[0])?) * 100 + u16::from(bcd(b[1])?),
            month: bcd(b[2])?,
            day: bcd(b[3])?,
            hour: bcd(b[4])?,
            minute: bcd(b[5])?,
            second: bcd(b[6])?,
            hundredths: bcd(b[7])?,
        };
        let ok = (1..=12).contains(&t.month)
            && (1..=31).contains(&t.day)
            && t.hour < 24
            && t.minute < 60
            && t.second < 61;
        ok.then_some(t)
    }

    pub fn encode(&self) -> [u8; 8] {
        [
            to_bcd((self.year / 100) as u8),
            to_bcd((self.year % 100) as u8),
            to_bcd(self.month),
            to_bcd(self.day),
            to_bcd(self.hour),
            to_bcd(self.minute),
            to_bcd(self.second),
            to_bcd(self.hundredths),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn v(mantissa: i32, exponent: i8) -> Decimal {
        Decimal::Value { mantissa, exponent }
    }

    #[test]
    fn the_sheets_worked_examples_decode() {
        assert_eq!(sfloat(0x0062), v(98, 0));
        assert_eq!(sfloat(0x0048), v(72, 0));
        assert_eq!(sfloat(0xF258), v(600, -1));
        assert_eq!(sfloat(0xF3CF), v(975, -1));
        assert_eq!(sfloat(0xF3CF).to_f64(), 97.5);
        assert_eq!(sfloat(0xFF83), v(-125, -1));
        assert_eq!(sfloat(0xFF83).to_f64(), -12.5);
        assert_eq!(sfloat(0x07FF), Decimal::NaN);
        assert_eq!(float(0xFF00_02FA), v(762, -1));
        assert_eq!(float(0xFF00_02FA).to_f64(), 76.2);
        assert_eq!(float(0xFF00_00F3), v(243, -1));
        assert_eq!(float(0xFF00_016E).to_f64(), 36.6);
        assert_eq!(float(0xFEFF_954D), v(-27315, -2));
        assert_eq!(float(0xFEFF_954D).to_f64(), -273.15);
        assert_eq!(float(0x007F_FFFF), Decimal::NaN);
    }

    #[test]
    fn specials_are_recognised_by_the_mantissa_alone_and_encoded_with_exponent_zero() {
        assert_eq!(sfloat(0x3800), Decimal::NRes);
        assert_eq!(sfloat(0x27FE), Decimal::PosInfinity);
        assert_eq!(float(0x0580_0002), Decimal::NegInfinity);
        assert_eq!(to_sfloat(Decimal::NegInfinity), Some(0x0802));
        assert_eq!(to_float(Decimal::NRes), Some(0x0080_0000));
        assert_eq!(to_sfloat(v(5000, 0)), None, "mantissa too large for SFLOAT");
    }

    #[test]
    fn absolute_time_is_bcd() {
        let t = AbsoluteTime::decode([0x20, 0x07, 0x12, 0x06, 0x12, 0x10, 0x00, 0x00]).unwrap();
        assert_eq!(
            (t.year, t.month, t.day, t.hour, t.minute, t.second),
            (2007, 12, 6, 12, 10, 0)
        );
        assert_eq!(t.encode(), [0x20, 0x07, 0x12, 0x06, 0x12, 0x10, 0x00, 0x00]);
        assert_eq!(
            AbsoluteTime::decode([0x20, 0x0A, 1, 1, 0, 0, 0, 0]),
            None,
            "not BCD"
        );
        assert_eq!(
            AbsoluteTime::decode([0x20, 0x07, 0x13, 1, 0, 0, 0, 0]),
            None,
            "month 13"
        );
    }

    proptest! {
        #[test]
        fn sfloat_round_trips(raw in any::<u16>()) {
            let d = sfloat(raw);
            let back = to_sfloat(d).map(sfloat);
            prop_assert_eq!(back, Some(d));
        }

        #[test]
        fn float_round_trips(raw in any::<u32>()) {
            let d = float(raw);
            let back = to_float(d).map(float);
            prop_assert_eq!(back, Some(d));
        }
    }
}
