//! Runtime fault injection for the chaos harness (cargo feature `failpoints`).
//!
//! The points themselves live where the faults happen: `raft::fsync` and `raft::skip-fsync` in
//! the raft log store (`suanli_raft`, see `durable` in store.rs), `state::double-assign` in the
//! state machine. They are armed with the `fail` crate's action syntax (`return`,
//! `return(msg)`, `sleep(ms)`, `N%return`, `off`, ...):
//!
//! - `SUANLI_FAILPOINTS="raft::fsync=sleep(200);state::double-assign=return"`: armed at start;
//! - `SUANLI_FAILPOINTS_FILE=/path`: one `name=actions` per line (`#` comments), re-read every
//!   100 ms; a point that leaves the file is disarmed. This is how the harness turns a disk
//!   fault on and off in a running server.
//!
//! A build without the feature has no points: setting either variable only logs a warning. The
//! release binary (`cargo build --release -p suanli`) never has them; a workspace build does,
//! because the chaos crate asks for the feature, and they stay inert until armed.

#[cfg(feature = "failpoints")]
mod imp {
    use std::collections::BTreeMap;
    use std::path::PathBuf;
    use std::time::Duration;

    fn parse(text: &str) -> BTreeMap<String, String> {
        text.split([';', '\n'])
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .filter(|l| !l.is_empty())
            .filter_map(|l| l.split_once('='))
            .map(|(n, a)| (n.trim().to_owned(), a.trim().to_owned()))
            .collect()
    }

    fn set(points: &BTreeMap<String, String>, origin: &str) {
        for (name, actions) in points {
            match fail::cfg(name.clone(), actions) {
                Ok(()) => tracing::warn!(%name, %actions, %origin, "FAILPOINT ARMED: this server injects faults"),
                Err(e) => tracing::error!(%name, %actions, %origin, error = %e, "bad failpoint actions; ignored"),
            }
        }
    }

    pub fn arm() {
        if let Ok(v) = std::env::var("SUANLI_FAILPOINTS") {
            set(&parse(&v), "SUANLI_FAILPOINTS");
        }
        let Some(path) = std::env::var_os("SUANLI_FAILPOINTS_FILE").map(PathBuf::from) else { return };
        let spawned = std::thread::Builder::new().name("failpoints".into()).spawn(move || {
            let mut current: BTreeMap<String, String> = BTreeMap::new();
            loop {
                let next = std::fs::read_to_string(&path).map(|t| parse(&t)).unwrap_or_default();
                if next != current {
                    for name in current.keys().filter(|n| !next.contains_key(*n)) {
                        fail::remove(name);
                        tracing::warn!(%name, "failpoint disarmed");
                    }
                    let changed: BTreeMap<_, _> = next
                        .iter()
                        .filter(|(n, a)| current.get(*n) != Some(a))
                        .map(|(n, a)| (n.clone(), a.clone()))
                        .collect();
                    set(&changed, "SUANLI_FAILPOINTS_FILE");
                    current = next;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot watch SUANLI_FAILPOINTS_FILE");
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn parses_lines_and_semicolons() {
            let p = super::parse("a=return\n# c\n b = sleep(5) ; bad\nc=off # x");
            assert_eq!(p.len(), 3);
            assert_eq!(p.get("b").map(String::as_str), Some("sleep(5)"));
        }
    }
}

/// Arms the failpoints named by `SUANLI_FAILPOINTS` and starts watching
/// `SUANLI_FAILPOINTS_FILE` (once per process).
#[cfg(feature = "failpoints")]
pub fn arm() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(imp::arm);
}

/// This build has no failpoints: warns when asked for some.
#[cfg(not(feature = "failpoints"))]
pub fn arm() {
    if std::env::var_os("SUANLI_FAILPOINTS").is_some() || std::env::var_os("SUANLI_FAILPOINTS_FILE").is_some() {
        tracing::warn!("SUANLI_FAILPOINTS is set but this build has no failpoints (cargo feature `failpoints`)");
    }
}
