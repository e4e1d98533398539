//! Validation errors: each names the field, the bad value and what would be valid.

use thiserror::Error;

/// Bad input found while validating a spec, a node or a queue.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ValidationError {
    /// A number is outside its allowed range.
    #[error("{field}: {value} is out of range; {limit}")]
    OutOfRange {
        /// Dotted path of the field, e.g. `groups[0].resources.cpu_milli`.
        field: String,
        /// The value given.
        value: String,
        /// What would be valid, e.g. "must be at most 1048576".
        limit: String,
    },
    /// A required field is empty or missing.
    #[error("{field}: must not be empty")]
    Empty {
        /// Dotted path of the field.
        field: String,
    },
    /// A field is malformed or inconsistent with another.
    #[error("{field}: {message}")]
    Invalid {
        /// Dotted path of the field.
        field: String,
        /// What is wrong and what would be valid.
        message: String,
    },
}

impl ValidationError {
    /// The dotted path of the offending field.
    pub fn field(&self) -> &str {
        match self {
            Self::OutOfRange { field, .. } | Self::Empty { field } | Self::Invalid { field, .. } => field,
        }
    }
}

/// Checks `value <= max` (and `>= min`), naming the field on failure.
pub(crate) fn check_range<T: PartialOrd + std::fmt::Display>(
    field: impl FnOnce() -> String,
    value: T,
    min: T,
    max: T,
) -> Result<(), ValidationError> {
    if value < min || value > max {
        return Err(ValidationError::OutOfRange {
            field: field(),
            value: value.to_string(),
            limit: format!("must be between {min} and {max}"),
        });
    }
    Ok(())
}

/// Checks a name: non-empty, bounded, printable without whitespace.
pub(crate) fn check_name(field: impl Fn() -> String, name: &str, max_len: usize) -> Result<(), ValidationError> {
    if name.is_empty() {
        return Err(ValidationError::Empty { field: field() });
    }
    if name.len() > max_len {
        return Err(ValidationError::OutOfRange {
            field: field(),
            value: format!("{} bytes", name.len()),
            limit: format!("must be at most {max_len} bytes"),
        });
    }
    if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ValidationError::Invalid {
            field: field(),
            message: format!("{name:?} must not contain whitespace or control characters"),
        });
    }
    Ok(())
}
