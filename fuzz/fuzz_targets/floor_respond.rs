//! Fuzz target for the bench tool's floor responder framing (crates/sluice-bench/src/floor.rs):
//! the bytes a device connection hands `sluice-bench floor`.
//!
//! Checks, besides "no panic": `respond` never claims more bytes than it was given, and
//! answering the input whole gives the same answers and outcome as answering it split at an
//! input-chosen offset (as two reads would deliver it).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_bench::floor::respond;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, input)) = data.split_first() else {
        return;
    };
    let (mut v5, mut whole_out) = (false, Vec::new());
    let whole = respond(input, &mut v5, &mut whole_out);
    if let Ok(a) = &whole {
        assert!(a.consumed <= input.len());
    }

    let cut = usize::from(cut).min(input.len());
    let (mut v5, mut split_out) = (false, Vec::new());
    let split = respond(&input[..cut], &mut v5, &mut split_out).and_then(|first| {
        assert!(first.consumed <= cut);
        if first.disconnect {
            return Ok(first);
        }
        let rest = &input[first.consumed..];
        respond(rest, &mut v5, &mut split_out).map(|mut second| {
            second.consumed += first.consumed;
            second
        })
    });
    match (&whole, &split) {
        (Ok(w), Ok(s)) => {
            assert_eq!(w, s, "outcome depends on where the input was split");
            assert_eq!(
                whole_out, split_out,
                "answers depend on where the input was split"
            );
        }
        // An error in the first part of a split is an error in the whole; an error only the
        // whole sees lies beyond the cut's complete packets and shows up in the second call.
        (Err(w), Err(s)) => assert_eq!(w, s),
        _ => panic!("whole {whole:?} vs split {split:?}"),
    }
});
