//! The frames between the agent and a `suanli plugin-host` child (suanli-device-host's `frame`):
//! a 4-byte length, then one protobuf message. The input is a byte stream read frame by frame,
//! as each side reads its pipe, and each body is decoded as the message that side expects.
//! Properties: reading and decoding never panic and never allocate past the frame limit; a
//! frame that decodes re-encodes (`frame::encode`) to a frame that reads back the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use suanli_device_host::frame::{self, FrameError, MAX_FRAME_LEN};
use suanli_device_host::pb;

fn round_trip<M: Message + Default>(m: &M, what: &'static str) {
    let bytes = frame::encode(m).expect("a decoded frame re-encodes");
    let body = frame::read_sync(&mut bytes.as_slice()).expect("a re-encoded frame reads");
    let back: M = frame::decode(&body, what).expect("a re-encoded frame decodes");
    assert_eq!(back.encode_to_vec(), m.encode_to_vec());
}

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    // At most 64 frames per input: each is at least its 4-byte length.
    for i in 0..64u32 {
        let body = match frame::read_sync(&mut input) {
            Ok(body) => body,
            Err(FrameError::TooLarge(n)) => {
                assert!(n > MAX_FRAME_LEN);
                return;
            }
            Err(_) => return,
        };
        match i % 3 {
            0 => {
                if let Ok(m) = frame::decode::<pb::HostHello>(&body, "HostHello") {
                    round_trip(&m, "HostHello");
                }
            }
            1 => {
                if let Ok(m) = frame::decode::<pb::HostRequest>(&body, "HostRequest") {
                    round_trip(&m, "HostRequest");
                }
            }
            _ => {
                if let Ok(m) = frame::decode::<pb::HostReply>(&body, "HostReply") {
                    round_trip(&m, "HostReply");
                }
            }
        }
    }
});
