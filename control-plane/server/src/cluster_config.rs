//! `Cluster.SetConfig`'s merge: field changes written as JSON, applied to the replicated
//! configuration ([`StateConfig`]) the leader holds, checked before anything is proposed.
//!
//! A field is named by its path in the configuration's JSON form (`checkpoint_store`,
//! `default_retry.max_attempts`, `limits.max_name_len`). Pure: no state, no I/O; the handler
//! reads the current configuration and proposes the result as `UpdateConfig`.

use crate::status::invalid;
use serde_json::Value;
use std::collections::BTreeMap;
use suanli_model::error::quote;
use suanli_state::StateConfig;
use tonic::Status;

/// Most fields one `SetConfig` call changes (the configuration has fewer).
pub const MAX_FIELDS: usize = 64;

/// URL schemes a checkpoint store may use (those `object_store::parse_url` opens).
const STORE_SCHEMES: [&str; 11] = ["file", "s3", "s3a", "gs", "az", "adl", "azure", "abfs", "abfss", "http", "https"];

/// `current` with every `path -> JSON value` of `set` applied, validated. An unknown field,
/// text that is not JSON, a value of the wrong type or out of bounds is INVALID_ARGUMENT
/// naming the field (`set.<path>`).
pub fn merge(current: &StateConfig, set: &BTreeMap<String, String>) -> Result<StateConfig, Status> {
    if set.is_empty() {
        return Err(invalid("set", "names no field; give at least one FIELD=VALUE"));
    }
    if set.len() > MAX_FIELDS {
        return Err(invalid("set", format!("{} fields; the limit is {MAX_FIELDS} per call", set.len())));
    }
    let mut doc = serde_json::to_value(current).map_err(|e| Status::internal(format!("encoding the config: {e}")))?;
    for (path, text) in set {
        let field = format!("set.{path}");
        let value: Value = serde_json::from_str(text).map_err(|e| {
            invalid(&field, format!("{} is not JSON ({e}); write a string in double quotes", quote(text)))
        })?;
        let slot = lookup(&mut doc, path).ok_or_else(|| {
            let known = field_names(&serde_json::to_value(current).unwrap_or(Value::Null));
            invalid(
                &field,
                format!(
                    "unknown field; the top-level fields are {} (`suanli cluster config get` lists every one)",
                    known.join(", ")
                ),
            )
        })?;
        *slot = value;
    }
    let config: StateConfig = serde_path_to_error::deserialize(doc).map_err(|e| {
        let at = e.path().to_string();
        invalid(&format!("set.{at}"), e.into_inner())
    })?;
    config.validate().map_err(|e| {
        // The default retry policy's own checks name it `retry`.
        let field = e.field.strip_prefix("retry.").map_or(e.field.clone(), |f| format!("default_retry.{f}"));
        invalid(&format!("set.{field}"), format!("{} is invalid; {}", e.value, e.expected))
    })?;
    check_store(&config)?;
    Ok(config)
}

/// The value at a dotted `path` of a JSON object, if every part names a field that exists.
fn lookup<'a>(doc: &'a mut Value, path: &str) -> Option<&'a mut Value> {
    path.split('.').try_fold(doc, |v, part| v.as_object_mut()?.get_mut(part))
}

/// The configuration's top-level field names, sorted (nested ones are `name.field`).
fn field_names(doc: &Value) -> Vec<String> {
    let mut out: Vec<String> = doc.as_object().map(|m| m.keys().cloned().collect()).unwrap_or_default();
    out.sort();
    out
}

/// `checkpoint_store`: empty, or a URL with a scheme agents can open, within `max_uri_len`.
fn check_store(c: &StateConfig) -> Result<(), Status> {
    let url = &c.checkpoint_store;
    if url.is_empty() {
        return Ok(());
    }
    if url.len() > c.max_uri_len {
        return Err(invalid(
            "set.checkpoint_store",
            format!("{} bytes is over max_uri_len ({} bytes)", url.len(), c.max_uri_len),
        ));
    }
    let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
    if !STORE_SCHEMES.contains(&scheme) || url.chars().any(char::is_control) {
        return Err(invalid(
            "set.checkpoint_store",
            format!("{} is not a URL of scheme {} (e.g. file:///shared/ckpt, s3://bucket/prefix)", quote(url), {
                STORE_SCHEMES.join(", ")
            }),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn refused(kv: &[(&str, &str)]) -> String {
        let e = merge(&StateConfig::default(), &set(kv)).expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        e.message().to_owned()
    }

    #[test]
    fn fields_top_level_and_nested_are_set_and_the_rest_kept() {
        let c = merge(
            &StateConfig::default(),
            &set(&[
                ("checkpoint_store", r#""file:///tmp/ckpt""#),
                ("avoid_failed_node_s", "60"),
                ("default_retry.max_attempts", "5"),
            ]),
        )
        .expect("merged");
        assert_eq!(c.checkpoint_store, "file:///tmp/ckpt");
        assert_eq!(c.avoid_failed_node_s, 60);
        assert_eq!(c.default_retry.max_attempts, 5);
        assert_eq!(c.max_live_jobs, StateConfig::default().max_live_jobs);
        let cleared = merge(&c, &set(&[("checkpoint_store", r#""""#)])).expect("cleared");
        assert_eq!(cleared.checkpoint_store, "");
    }

    #[test]
    fn bad_changes_are_refused_naming_the_field() {
        assert!(refused(&[("no_such", "1")]).starts_with("set.no_such: unknown field"));
        assert!(refused(&[("limits.nope", "1")]).starts_with("set.limits.nope: unknown field"));
        assert!(refused(&[("checkpoint_store", "s3://b")]).starts_with("set.checkpoint_store: "), "not JSON");
        let m = refused(&[("avoid_failed_node_s", r#""soon""#)]);
        assert!(m.starts_with("set.avoid_failed_node_s: invalid type"), "{m}");
        let m = refused(&[("max_live_jobs", "0")]);
        assert!(m.starts_with("set.max_live_jobs: 0 is invalid; must be between 1"), "{m}");
        let m = refused(&[("checkpoint_store", r#""ftp://x/y""#)]);
        assert!(m.starts_with("set.checkpoint_store: "), "{m}");
        assert!(refused(&[]).starts_with("set: "));
    }

    #[test]
    fn the_security_bounds_are_shown_and_set_like_the_others() {
        let shown = serde_json::to_value(StateConfig::default()).expect("encodes");
        assert_eq!(shown["audit_retention"], 100_000);
        assert_eq!(shown["max_tokens"], 10_000);
        let c =
            merge(&StateConfig::default(), &set(&[("audit_retention", "500"), ("max_tokens", "20")])).expect("merged");
        assert_eq!((c.audit_retention, c.max_tokens), (500, 20));
        let m = refused(&[("audit_retention", "0")]);
        assert!(m.starts_with("set.audit_retention: 0 is invalid; must be between 1 and 10000000"), "{m}");
        let m = refused(&[("max_tokens", "1000001")]);
        assert!(m.starts_with("set.max_tokens: 1000001 is invalid; must be between 1 and 1000000"), "{m}");
        let m = refused(&[("max_tokens", "-1")]);
        assert!(m.starts_with("set.max_tokens: invalid value"), "{m}");
    }
}
