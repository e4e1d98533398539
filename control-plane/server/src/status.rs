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
    Status::new(code, e.to_string())
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
    Status::invalid_argument(format!("{field}: {msg}"))
}

/// Decodes a JSON document given in field `field`, bounded by `limit` bytes.
pub fn decode_json<T: serde::de::DeserializeOwned>(field: &str, text: &str, limit: usize) -> Result<T, Status> {
    if text.len() > limit {
        return Err(Status::resource_exhausted(format!(
            "{field}: {} bytes is over the limit of {limit} bytes",
            text.len()
        )));
    }
    let de = &mut serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        if path.is_empty() || path == "." {
            invalid(field, e.into_inner())
        } else {
            invalid(&format!("{field}.{path}"), e.into_inner())
        }
    })
}

/// At most the first 64 characters of `s`, for an error message (then `…` and the full size):
/// an error never copies unbounded input back to the caller.
pub fn prefix(s: &str) -> String {
    const MAX: usize = 64;
    match s.char_indices().nth(MAX) {
        None => s.to_owned(),
        Some((at, _)) => format!("{}…({} bytes)", &s[..at], s.len()),
    }
}
