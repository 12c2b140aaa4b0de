//! proptest strategies for resolved SenML records (what [`PackWriter::push`] accepts).
//!
//! [`PackWriter::push`]: sluice_proto::senml::PackWriter::push

use bytes::Bytes;
use proptest::collection::vec;
use proptest::option::weighted;
use proptest::prelude::*;
use sluice_proto::senml::{Record, Value};

/// A valid resolved name.
pub fn name() -> impl Strategy<Value = String> {
    "[A-Za-z0-9][A-Za-z0-9:./_-]{0,24}"
}

/// Finite doubles, weighted towards the shapes that exercise the encoders: integers (small,
/// around 2^53, around 2^64), epoch times, fractions, extremes, signed zero.
pub fn finite() -> impl Strategy<Value = f64> {
    prop_oneof![
        any::<f64>().prop_filter("finite", |f| f.is_finite()),
        any::<i32>().prop_map(f64::from),
        any::<i64>().prop_map(|i| i as f64),
        any::<u64>().prop_map(|u| u as f64),
        (1_600_000_000u32..1_900_000_000, 0u32..1000)
            .prop_map(|(s, ms)| f64::from(s) + f64::from(ms) / 1000.0),
        (-1e6..1e6f64),
        prop::sample::select(vec![
            0.0,
            -0.0,
            0.98,
            76.2,
            9_007_199_254_740_992.0,
            9_007_199_254_740_994.0,
            -9_007_199_254_740_992.0,
            18_446_744_073_709_549_568.0,
            18_446_744_073_709_551_616.0,
            -18_446_744_073_709_551_616.0,
            -18_446_744_073_709_555_712.0,
            f64::MAX,
            f64::MIN,
            f64::MIN_POSITIVE,
            5e-324,
            0.5,
            65504.0,
        ]),
    ]
}

pub fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        finite().prop_map(Value::Number),
        any::<String>().prop_map(Value::String),
        any::<bool>().prop_map(Value::Bool),
        vec(any::<u8>(), 0..48).prop_map(|d| Value::Data(Bytes::from(d))),
    ]
}

pub fn record() -> impl Strategy<Value = Record> {
    (
        name(),
        prop_oneof![Just(0.0), finite()],
        weighted(0.5, any::<String>()),
        weighted(0.9, value()),
        weighted(0.3, finite()),
        weighted(0.3, finite()),
    )
        .prop_map(|(name, time, unit, value, sum, update_time)| Record {
            name,
            time,
            unit,
            value,
            sum,
            update_time,
        })
}
