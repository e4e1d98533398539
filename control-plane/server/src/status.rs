//! Mapping refusals to gRPC statuses. Every message names the field and, where there is one,
//! the limit; the state is unchanged whenever an error is returned.

use crate::core::LEADER_HEADER;
use suanli_state::CommandError;
use tonic::{Code, Status};

/// The status for a command the state machine (or the size check) refused.
pub fn rejection(e: &CommandError) -> Status {
    let code = match e {
        CommandError::Invalid { .. } => Code::InvalidArgument,
        CommandError::TooLarge { .. } | CommandError::TooMany { .. } => Code::ResourceExhausted,
        CommandError::UnknownQueue { .. }
        | CommandError::UnknownJob { .. }
        | CommandError::UnknownNode { .. }
        | CommandError::UnknownDevice { .. }
        | CommandError::UnknownAlloc { .. } => Code::NotFound,
        CommandError::StaleEpoch { .. } | CommandError::Conflict { .. } => Code::FailedPrecondition,
    };
    Status::new(code, bounded(e.to_string()))
}

/// Longest status message the server sends, in bytes. Messages name fields and quote at most
/// a bounded prefix of bad values already; this is the last guard, so no answer can overflow a
/// client's metadata limit (16 KB by default, and percent-encoding may triple the bytes).
pub const MAX_MESSAGE_BYTES: usize = 512;

/// `msg`, cut to [`MAX_MESSAGE_BYTES`] (on a character boundary) and marked when cut.
pub fn bounded(msg: String) -> String {
    if msg.len() <= MAX_MESSAGE_BYTES {
        return msg;
    }
    let mut end = MAX_MESSAGE_BYTES - 64;
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…(message cut at {end} of {} bytes)", &msg[..end], msg.len())
}

/// UNAVAILABLE, naming the leader's address in the `suanli-leader` metadata when known.
pub fn unavailable(msg: &str, leader: Option<String>) -> Status {
    let mut s = Status::unavailable(msg.to_owned());
    if let Some(addr) = leader
        && let Ok(v) = addr.parse()
    {
        s.metadata_mut().insert(LEADER_HEADER, v);
    }
    s
}

/// INVALID_ARGUMENT for a field.
pub fn invalid(field: &str, msg: impl std::fmt::Display) -> Status {
    Status::invalid_argument(bounded(format!("{field}: {msg}")))
}

/// INVALID_ARGUMENT for a value the model's rules refused (the error names the field).
pub fn invalid_model(e: &suanli_model::ValidationError) -> Status {
    Status::invalid_argument(bounded(e.to_string()))
}

/// Decodes a JSON document given in field `field`, bounded by `limit` bytes, through the
/// model's one strict input path ([`suanli_model::input`]): an unknown field is refused, named
/// by its path (`spec_json.groups[0].replica`).
pub fn decode_json<T: serde::de::DeserializeOwned>(field: &str, text: &str, limit: usize) -> Result<T, Status> {
    if text.len() > limit {
        return Err(Status::resource_exhausted(format!(
            "{field}: {} bytes is over the limit of {limit} bytes",
            text.len()
        )));
    }
    suanli_model::input::from_json_str(text).map_err(|e| {
        if e.field.is_empty() { invalid(field, e.message) } else { invalid(&format!("{field}.{}", e.field), e.message) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_bounded() {
        let s = invalid("x", "y".repeat(1 << 20));
        assert!(s.message().len() <= MAX_MESSAGE_BYTES, "{}", s.message().len());
        assert!(s.message().starts_with("x: yyy"), "{}", &s.message()[..10]);
        let e = CommandError::Invalid { field: "f".into(), message: "é".repeat(1 << 19) };
        assert!(rejection(&e).message().len() <= MAX_MESSAGE_BYTES);
        assert_eq!(bounded("short".into()), "short");
    }
}
