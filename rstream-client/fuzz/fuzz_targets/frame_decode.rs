//! Feeds arbitrary bytes to the frame decoder: it must return frames, "incomplete" or a typed error,
//! never panic, and re-encoding a decoded frame must decode to the same message.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use rstream_client::frame;

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::from(data);
    while let Ok(Some(message)) = frame::decode(&mut buf) {
        if let Ok(encoded) = frame::encode(&message) {
            let mut again = BytesMut::from(&encoded[..]);
            assert_eq!(frame::decode(&mut again).ok().flatten(), Some(message));
        }
    }
});
