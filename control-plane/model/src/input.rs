//! The one strict path for documents users write: job specs, queues and nodes, whether the
//! CLI reads them from files or a server reads them from the API's `*_json` fields.
//!
//! ```text
//!   JSON text / JSON value ──decode──▶ T      unknown field   ─▶ InputError{field: "groups[0].replica"}
//!                                             wrong type, missing field, bad enum ─▶ InputError{field, message}
//! ```
//!
//! The model's types themselves accept (and drop) unknown fields, because the same types are
//! stored in the replicated log and in snapshots, where fields added by a newer server must
//! stay readable by an older one. Strictness therefore lives here, at the input boundary only:
//! the decoder records every field serde would ignore and refuses the document, naming the
//! first one. Paths and messages are bounded, so an error never copies unbounded input.

use serde::{Deserialize, Deserializer};
use std::fmt;

/// Longest field path an error names, in bytes (longer paths are cut).
const MAX_PATH_BYTES: usize = 256;
/// Longest decoder message an error carries, in bytes (longer messages are cut).
const MAX_MESSAGE_BYTES: usize = 256;

/// Why a document was refused: the dotted path of the field (empty for the document itself)
/// and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputError {
    /// Dotted path, e.g. `groups[0].resources.gpus`; empty when the whole document is bad.
    pub field: String,
    /// What is wrong, e.g. "unknown field" or "invalid type: string \"8\", expected u64".
    pub message: String,
}

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() { f.write_str(&self.message) } else { write!(f, "{}: {}", self.field, self.message) }
    }
}

impl std::error::Error for InputError {}

/// What an unknown field's error says.
pub const UNKNOWN_FIELD: &str = "unknown field; it is not part of this table (a misspelled field is refused, \
                                 not ignored; see docs/job-spec.md)";

/// Decodes `T` from `d` strictly: an unknown field anywhere is an error naming its path.
pub fn decode<'de, D, T>(d: D) -> Result<T, InputError>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    let mut unknown: Option<String> = None;
    let mut note = |p: serde_ignored::Path<'_>| {
        if unknown.is_none() {
            let mut s = String::new();
            path_string(&p, &mut s);
            unknown = Some(s);
        }
    };
    let decoded: Result<T, _> = serde_path_to_error::deserialize(serde_ignored::Deserializer::new(d, &mut note));
    match decoded {
        Err(e) => {
            let path = e.path().to_string();
            let mut field = if path == "." { String::new() } else { path };
            let mut message = e.into_inner().to_string();
            // serde names a missing field in its message, at the path of the table that lacks
            // it: name the field itself instead.
            if let Some(name) = message.strip_prefix("missing field `").and_then(|m| m.split('`').next()) {
                field = if field.is_empty() { name.to_owned() } else { format!("{field}.{name}") };
                message = "missing required field".into();
            }
            Err(InputError { field: cut(&field, MAX_PATH_BYTES), message: cut(&message, MAX_MESSAGE_BYTES) })
        }
        Ok(_) if unknown.is_some() => {
            Err(InputError { field: cut(&unknown.unwrap_or_default(), MAX_PATH_BYTES), message: UNKNOWN_FIELD.into() })
        }
        Ok(t) => Ok(t),
    }
}

/// Decodes `T` from JSON text strictly (see [`decode`]).
pub fn from_json_str<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, InputError> {
    let mut de = serde_json::Deserializer::from_str(text);
    let t = decode(&mut de)?;
    de.end().map_err(|e| InputError { field: String::new(), message: cut(&e.to_string(), MAX_MESSAGE_BYTES) })?;
    Ok(t)
}

/// Decodes `T` from a parsed JSON value strictly (see [`decode`]); the CLI parses TOML or
/// JSON files into a value first.
pub fn from_json_value<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, InputError> {
    decode(v)
}

/// Writes a serde_ignored path as `a.b[0].c` (map keys that are long or unprintable are quoted
/// by a bounded prefix).
fn path_string(p: &serde_ignored::Path<'_>, out: &mut String) {
    use serde_ignored::Path;
    match p {
        Path::Root => {}
        Path::Seq { parent, index } => {
            path_string(parent, out);
            out.push_str(&format!("[{index}]"));
        }
        Path::Map { parent, key } => {
            path_string(parent, out);
            let p = crate::error::key_path(out, key);
            *out = p.strip_prefix('.').map(str::to_owned).unwrap_or(p);
        }
        Path::Some { parent } | Path::NewtypeStruct { parent } | Path::NewtypeVariant { parent } => {
            path_string(parent, out)
        }
    }
}

/// At most `max` bytes of `s` (on a character boundary), marked with `…` when cut.
fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…({} bytes)", &s[..end], s.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{JobSpec, Queue};

    const JOB: &str = r#"{"name":"j","queue":"q","groups":[{"name":"g","replicas":2,"resources":{"cpu_milli":1}}]}"#;

    #[test]
    fn a_valid_document_decodes() {
        let j: JobSpec = from_json_str(JOB).expect("valid");
        assert_eq!(j.groups[0].replicas, 2);
    }

    #[test]
    fn unknown_fields_are_refused_naming_their_path() {
        let typo = JOB.replace("\"replicas\":2", "\"replica\":2");
        let e = from_json_str::<JobSpec>(&typo).expect_err("replica is not a field");
        assert_eq!(e.field, "groups[0].replica");
        assert!(e.message.starts_with("unknown field"), "{e}");

        let gpus = JOB.replace("\"cpu_milli\":1", "\"cpu_milli\":1,\"gpus\":4");
        assert_eq!(from_json_str::<JobSpec>(&gpus).map_err(|e| e.field), Err("groups[0].resources.gpus".into()));

        let top = JOB.replacen('{', "{\"gpus\":4,", 1);
        assert_eq!(from_json_str::<JobSpec>(&top).map_err(|e| e.field), Err("gpus".into()));

        let q = r#"{"id":"q","weigth":3}"#;
        assert_eq!(from_json_str::<Queue>(q).map_err(|e| e.field), Err("weigth".into()));
        let v: serde_json::Value = serde_json::from_str(r#"{"id":"q","nominal":{"gpus":3}}"#).expect("json");
        assert_eq!(from_json_value::<Queue>(v).map_err(|e| e.field), Err("nominal.gpus".into()));
    }

    #[test]
    fn errors_are_bounded() {
        let long_key = "k".repeat(1 << 20);
        let doc = JOB.replacen('{', &format!("{{\"{long_key}\":1,"), 1);
        let e = from_json_str::<JobSpec>(&doc).expect_err("unknown long key");
        assert!(e.to_string().len() < 1024, "{} bytes", e.to_string().len());
        assert!(e.field.contains("1048576 bytes"), "{}", e.field);

        let long_kind = JOB.replace("\"name\":\"j\"", &format!("\"name\":\"j\",\"kind\":\"{}\"", "x".repeat(1 << 20)));
        let e = from_json_str::<JobSpec>(&long_kind).expect_err("unknown kind");
        assert_eq!(e.field, "kind");
        assert!(e.to_string().len() < 1024, "{} bytes", e.to_string().len());

        let e = from_json_str::<JobSpec>(&format!("{JOB} trailing")).expect_err("trailing");
        assert_eq!(e.field, "");
    }

    #[test]
    fn missing_fields_are_named() {
        let e = from_json_str::<JobSpec>(r#"{"name":"j","queue":"q"}"#).expect_err("no groups");
        assert_eq!((e.field.as_str(), e.message.as_str()), ("groups", "missing required field"));
        let e = from_json_str::<JobSpec>(&JOB.replace("\"name\":\"g\",", "")).expect_err("no group name");
        assert_eq!(e.field, "groups[0].name");
    }

    #[test]
    fn type_errors_name_the_field() {
        let neg = JOB.replace("\"cpu_milli\":1", "\"cpu_milli\":-1");
        let e = from_json_str::<JobSpec>(&neg).expect_err("negative");
        assert_eq!(e.field, "groups[0].resources.cpu_milli");
        assert!(e.message.contains("-1"), "{e}");
    }
}
