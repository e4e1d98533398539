//! Spec documents (jobs, queues, nodes) as `suanli` reads them from files and the servers read
//! them from the API's `*_json` fields: JSON through `suanli_model::input::from_json_str`, TOML
//! parsed into a JSON value (as cli/src/spec.rs does) through `input::from_json_value`, then
//! `validate` with the default limits. Properties: nothing panics; a document that decodes and
//! validates encodes to JSON that decodes (strictly) to the same value and validates again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde::Serialize;
use serde::de::DeserializeOwned;
use suanli_model::{InputError, JobSpec, Limits, Node, Queue, ValidationError, input};

fn check<T>(doc: Result<T, InputError>, validate: impl Fn(&T) -> Result<(), ValidationError>)
where
    T: DeserializeOwned + Serialize + PartialEq + std::fmt::Debug,
{
    let Ok(t) = doc else { return };
    if validate(&t).is_err() {
        return;
    }
    let text = serde_json::to_string(&t).expect("a decoded document encodes");
    let back: T = input::from_json_str(&text).expect("an encoded valid document decodes strictly");
    assert_eq!(back, t);
    validate(&back).expect("a valid document stays valid through JSON");
}

fn decode<T: DeserializeOwned>(toml_syntax: bool, text: &str) -> Result<T, InputError> {
    if toml_syntax {
        // cli/src/spec.rs: a TOML file is parsed into a table, then into a JSON value.
        let table: toml::Table =
            toml::from_str(text).map_err(|e| InputError { field: String::new(), message: e.to_string() })?;
        let value =
            serde_json::to_value(table).map_err(|e| InputError { field: String::new(), message: e.to_string() })?;
        input::from_json_value(value)
    } else {
        input::from_json_str(text)
    }
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks the syntax (bit 0: TOML) and the document (job, queue, node).
    let Some((&which, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let limits = Limits::default();
    let toml_syntax = which & 1 == 1;
    match (which >> 1) % 3 {
        0 => check(decode::<JobSpec>(toml_syntax, text), |s| s.validate(&limits)),
        1 => check(decode::<Queue>(toml_syntax, text), |q| q.validate(&limits)),
        _ => check(decode::<Node>(toml_syntax, text), |n| n.validate(&limits)),
    }
});
