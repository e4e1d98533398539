//! The replicated state's `Command` JSON decoder (suanli-state's command envelope), which every
//! server runs on every log entry it applies. Properties: decoding never panics; a command that
//! decodes encodes (`encode_command`) to JSON that decodes to the same command; applying it to
//! a fresh state never panics and leaves the state's invariants intact.
#![no_main]

use libfuzzer_sys::fuzz_target;
use suanli_state::{Command, State, encode_command};

fuzz_target!(|data: &[u8]| {
    let Ok(cmd) = serde_json::from_slice::<Command>(data) else { return };
    let text = encode_command(&cmd).expect("a decoded command encodes");
    let back: Command = serde_json::from_slice(&text).expect("an encoded command decodes");
    assert_eq!(back, cmd);
    if cmd.unsupported_kind().is_some() {
        // A replica halts before such a command (suanli-raft's `Machine::check`).
        return;
    }
    let mut state = State::default();
    let _ = state.apply(cmd);
    if let Err(v) = state.invariants() {
        panic!("a command broke the state's invariants: {v:?}");
    }
});
