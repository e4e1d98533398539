//! What a call can fail with.

use std::time::Duration;
use tonic::{Code, Status};

/// A failed client call. `Display` is `<GRPC_CODE>: <message>` for answers from a server, so
/// a CLI can print it as it is.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The connection was configured wrongly (no address, an address that does not parse).
    #[error("{field}: {message}")]
    Config {
        /// The setting (`--server`, `agent_addr`).
        field: String,
        /// What is wrong and what would be valid.
        message: String,
    },
    /// A server answered with an error.
    #[error("{}: {}", code_name(.0.code()), .0.message())]
    Status(Box<Status>),
    /// No listed server answered: each was unreachable, unavailable or hung.
    #[error("UNAVAILABLE: no server answered ({})", .failures.join("; "))]
    NoServer {
        /// One line per address tried: `addr: why`.
        failures: Vec<String>,
    },
    /// One address could not be reached (direct calls: a member, an agent).
    #[error("UNAVAILABLE: {addr}: {message}")]
    Connect {
        /// The address.
        addr: String,
        /// Why.
        message: String,
    },
    /// A server answered something this client cannot use (a page token that does not
    /// advance, a result count that does not match the request).
    #[error("the server answered {0}")]
    Protocol(String),
    /// An answer was larger than this client accepts.
    #[error("{what} is larger than {limit} bytes; refusing it")]
    TooLarge {
        /// What was received.
        what: &'static str,
        /// The limit, in bytes.
        limit: u64,
    },
    /// A stream sent nothing for too long.
    #[error("the {what} stream stalled for {after:?}")]
    Stalled {
        /// Which stream.
        what: &'static str,
        /// How long it was silent.
        after: Duration,
    },
}

impl From<Status> for ClientError {
    fn from(s: Status) -> Self {
        ClientError::Status(Box::new(s))
    }
}

impl ClientError {
    /// The gRPC code this error stands for (UNAVAILABLE when no server answered).
    pub fn code(&self) -> Code {
        match self {
            ClientError::Status(s) => s.code(),
            ClientError::NoServer { .. } | ClientError::Connect { .. } => Code::Unavailable,
            ClientError::Config { .. } => Code::InvalidArgument,
            ClientError::Protocol(_) => Code::Internal,
            ClientError::TooLarge { .. } => Code::ResourceExhausted,
            ClientError::Stalled { .. } => Code::DeadlineExceeded,
        }
    }

    /// The server's message, or this error's text.
    pub fn message(&self) -> String {
        match self {
            ClientError::Status(s) => s.message().to_owned(),
            other => other.to_string(),
        }
    }

    /// Whether the same request (same request id) may succeed if sent again: the outcome is
    /// unknown (a transport failure, a timeout, a leader change), not a refusal.
    pub fn is_transient(&self) -> bool {
        matches!(
            self.code(),
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown | Code::Aborted
        )
    }
}

/// The canonical gRPC name of a status code (`NOT_FOUND`).
pub fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}
