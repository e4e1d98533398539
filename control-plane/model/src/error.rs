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

/// How many bytes of a bad value an error message quotes: a message never copies unbounded
/// input (a 1 MB name would not fit a gRPC status header).
pub const QUOTE_MAX_BYTES: usize = 64;

/// Quotes `s` for an error message: the whole value (escaped) when it is at most
/// [`QUOTE_MAX_BYTES`] bytes, else its first bytes (on a character boundary) then `…(N bytes)`.
pub fn quote(s: &str) -> String {
    if s.len() <= QUOTE_MAX_BYTES {
        return format!("{s:?}");
    }
    let mut end = QUOTE_MAX_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}…({} bytes)", &s[..end], s.len())
}

/// The path of a map entry: `at.key` for a short printable key, else `at[<quoted prefix>]`,
/// so a field path never copies unbounded or unprintable input.
pub fn key_path(at: &str, key: &str) -> String {
    if !key.is_empty() && key.len() <= QUOTE_MAX_BYTES && bad_char(key, false).is_none() {
        format!("{at}.{key}")
    } else {
        format!("{at}[{}]", quote(key))
    }
}

/// Bidi overrides, embeddings and isolates and the directional marks: text that displays in
/// another order than it is stored (U+202A–U+202E, U+2066–U+2069, U+200E, U+200F).
pub fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{200E}' | '\u{200F}')
}

/// Zero-width and invisible characters that make two names look equal (`defa\u{200B}ult`):
/// U+200B–U+200D, U+2060, U+FEFF.
pub fn is_invisible(c: char) -> bool {
    matches!(c, '\u{200B}'..='\u{200D}' | '\u{2060}' | '\u{FEFF}')
}

/// The first character text may not hold, and what it is. Control characters (C0, DEL, C1)
/// are refused everywhere; whitespace too unless `spaces` (then plain U+0020 is allowed).
fn bad_char(s: &str, spaces: bool) -> Option<(char, &'static str)> {
    s.chars().find_map(|c| {
        if c.is_control() {
            Some((c, "a control character"))
        } else if is_bidi_control(c) {
            Some((c, "a bidi control character"))
        } else if is_invisible(c) {
            Some((c, "a zero-width or invisible character"))
        } else if c.is_whitespace() && !(spaces && c == ' ') {
            Some((c, "whitespace"))
        } else {
            None
        }
    })
}

/// Checks a length bound, naming the field and the limit without quoting the value.
fn check_len(field: &impl Fn() -> String, s: &str, max_len: usize) -> Result<(), ValidationError> {
    if s.len() > max_len {
        return Err(ValidationError::OutOfRange {
            field: field(),
            value: format!("{} bytes", s.len()),
            limit: format!("must be at most {max_len} bytes"),
        });
    }
    Ok(())
}

fn check_chars(field: &impl Fn() -> String, s: &str, spaces: bool, what: &str) -> Result<(), ValidationError> {
    if let Some((c, kind)) = bad_char(s, spaces) {
        return Err(ValidationError::Invalid {
            field: field(),
            message: format!("{} contains {kind} (U+{:04X}); {what}", quote(s), u32::from(c)),
        });
    }
    Ok(())
}

const NAME_RULE: &str = "a name may not contain whitespace, control, bidi or zero-width characters";
const TEXT_RULE: &str = "text may not contain control, bidi or zero-width characters";

/// Checks a name or id: non-empty, at most `max_len` bytes, no whitespace, control, bidi or
/// zero-width characters. The message quotes at most a bounded prefix of the value.
pub fn check_name(field: impl Fn() -> String, name: &str, max_len: usize) -> Result<(), ValidationError> {
    if name.is_empty() {
        return Err(ValidationError::Empty { field: field() });
    }
    check_len(&field, name, max_len)?;
    check_chars(&field, name, false, NAME_RULE)
}

/// As [`check_name`], but the empty string is allowed (an optional name such as a queue's
/// `team` or a node's `region`).
pub fn check_optional_name(field: impl Fn() -> String, name: &str, max_len: usize) -> Result<(), ValidationError> {
    if name.is_empty() { Ok(()) } else { check_name(field, name, max_len) }
}

/// Checks a short value (a label value, a device model such as `NVIDIA H100 80GB HBM3`): at
/// most `max_len` bytes, may be empty and may hold plain spaces, but no other whitespace and
/// no control, bidi or zero-width characters.
pub fn check_value(field: impl Fn() -> String, value: &str, max_len: usize) -> Result<(), ValidationError> {
    check_len(&field, value, max_len)?;
    check_chars(&field, value, true, TEXT_RULE)
}

/// Checks free text (a cancel reason): at most `max_len` bytes, plain spaces allowed, no
/// control characters (not even newlines or tabs), no bidi or zero-width characters, so it
/// prints safely on a terminal.
pub fn check_text(field: impl Fn() -> String, text: &str, max_len: usize) -> Result<(), ValidationError> {
    check_value(field, text, max_len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{JobSpec, Limits, Node, Queue, ResVec};

    fn field(f: &str) -> impl Fn() -> String + '_ {
        move || f.to_owned()
    }

    #[test]
    fn names_refuse_invisible_bidi_control_and_whitespace() {
        for bad in
            ["defa\u{200b}ult", "a\u{202e}b", "a\u{2066}b", "x\u{200f}", "\u{feff}q", "a\u{1b}[31m", "a b", "a\tb"]
        {
            let e = check_name(field("queue.id"), bad, 253).expect_err(bad);
            assert_eq!(e.field(), "queue.id");
            assert!(e.to_string().contains("U+"), "{e}");
        }
        assert_eq!(check_name(field("f"), "team-a_1.x", 253), Ok(()));
        assert_eq!(check_name(field("f"), "ünï", 253), Ok(()));
        assert_eq!(check_optional_name(field("f"), "", 253), Ok(()));
        assert!(matches!(check_name(field("f"), "", 253), Err(ValidationError::Empty { .. })));
    }

    #[test]
    fn values_and_text_allow_spaces_but_no_controls() {
        assert_eq!(check_value(field("m"), "NVIDIA H100 80GB HBM3", 253), Ok(()));
        assert_eq!(check_value(field("m"), "", 253), Ok(()));
        assert!(check_value(field("m"), "a\u{200d}b", 253).is_err());
        assert_eq!(check_text(field("reason"), "no longer needed", 1024), Ok(()));
        for bad in ["line\nbreak", "tab\t", "bell\u{7}", "csi\u{9b}", "\u{2069}"] {
            assert!(check_text(field("reason"), bad, 1024).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn long_values_are_named_by_size_not_copied() {
        let mb = "x".repeat(1 << 20);
        let e = check_name(field("queue.team"), &mb, 253).expect_err("too long");
        assert_eq!(e.to_string(), "queue.team: 1048576 bytes is out of range; must be at most 253 bytes");
        let bad = format!("{}\u{1}", "é".repeat(1 << 19));
        let e = check_value(field("v"), &bad, usize::MAX).expect_err("control");
        assert!(e.to_string().len() < 300, "{}", e.to_string().len());
        assert!(e.to_string().contains("(1048577 bytes)"), "{e}");
        assert_eq!(quote("short"), "\"short\"");
        assert_eq!(key_path("labels", "k"), "labels.k");
        assert!(key_path("labels", &mb).len() < 100);
        assert!(key_path("labels", "a\u{202e}").starts_with("labels[\""));
    }

    #[test]
    fn every_named_field_is_checked() {
        let limits = Limits::default();
        let mb = "x".repeat(1 << 20);
        let mut q = Queue::new("q", ResVec::ZERO);
        q.team = mb.clone();
        assert_eq!(q.validate(&limits).map_err(|e| e.field().to_owned()), Err("queue.team".into()));
        let mut q = Queue::new("q", ResVec::ZERO);
        q.cohort = Some("c\u{7}".into());
        assert_eq!(q.validate(&limits).map_err(|e| e.field().to_owned()), Err("queue.cohort".into()));

        let job = r#"{"name":"j","queue":"q","groups":[{"name":"g","resources":{"cpu_milli":1}}]}"#;
        let spec: JobSpec = crate::input::from_json_str(job).expect("valid");
        assert_eq!(spec.validate(&limits), Ok(()));
        type Set = fn(&mut JobSpec, String);
        let cases: [(&str, Set); 4] = [
            ("constraints.pools[0]", |s, v| s.constraints.pools.push(v.as_str().into())),
            ("constraints.device_models[0]", |s, v| s.constraints.device_models.push(v)),
            ("constraints.labels.k", |s, v| {
                s.constraints.labels.insert("k".into(), v);
            }),
            ("constraints.regions[0]", |s, v| s.constraints.regions.push(v)),
        ];
        for (path, set) in cases {
            let mut s = spec.clone();
            set(&mut s, mb.clone());
            assert_eq!(s.validate(&limits).map_err(|e| e.field().to_owned()), Err(path.to_owned()));
        }

        let node = r#"{"id":"n","pool":"p","cpu_milli":1,"memory_mib":1,
                       "devices":[{"id":"0","kind":"gpu","model":"NVIDIA H100 80GB HBM3"}]}"#;
        let n: Node = crate::input::from_json_str(node).expect("valid");
        assert_eq!(n.validate(&limits), Ok(()));
        let mut bad = n.clone();
        bad.devices[0].model = mb.clone();
        assert_eq!(bad.validate(&limits).map_err(|e| e.field().to_owned()), Err("node.devices[0].model".into()));
        let mut bad = n.clone();
        bad.pool = "p\u{200b}".into();
        assert_eq!(bad.validate(&limits).map_err(|e| e.field().to_owned()), Err("node.pool".into()));
        let mut bad = n;
        bad.labels.insert("k\u{1b}".into(), "v".into());
        assert!(bad.validate(&limits).map_err(|e| e.field().to_owned()).is_err_and(|f| f.starts_with("node.labels[")));
    }
}
