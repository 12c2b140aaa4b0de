//! Fuzz target for the state directory's record decoder and loader
//! (crates/sluice/src/state/{record,store,image}.rs): the bytes a state file hands back after
//! a crash, a torn write or a damaged disk.
//!
//! Checks, besides "no panic": a body that decodes re-encodes and decodes to an equal record
//! (a message's MQTT 5 PUBLISH may re-encode to other bytes, e.g. a longer varint, so the
//! check is on the record); the same bytes read as a run of frames apply to an image without
//! panicking, and that image's snapshot (`to_records`) rebuilds an equal image.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use sluice::state::image::{Bounds, Image};
use sluice::state::record::Record;
use sluice::state::store::apply_frames;

fuzz_target!(|data: &[u8]| {
    if let Ok(record) = Record::decode(data) {
        let mut out = BytesMut::new();
        record.encode(&mut out);
        assert_eq!(
            Record::decode(&out).as_ref(),
            Ok(&record),
            "decode/encode/decode differs"
        );
    }
    let bounds = Bounds {
        max_retained_messages: 64,
        max_retained_bytes: 1 << 20,
        max_sessions: 16,
        max_queued_messages: 64,
        max_subscriptions: 64,
    };
    let mut image = Image::new(bounds);
    let _ = apply_frames(&mut image, data);
    let mut again = Image::new(bounds);
    image.to_records(|r| again.apply(r));
    assert!(again == image, "a snapshot does not rebuild its image");
});
