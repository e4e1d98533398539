//! Rendering: tables (comfy-table), key-value blocks, units, and the job views shared by
//! several commands. JSON output is the generated types' serde derive (`print_json`).

use std::borrow::Cow;
use std::time::{SystemTime, UNIX_EPOCH};
use suanli_client::pb;

/// A cell as a terminal may show it: control, bidi and zero-width characters (stored by an
/// earlier build, or reported by a server) are written as `\u{..}` escapes, never sent raw.
pub fn printable(c: &str) -> Cow<'_, str> {
    let unsafe_char = |ch: char| {
        ch.is_control()
            || matches!(ch, '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{2069}' | '\u{FEFF}')
    };
    if !c.chars().any(unsafe_char) {
        return Cow::Borrowed(c);
    }
    Cow::Owned(
        c.chars().map(|ch| if unsafe_char(ch) { ch.escape_unicode().to_string() } else { ch.to_string() }).collect(),
    )
}

/// An aligned plain-text table: no borders, columns separated by two spaces, no trailing
/// spaces, cells made [`printable`].
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::NOTHING);
    t.set_content_arrangement(comfy_table::ContentArrangement::Disabled);
    t.set_header(headers.iter().map(|h| printable(h).into_owned()).collect::<Vec<_>>());
    for r in rows {
        t.add_row(r.iter().map(|c| printable(c).into_owned()).collect::<Vec<_>>());
    }
    for col in t.column_iter_mut() {
        col.set_padding((0, 2));
    }
    t.lines().map(|l| l.trim_end().to_owned()).collect::<Vec<_>>().join("\n")
}

/// [`table`], each line indented by two spaces (a section under a key-value block).
pub fn print_indented_table(headers: &[&str], rows: &[Vec<String>]) {
    for l in table(headers, rows).lines() {
        println!("  {l}");
    }
}

/// Key-value lines with aligned values.
pub fn fields(kv: &[(&str, String)]) -> String {
    let w = kv.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    kv.iter().map(|(k, v)| format!("{:<w$} {v}", format!("{k}:"), w = w)).collect::<Vec<_>>().join("\n")
}

/// Pretty JSON of anything serializable (the generated API types derive `Serialize`).
pub fn print_json<T: serde::Serialize + ?Sized>(t: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(t)?);
    Ok(())
}

/// Milli-units as a decimal: 1500 -> "1.5", 250 -> "0.25".
pub fn milli(m: u64) -> String {
    let (whole, frac) = (m / 1000, m % 1000);
    if frac == 0 { whole.to_string() } else { format!("{whole}.{frac:03}").trim_end_matches('0').to_owned() }
}

/// MiB as a short size: 65536 -> "64Gi", 1536 -> "1.5Gi", 500 -> "500Mi".
pub fn mib(m: u64) -> String {
    if m >= 1024 * 1024 && m.is_multiple_of(1024 * 1024 / 8) {
        format!("{}Ti", milli(m * 1000 / (1024 * 1024)))
    } else if m >= 1024 && m.is_multiple_of(128) {
        format!("{}Gi", milli(m * 1000 / 1024))
    } else {
        format!("{m}Mi")
    }
}

/// A resource vector, non-zero dimensions only: `cpu=8 mem=64Gi gpu=4`.
pub fn res(r: Option<&pb::Resources>) -> String {
    let Some(r) = r else { return "-".into() };
    if [r.cpu_milli, r.memory_mib, r.gpu_milli, r.npu_milli].iter().all(|v| *v == u64::MAX) {
        return "unlimited".into();
    }
    let mut parts = Vec::new();
    if r.cpu_milli > 0 {
        parts.push(format!("cpu={}", milli(r.cpu_milli)));
    }
    if r.memory_mib > 0 {
        parts.push(format!("mem={}", mib(r.memory_mib)));
    }
    if r.gpu_milli > 0 {
        parts.push(format!("gpu={}", milli(r.gpu_milli)));
    }
    if r.npu_milli > 0 {
        parts.push(format!("npu={}", milli(r.npu_milli)));
    }
    if parts.is_empty() { "0".into() } else { parts.join(" ") }
}

/// `used/capacity` columns of a resource pair: CPU, MEM, GPU, NPU.
pub fn usage_cols(used: Option<&pb::Resources>, cap: Option<&pb::Resources>) -> Vec<String> {
    let z = pb::Resources::default();
    let (u, c) = (used.unwrap_or(&z), cap.unwrap_or(&z));
    vec![
        format!("{}/{}", milli(u.cpu_milli), milli(c.cpu_milli)),
        format!("{}/{}", mib(u.memory_mib), mib(c.memory_mib)),
        format!("{}/{}", milli(u.gpu_milli), milli(c.gpu_milli)),
        format!("{}/{}", milli(u.npu_milli), milli(c.npu_milli)),
    ]
}

/// Seconds since the Unix epoch.
pub fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Time since `t` (seconds since the epoch): `45s`, `3m`, `2h`, `5d`.
pub fn age(t: u64) -> String {
    if t == 0 {
        return "-".into();
    }
    let d = now_s().saturating_sub(t);
    match d {
        0..60 => format!("{d}s"),
        60..3600 => format!("{}m", d / 60),
        3600..86_400 => format!("{}h", d / 3600),
        _ => format!("{}d", d / 86_400),
    }
}

/// `-` for an empty string.
pub fn dash(s: &str) -> String {
    if s.is_empty() { "-".into() } else { s.to_owned() }
}

/// The columns of `job list`.
pub const JOB_HEADERS: [&str; 8] = ["ID", "NAME", "QUEUE", "STATE", "PRIO", "AGE", "ALLOCS", "REASON"];

/// One row of `job list`.
pub fn job_row(j: &pb::JobInfo) -> Vec<String> {
    vec![
        j.id.to_string(),
        j.name.clone(),
        j.queue.clone(),
        j.state.clone(),
        j.priority.to_string(),
        age(j.submitted_at),
        (j.allocs.len() as u64 + j.omitted_allocs).to_string(),
        dash(&j.reason),
    ]
}

/// `job status`: the job, its current allocations and its past attempts.
pub fn print_job(j: &pb::JobInfo) {
    let mut kv = vec![
        ("id", j.id.to_string()),
        ("name", j.name.clone()),
        ("queue", j.queue.clone()),
        ("state", j.state.clone()),
        ("priority", j.priority.to_string()),
        ("submitted", format!("{} ago", age(j.submitted_at))),
        ("updated", format!("{} ago", age(j.updated_at))),
        (
            "attempt",
            format!(
                "{} (failures {}, requeues {}, infrastructure requeues {})",
                j.attempt, j.failures, j.requeues, j.infra_requeues
            ),
        ),
        ("revision", j.revision.to_string()),
        ("request id", dash(&j.client_request_id)),
    ];
    if j.service {
        let running = j.allocs.iter().filter(|a| a.state == "running").count();
        let ready: Vec<&str> =
            j.allocs.iter().filter(|a| a.state == "running" && a.ready).map(|a| a.endpoint.as_str()).collect();
        kv.push((
            "service",
            format!("{running} running, {} ready ({}), {} restarts", ready.len(), ready.join(" "), j.restarts),
        ));
    }
    if j.queue_position > 0 {
        kv.push(("queue position", j.queue_position.to_string()));
    }
    if j.not_before > now_s() {
        kv.push(("not before", format!("in {}s", j.not_before - now_s())));
    }
    if !j.reason.is_empty() {
        kv.push(("reason", j.reason.clone()));
    }
    if !j.latest_checkpoint_uri.is_empty() {
        kv.push(("checkpoint", checkpoint_line(j)));
        kv.push(("checkpoint uri", j.latest_checkpoint_uri.clone()));
    }
    if !j.nominated_victims.is_empty() {
        let ids: Vec<String> = j.nominated_victims.iter().map(u64::to_string).collect();
        kv.push(("held for it", format!("capacity of allocations {} (stopping for it)", ids.join(", "))));
    }
    if !j.migrating_to.is_empty() {
        kv.push(("migrating to", j.migrating_to.clone()));
    }
    if j.lost_device_s > 0 {
        kv.push((
            "lost work",
            format!("{} device-hours ({} device-seconds)", device_hours(j.lost_device_s), j.lost_device_s),
        ));
    }
    println!("{}", fields(&kv));
    print_allocs(j);
    print_attempts(j);
}

/// The latest checkpoint: `step 1200, 3m ago, portable` (or the hardware it is bound to).
pub fn checkpoint_line(j: &pb::JobInfo) -> String {
    let when = if j.latest_checkpoint_at == 0 {
        "time unknown".to_owned()
    } else {
        format!("{} ago", age(j.latest_checkpoint_at))
    };
    let hw = if j.latest_checkpoint_hardware.is_empty() {
        "portable".to_owned()
    } else {
        format!("restores only onto {}", j.latest_checkpoint_hardware)
    };
    format!("step {}, {when}, {hw}", j.latest_checkpoint_step)
}

/// Device-seconds as device-hours with two decimals: 5400 -> "1.50".
pub fn device_hours(s: u64) -> String {
    format!("{:.2}", s as f64 / 3600.0)
}

/// The ended attempts' allocations (oldest first): where each ran and how it ended.
fn print_attempts(j: &pb::JobInfo) {
    if j.attempts.is_empty() {
        return;
    }
    println!("past attempts:");
    let rows: Vec<Vec<String>> = j
        .attempts
        .iter()
        .map(|h| {
            vec![
                h.attempt.to_string(),
                h.alloc_id.to_string(),
                format!("{}/{}", h.group, h.replica),
                h.node.clone(),
                format!("{} ago", age(h.started_at)),
                format!("{} ago", age(h.ended_at)),
                h.state.clone(),
                dash(&h.end),
                if h.exit_code_set { h.exit_code.to_string() } else { "-".into() },
                if h.lost_device_s > 0 { device_hours(h.lost_device_s) } else { "-".into() },
                if h.restored_step_set { h.restored_step.to_string() } else { "-".into() },
                dash(&h.message),
            ]
        })
        .collect();
    print_indented_table(
        &[
            "ATTEMPT",
            "ALLOC",
            "GROUP/REPLICA",
            "NODE",
            "STARTED",
            "ENDED",
            "STATE",
            "END",
            "EXIT",
            "LOST DEV-H",
            "FROM STEP",
            "MESSAGE",
        ],
        &rows,
    );
}

/// The current attempt's allocations.
fn print_allocs(j: &pb::JobInfo) {
    if j.allocs.is_empty() {
        println!("allocations: none");
        return;
    }
    println!("allocations:");
    let rows: Vec<Vec<String>> = j
        .allocs
        .iter()
        .map(|a| {
            let devs = a
                .devices
                .iter()
                .map(|d| {
                    if d.milli >= 1000 {
                        d.device.clone()
                    } else {
                        format!("{}({})", d.device, milli(u64::from(d.milli)))
                    }
                })
                .collect::<Vec<_>>()
                .join(",");
            let state = if a.desired == "stop" && !a.stop_reason.is_empty() {
                format!("{} (stop: {})", a.state, a.stop_reason)
            } else {
                a.state.clone()
            };
            vec![
                a.id.to_string(),
                format!("{}/{}", a.group, a.replica),
                a.epoch.to_string(),
                a.node.clone(),
                state,
                milli(a.cpu_milli),
                mib(a.memory_mib),
                dash(&devs),
                dash(&a.message),
            ]
        })
        .collect();
    print_indented_table(
        &["ALLOC", "GROUP/REPLICA", "EPOCH", "NODE", "STATE", "CPU", "MEM", "DEVICES", "MESSAGE"],
        &rows,
    );
}

/// One `job watch` event: a line of text, or one JSON object per line.
pub fn print_event(ev: &pb::JobEvent, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(ev)?);
        return Ok(());
    }
    match &ev.job {
        None => println!("rev {} (no job)", ev.revision),
        Some(j) if ev.removed => println!("rev {} job {} {} removed", ev.revision, j.id, j.name),
        Some(j) => {
            let reason = if j.reason.is_empty() { String::new() } else { format!(" ({})", j.reason) };
            println!(
                "rev {} job {} {} queue={} state={} allocs={}{reason}",
                ev.revision,
                j.id,
                j.name,
                j.queue,
                j.state,
                j.allocs.len()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_cells_never_carry_terminal_escapes() {
        let t = table(&["TEAM"], &[vec!["a\u{1b}[31mred\u{200b}".into()]]);
        assert!(!t.contains('\u{1b}') && !t.contains('\u{200b}'), "{t:?}");
        assert!(t.contains("\\u{1b}[31mred\\u{200b}"), "{t}");
    }

    #[test]
    fn units_print_short() {
        assert_eq!(milli(1500), "1.5");
        assert_eq!(milli(250), "0.25");
        assert_eq!(milli(8000), "8");
        assert_eq!(mib(65536), "64Gi");
        assert_eq!(mib(1536), "1.5Gi");
        assert_eq!(mib(500), "500Mi");
        assert_eq!(mib(2 * 1024 * 1024), "2Ti");
    }

    #[test]
    fn checkpoints_and_lost_work_read_plainly() {
        let mut j = pb::JobInfo { latest_checkpoint_step: 1200, ..Default::default() };
        assert_eq!(checkpoint_line(&j), "step 1200, time unknown, portable");
        j.latest_checkpoint_at = now_s();
        j.latest_checkpoint_hardware = "NVIDIA H200 x8".into();
        assert_eq!(checkpoint_line(&j), "step 1200, 0s ago, restores only onto NVIDIA H200 x8");
        assert_eq!(device_hours(5400), "1.50");
        assert_eq!(device_hours(36), "0.01");
    }

    #[test]
    fn tables_align() {
        let t = table(&["A", "LONG"], &[vec!["xyz".into(), "1".into()], vec!["q".into(), "22".into()]]);
        assert_eq!(t, "A    LONG\nxyz  1\nq    22");
        let t = table(&["A", "B"], &[]);
        assert_eq!(t, "A  B");
    }

    #[test]
    fn json_is_the_generated_types_with_names_and_embedded_specs() {
        let n = pb::NodeInfo {
            id: "n".into(),
            mode: pb::NodeMode::Cordoned as i32,
            labels: [("z".to_owned(), "1".to_owned()), ("a".to_owned(), "2".to_owned())].into_iter().collect(),
            ..Default::default()
        };
        let v = serde_json::to_value(&n).expect("json");
        assert_eq!(v["mode"], "cordoned");
        let text = serde_json::to_string(&n).expect("json");
        assert!(text.find("\"a\"") < text.find("\"z\""), "labels in key order: {text}");
        let j = pb::JobInfo { spec_json: r#"{"name":"x"}"#.into(), ..Default::default() };
        assert_eq!(serde_json::to_value(&j).expect("json")["spec"]["name"], "x");
        let summary = pb::JobInfo { summary: true, ..Default::default() };
        assert!(serde_json::to_value(&summary).expect("json")["spec"].is_null());
    }
}
