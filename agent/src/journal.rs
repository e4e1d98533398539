//! The task journal, `<data_dir>/journal.jsonl`: the node's own record of what actually ran,
//! whatever the control plane believes. Task shims append to it (they are the tasks' parents
//! and outlive agent restarts); anyone may read it, e.g. the chaos harness checking that no
//! task ran twice at once.
//!
//! ```text
//!  shim: spawn(command) ok ─▶ {"event":"start", identity, devices, "at_ms", "pid"}
//!        wait(command)     ─▶ {"event":"stop",  identity, devices, "at_ms", "exit_code", "signal", "fenced"}
//!                          ─▶ exit.json
//! ```
//!
//! One JSON object per line. Each line is appended with a single `write(2)` on a file opened
//! with `O_APPEND | O_CREAT`, so lines of concurrent shims do not interleave; a reader racing a
//! writer, or a writer killed mid-line, can leave a torn last line, which [`read_journal`] skips.

use serde::{Deserialize, Serialize};
use std::io::Write as _;
use std::path::Path;

/// The journal's file name in the agent's data directory.
pub const JOURNAL_FILE: &str = "journal.jsonl";

/// Largest journal read by [`read_journal`] (bytes).
pub const MAX_JOURNAL_BYTES: u64 = 1 << 30;

/// One device share of a task, as in `AllocInfo.devices`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalDevice {
    /// The device id.
    pub device: String,
    /// Its share in thousandths.
    pub milli: u32,
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum JournalEvent {
    /// The command was spawned.
    Start {
        /// Its pid.
        pid: i32,
    },
    /// The command exited (the shim's `wait` returned).
    Stop {
        /// Its exit code, when it exited.
        exit_code: Option<i32>,
        /// The signal that killed it, when one did.
        signal: Option<i32>,
        /// Whether the shim signalled it because the agent's lease expired.
        fenced: bool,
    },
}

/// One line of the journal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEntry {
    /// `start` or `stop`, with the fields of that event.
    #[serde(flatten)]
    pub event: JournalEvent,
    /// The node id.
    pub node: String,
    /// The allocation id.
    pub alloc_id: u64,
    /// The allocation's epoch (the job's attempt).
    pub epoch: u64,
    /// The job id.
    pub job_id: u64,
    /// `<group>-<replica>`.
    pub task: String,
    /// The task's device shares.
    pub devices: Vec<JournalDevice>,
    /// Wall clock, milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// A federated job's global id (`g-<n>`; empty for a region-local job): what ties its runs
    /// in different regions together (docs/federation.md).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub global_id: String,
    /// The federation epoch it ran under (0 for a region-local job).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub fed_epoch: u64,
    /// Why the shim stopped the task, on the stop line of a task it stopped itself (e.g.
    /// "federation lease of g-7 epoch 3 ended at …", with `fenced: true`); empty otherwise.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl JournalEntry {
    /// Whether this is a start line.
    pub fn is_start(&self) -> bool {
        matches!(self.event, JournalEvent::Start { .. })
    }

    /// Whether this is the stop line of a fenced task.
    pub fn fenced(&self) -> bool {
        matches!(self.event, JournalEvent::Stop { fenced: true, .. })
    }
}

/// Why the journal could not be read.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The file could not be read.
    #[error("reading the journal {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is larger than [`MAX_JOURNAL_BYTES`].
    #[error("the journal {path} is {bytes} bytes; at most {MAX_JOURNAL_BYTES} are read")]
    TooLarge {
        /// The file.
        path: String,
        /// Its size.
        bytes: u64,
    },
    /// A complete line (not the last, torn one) is not a journal entry.
    #[error("the journal {path}, line {line}: {message}")]
    Malformed {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// The parser's message.
        message: String,
    },
}

/// Appends one entry as one line with a single `write(2)` (`O_APPEND`), then `fdatasync`. The
/// appenders of a node take turns under an exclusive `flock` on the journal, so that a write cut
/// short by a full disk can be undone (the file cut back to its length before it: that needs no
/// space) instead of leaving half a line for the next one to complete into garbage.
pub fn append(path: &Path, entry: &JournalEntry) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(entry).map_err(std::io::Error::other)?;
    line.push(b'\n');
    let mut f = std::fs::OpenOptions::new().append(true).create(true).open(path)?;
    crate::sys::lock_exclusive(&f)?;
    let before = f.metadata()?.len();
    let written = f.write(&line);
    if !matches!(written, Ok(n) if n == line.len()) {
        let cut = f.set_len(before);
        return Err(match written {
            Err(e) => e,
            Ok(n) => std::io::Error::other(format!(
                "short write: {n} of {} bytes (disk full?); {}",
                line.len(),
                if cut.is_ok() { "undone" } else { "could not be undone" }
            )),
        });
    }
    f.sync_data()
}

/// Reads a journal: every complete line, in file order. A last line without its newline (a
/// write in progress or cut short) is skipped; a missing file is an empty journal.
pub fn read_journal(path: &Path) -> Result<Vec<JournalEntry>, JournalError> {
    let p = || path.display().to_string();
    let data = match std::fs::metadata(path) {
        Ok(m) if m.len() > MAX_JOURNAL_BYTES => return Err(JournalError::TooLarge { path: p(), bytes: m.len() }),
        Ok(_) => std::fs::read(path).map_err(|source| JournalError::Read { path: p(), source })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(JournalError::Read { path: p(), source }),
    };
    let complete = match data.iter().rposition(|b| *b == b'\n') {
        Some(i) => &data[..=i],
        None => &[][..],
    };
    let mut out = Vec::new();
    for (i, line) in complete.split(|b| *b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let e = serde_json::from_slice(line).map_err(|e| JournalError::Malformed {
            path: p(),
            line: i + 1,
            message: e.to_string(),
        })?;
        out.push(e);
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn entry(event: JournalEvent, at_ms: u64) -> JournalEntry {
        JournalEntry {
            event,
            node: "n1".into(),
            alloc_id: 7,
            epoch: 2,
            job_id: 3,
            task: "main-0".into(),
            devices: vec![JournalDevice { device: "gpu0".into(), milli: 500 }],
            at_ms,
            global_id: String::new(),
            fed_epoch: 0,
            reason: String::new(),
        }
    }

    #[test]
    fn journal_lines_have_the_documented_shape() {
        let start = serde_json::to_value(entry(JournalEvent::Start { pid: 42 }, 1)).unwrap();
        assert_eq!(
            start,
            serde_json::json!({"event": "start", "node": "n1", "alloc_id": 7, "epoch": 2, "job_id": 3,
                "task": "main-0", "devices": [{"device": "gpu0", "milli": 500}], "at_ms": 1, "pid": 42})
        );
        let stop = entry(JournalEvent::Stop { exit_code: None, signal: Some(9), fenced: true }, 2);
        let v = serde_json::to_value(&stop).unwrap();
        assert_eq!(v["event"], "stop");
        assert_eq!(v["exit_code"], serde_json::Value::Null, "present, null");
        assert_eq!((v["signal"].as_i64(), v["fenced"].as_bool()), (Some(9), Some(true)));
        assert!(stop.fenced() && !stop.is_start());
        // A federated task's lines carry its global id and federation epoch, a lease stop its reason;
        // lines of older shims (without them) still read.
        let fed = JournalEntry { global_id: "g-4".into(), fed_epoch: 2, reason: "federation lease".into(), ..stop };
        let v = serde_json::to_value(&fed).unwrap();
        assert_eq!((v["global_id"].as_str(), v["fed_epoch"].as_u64()), (Some("g-4"), Some(2)));
        assert_eq!(v["reason"], "federation lease");
        let old: JournalEntry = serde_json::from_value(start).unwrap();
        assert_eq!((old.global_id.as_str(), old.fed_epoch, old.reason.as_str()), ("", 0, ""));
    }

    #[test]
    fn journal_appends_and_skips_a_torn_last_line() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(JOURNAL_FILE);
        assert!(read_journal(&p).unwrap().is_empty(), "no file: no entries");
        let a = entry(JournalEvent::Start { pid: 1 }, 10);
        let b = entry(JournalEvent::Stop { exit_code: Some(0), signal: None, fenced: false }, 20);
        append(&p, &a).unwrap();
        append(&p, &b).unwrap();
        assert_eq!(read_journal(&p).unwrap(), vec![a.clone(), b.clone()]);
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"{\"event\":\"start\",\"no").unwrap();
        assert_eq!(read_journal(&p).unwrap(), vec![a.clone(), b.clone()], "the torn last line is skipped");
        f.write_all(b"\n").unwrap();
        let e = read_journal(&p).unwrap_err();
        assert!(matches!(e, JournalError::Malformed { line: 3, .. }), "{e}");
    }

    #[test]
    fn journal_concurrent_appends_do_not_interleave() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(JOURNAL_FILE);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let p = &p;
                s.spawn(move || {
                    for i in 0..25 {
                        let mut e = entry(JournalEvent::Start { pid: 1 }, t * 1000 + i);
                        e.task = "x".repeat(200);
                        append(p, &e).unwrap();
                    }
                });
            }
        });
        assert_eq!(read_journal(&p).unwrap().len(), 100);
    }
}
