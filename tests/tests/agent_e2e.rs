//! End to end with real processes: one `suanli server`, two `suanli agent`s with fake devices
//! (8 GPUs in two NVLink islands and 4 NPUs each, from the fake plugin `.so`), tasks that are
//! `/bin/sh` processes recording the devices in their environment.
//!
//! - 50 jobs of mixed shapes (whole GPU, half GPU, 2- and 4-GPU tasks, a 2×2-GPU gang, NPU,
//!   CPU only): all succeed, every task's environment names the devices of its allocation, and
//!   no device is ever shared beyond 1000 milli over the recorded run intervals.
//! - An agent SIGKILLed while its tasks run and started again on the same data directory: no
//!   task runs twice, and every job and allocation ends succeeded.
//! - In both, each node's task journal holds exactly one start and one stop line per task it
//!   ran, naming the allocation, its devices and the times in order.
//! - The task shim on its own: exit records, SIGTERM forwarding, the abandoned marker, the
//!   journal, and fencing by a lease (not started under a stale one; SIGTERM then SIGKILL when
//!   it expires, even if it is renewed after SIGTERM).

#![allow(clippy::unwrap_used)]

use suanli_tests as support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use suanli_agent::{JournalDevice, JournalEntry, JournalEvent};
use suanli_proto::v1 as pb;
use support::{
    AgentProc, Line, cluster, fake_config, read_lines, ready_healthy, record_job, submit, wait_nodes, wait_terminal,
};

const NODES: [&str; 2] = ["node-a", "node-b"];

/// A job shape: name, replicas, gang, devices (kind, count, milli).
type Shape = (&'static str, u32, bool, Option<(&'static str, u32, u32)>);

async fn two_agents(addr: &str, extra: &str) -> Vec<AgentProc> {
    let mut agents: Vec<AgentProc> =
        NODES.iter().map(|n| AgentProc::new(n, &[addr.to_owned()], &fake_config(8, 4, 4), extra)).collect();
    for a in &mut agents {
        a.start();
    }
    wait_nodes(addr, Duration::from_secs(30), "both agents registered with 12 healthy devices", |n| {
        NODES.iter().all(|id| ready_healthy(n, id, 12))
    })
    .await;
    agents
}

/// Asserts that no device's concurrent share over the recorded intervals exceeds 1000 milli.
fn assert_no_overcommit(lines: &[Line]) {
    let mut starts: BTreeMap<(u64, u64, String), &Line> = BTreeMap::new();
    let mut events: BTreeMap<(String, String), Vec<(u128, i64)>> = BTreeMap::new();
    for l in lines {
        let key = (l.job, l.attempt, l.task.clone());
        if l.start {
            starts.insert(key, l);
        } else {
            let s = starts.get(&key).unwrap_or_else(|| panic!("end line without a start: {l:?}"));
            for (d, m) in &s.devices {
                let e = events.entry((s.node.clone(), d.clone())).or_default();
                e.push((s.ns, i64::from(*m)));
                e.push((l.ns, -i64::from(*m)));
            }
        }
    }
    for ((node, dev), mut ev) in events {
        // Ends before starts at the same instant: a device freed and reused is not a conflict.
        ev.sort_by_key(|&(t, d)| (t, d));
        let mut used = 0i64;
        for (t, d) in ev {
            used += d;
            assert!(used <= 1000, "device {dev} on {node} shared beyond its capacity ({used} milli) at {t}");
        }
    }
}

/// Each node's journal holds one start and one stop line for every allocation placed on it,
/// with its identity and devices, the start no later than the stop, a clean exit, no fence.
fn assert_journals(agents: &[AgentProc], jobs: &BTreeMap<u64, pb::JobInfo>, t0_ms: u64) {
    let now_ms = suanli_agent::sys::now_ms();
    let mut lines: BTreeMap<&str, Vec<JournalEntry>> = BTreeMap::new();
    for a in agents {
        lines.insert(&a.node_id, a.journal());
    }
    let mut tasks = 0;
    for j in jobs.values() {
        for a in &j.allocs {
            tasks += 1;
            let journal = &lines[a.node.as_str()];
            let mine: Vec<&JournalEntry> =
                journal.iter().filter(|e| e.alloc_id == a.id && e.epoch == a.epoch).collect();
            assert_eq!(mine.len(), 2, "job {} alloc {}: journal lines {mine:#?}", j.id, a.id);
            let (start, stop) = (mine[0], mine[1]);
            assert!(matches!(start.event, JournalEvent::Start { pid } if pid > 1), "{start:?}");
            assert_eq!(
                stop.event,
                JournalEvent::Stop { exit_code: Some(0), signal: None, fenced: false },
                "job {} alloc {}",
                j.id,
                a.id
            );
            let devices: Vec<JournalDevice> =
                a.devices.iter().map(|d| JournalDevice { device: d.device.clone(), milli: d.milli }).collect();
            for e in [start, stop] {
                assert_eq!(
                    (e.node.as_str(), e.job_id, e.task.clone(), &e.devices),
                    (a.node.as_str(), j.id, format!("{}-{}", a.group_name, a.replica), &devices),
                    "job {} alloc {}: {e:?}",
                    j.id,
                    a.id
                );
            }
            assert!(t0_ms <= start.at_ms && start.at_ms <= stop.at_ms && stop.at_ms <= now_ms, "{start:?} {stop:?}");
        }
    }
    let total: usize = lines.values().map(Vec::len).sum();
    assert_eq!(total, 2 * tasks, "one start and one stop line per task, nothing else");
}

fn index_of(id: &str, prefix: &str) -> String {
    id.strip_prefix(prefix).unwrap_or_else(|| panic!("device id {id:?} lacks prefix {prefix}")).to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_mixed_jobs_on_two_agents() {
    let t0_ms = suanli_agent::sys::now_ms();
    let (c, addr) = cluster(1).await;
    let agents = two_agents(&addr, "").await;
    let rec_dir = tempfile::tempdir().unwrap();
    let rec = rec_dir.path().join("record.txt");
    let shapes: [Shape; 7] = [
        ("gpu1", 1, false, Some(("gpu", 1, 1000))),
        ("half", 1, false, Some(("gpu", 1, 500))),
        ("gpu2", 1, false, Some(("gpu", 2, 1000))),
        ("gpu4", 1, false, Some(("gpu", 4, 1000))),
        ("gang2x2", 2, true, Some(("gpu", 2, 1000))),
        ("npu1", 1, false, Some(("npu", 1, 1000))),
        ("cpu", 1, false, None),
    ];
    let mut ids = Vec::new();
    for i in 0..50 {
        let (name, replicas, gang, dev) = shapes[i % shapes.len()];
        let nap = 0.2 + 0.1 * (i % 4) as f64;
        let spec = record_job(&format!("{name}-{i}"), &rec, nap, replicas, gang, dev);
        ids.push(submit(&addr, &format!("e2e-{i}"), &spec).await);
    }
    let jobs = wait_terminal(&addr, &ids, Duration::from_secs(50)).await;
    let logs: String = agents.iter().map(|a| format!("--- {}:\n{}", a.node_id, a.log())).collect();
    for j in jobs.values() {
        assert_eq!(j.state, "succeeded", "job {} ({}): {}\n{logs}\n--- server:\n{}", j.id, j.name, j.reason, c.log(0));
        for a in &j.allocs {
            assert_eq!(a.state, "succeeded", "job {} alloc {}: {}", j.id, a.id, a.message);
        }
    }
    let lines = read_lines(&rec);
    // Every task of the last attempt ran once and names the devices of its allocation.
    for j in jobs.values() {
        for a in &j.allocs {
            let task = format!("{}-{}", a.group_name, a.replica);
            let mine: Vec<&Line> =
                lines.iter().filter(|l| l.start && l.job == j.id && l.attempt == a.epoch && l.task == task).collect();
            assert_eq!(mine.len(), 1, "job {} task {task} attempt {} started {} times", j.id, a.epoch, mine.len());
            let l = mine[0];
            assert_eq!(l.node, a.node, "job {} ran on {} but was placed on {}", j.id, l.node, a.node);
            let want: BTreeSet<(String, u32)> = a.devices.iter().map(|d| (d.device.clone(), d.milli)).collect();
            let got: BTreeSet<(String, u32)> = l.devices.iter().cloned().collect();
            assert_eq!(got, want, "job {} task {task}: SUANLI_DEVICES differs from its allocation", j.id);
            let gpus: BTreeSet<String> =
                a.devices.iter().filter(|d| d.device.starts_with("gpu")).map(|d| index_of(&d.device, "gpu")).collect();
            let npus: BTreeSet<String> =
                a.devices.iter().filter(|d| d.device.starts_with("npu")).map(|d| index_of(&d.device, "npu")).collect();
            let cuda: BTreeSet<String> =
                if l.cuda == "-" { BTreeSet::new() } else { l.cuda.split(',').map(String::from).collect() };
            let ascend: BTreeSet<String> =
                if l.ascend == "-" { BTreeSet::new() } else { l.ascend.split(',').map(String::from).collect() };
            assert_eq!(cuda, gpus, "job {} task {task}: CUDA_VISIBLE_DEVICES {:?}", j.id, l.cuda);
            assert_eq!(ascend, npus, "job {} task {task}: ASCEND_RT_VISIBLE_DEVICES {:?}", j.id, l.ascend);
        }
    }
    let starts = lines.iter().filter(|l| l.start).count();
    let ends = lines.iter().filter(|l| !l.start).count();
    let tasks: usize = jobs.values().map(|j| j.allocs.len()).sum();
    assert_eq!((starts, ends), (tasks, tasks), "one start and one end line per task");
    assert_no_overcommit(&lines);
    assert_journals(&agents, &jobs, t0_ms);
    // Gang replicas of one job ran on their own devices, and the logs reach `suanli job logs`.
    let some = ids[0];
    let out = support::cli().args(["job", "logs", &some.to_string(), "--server", &addr]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains(&format!("hello from job {some} task main-0")),
        "suanli job logs {some}: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(agents);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_killed_and_restarted_mid_run() {
    let t0_ms = suanli_agent::sys::now_ms();
    let (c, addr) = cluster(1).await;
    // The agent is away for 2.5 s plus its restart; with the server's 10 s TTL the automatic
    // fence (5 s) leaves little for a restart on a loaded machine: give it 7 s (F + G < TTL).
    let mut agents = two_agents(&addr, "fence_after_ms = 7000\nfence_kill_grace_ms = 2000\n").await;
    let rec_dir = tempfile::tempdir().unwrap();
    let rec = rec_dir.path().join("record.txt");
    let mut ids = Vec::new();
    for i in 0..16 {
        // Naps of 1, 2 and 5 s: some tasks end while the agent is down, some after it is back.
        let nap = [1.0, 2.0, 5.0, 5.0][i % 4];
        let dev = match i % 4 {
            0 | 1 => Some(("gpu", 1, 1000)),
            2 => Some(("gpu", 1, 500)),
            _ => Some(("npu", 1, 1000)),
        };
        let spec = record_job(&format!("restart-{i}"), &rec, nap, 1, false, dev);
        ids.push(submit(&addr, &format!("restart-{i}"), &spec).await);
    }
    let long: BTreeSet<u64> = ids.iter().enumerate().filter(|(i, _)| i % 4 >= 2).map(|(_, id)| *id).collect();
    // Wait until node-a runs at least 3 tasks, one of them long, then SIGKILL its agent.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let lines = read_lines(&rec);
        let on_a: Vec<&Line> = lines.iter().filter(|l| l.start && l.node == "node-a").collect();
        if on_a.len() >= 3 && on_a.iter().any(|l| long.contains(&l.job)) {
            break;
        }
        assert!(Instant::now() < deadline, "node-a never ran 3 tasks with a long one; log:\n{}", agents[0].log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    agents[0].kill();
    let killed_at = read_lines(&rec).iter().filter(|l| l.start && l.node == "node-a").count();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    agents[0].start();
    let jobs = wait_terminal(&addr, &ids, Duration::from_secs(45)).await;
    let lines = read_lines(&rec);
    let log_a = agents[0].log();
    // No (job, task, attempt) started twice, and no job needed a second attempt.
    let mut count: BTreeMap<(u64, String, u64), usize> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.start) {
        *count.entry((l.job, l.task.clone(), l.attempt)).or_default() += 1;
    }
    for (k, n) in &count {
        assert_eq!(*n, 1, "task {k:?} started {n} times\n--- node-a:\n{log_a}");
    }
    for j in jobs.values() {
        assert_eq!(j.state, "succeeded", "job {}: {}\n--- node-a:\n{log_a}\n--- server:\n{}", j.id, j.reason, c.log(0));
        let starts = lines.iter().filter(|l| l.start && l.job == j.id).count();
        assert_eq!(starts, 1, "job {} ran {starts} times", j.id);
        for a in &j.allocs {
            assert_eq!(a.state, "succeeded", "job {} alloc {}: {}", j.id, a.id, a.message);
        }
    }
    assert!(killed_at >= 3);
    assert!(log_a.contains("adopting a running task"), "the restarted agent adopted nothing:\n{log_a}");
    // The shims kept journaling while their agent was away.
    assert_journals(&agents, &jobs, t0_ms);
    drop(agents);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_survives_a_leader_change() {
    let (mut c, leader_addr) = cluster(3).await;
    let leader = c.addrs.iter().position(|a| *a == leader_addr).unwrap();
    // The agent talks to the leader first, so killing it breaks the agent's watch too.
    let mut servers = vec![leader_addr.clone()];
    servers.extend(c.addrs.iter().filter(|a| **a != leader_addr).cloned());
    let mut a = AgentProc::new("node-a", &servers, &fake_config(2, 0, 0), "");
    a.start();
    let other = servers[1].clone();
    wait_nodes(&leader_addr, Duration::from_secs(30), "the agent registered", |n| ready_healthy(n, "node-a", 2)).await;
    let rec_dir = tempfile::tempdir().unwrap();
    let rec = rec_dir.path().join("record.txt");
    let mut ids = Vec::new();
    for i in 0..2 {
        let spec = record_job(&format!("before-{i}"), &rec, 2.0, 1, false, Some(("gpu", 1, 1000)));
        ids.push(submit(&leader_addr, &format!("before-{i}"), &spec).await);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while read_lines(&rec).iter().filter(|l| l.start).count() < 2 {
        assert!(Instant::now() < deadline, "the jobs did not start:\n{}", a.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.kill(leader);
    c.wait_leader(Duration::from_secs(30)).await.unwrap();
    // Work placed after the change runs too.
    for i in 0..2 {
        let spec = record_job(&format!("after-{i}"), &rec, 0.2, 1, false, Some(("gpu", 1, 1000)));
        let deadline = Instant::now() + Duration::from_secs(20);
        let id = loop {
            let mut jc = suanli_proto::v1::jobs_client::JobsClient::new(support::channel(&other).await.unwrap());
            let req = suanli_proto::v1::SubmitJobRequest {
                global: false,
                team: String::new(),
                client_request_id: format!("after-{i}"),
                spec_json: spec.to_string(),
                retry: None,
            };
            match jc.submit(req).await {
                Ok(r) => break r.into_inner().job_id,
                Err(e) => {
                    assert!(Instant::now() < deadline, "submitting after the leader change: {e:?}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        ids.push(id);
    }
    let jobs = wait_terminal(&other, &ids, Duration::from_secs(40)).await;
    for j in jobs.values() {
        assert_eq!(j.state, "succeeded", "job {}: {}\n--- agent:\n{}", j.id, j.reason, a.log());
    }
    assert_eq!(read_lines(&rec).iter().filter(|l| l.start).count(), 4, "each job ran once");
    assert!(a.alive());
}

#[test]
fn task_shim_records_exit_forwards_sigterm_and_refuses_an_abandoned_task() {
    let d = tempfile::tempdir().unwrap();
    let shim = |dir: &std::path::Path, script: &str| {
        std::process::Command::new(support::bin())
            .args(["task-shim", "--dir"])
            .arg(dir)
            .args(["--", "/bin/sh", "-c", script])
            .spawn()
            .unwrap()
    };
    // A plain exit: exit.json, output in stdout.log, the shim's identity in shim.json.
    let a = d.path().join("a");
    std::fs::create_dir(&a).unwrap();
    let st = shim(&a, "echo out; echo err >&2; exit 7").wait().unwrap();
    assert_eq!(st.code(), Some(7));
    let exit: suanli_agent::ExitRecord = serde_json::from_slice(&std::fs::read(a.join("exit.json")).unwrap()).unwrap();
    assert_eq!((exit.exit_code, exit.signal), (Some(7), None));
    assert_eq!(std::fs::read_to_string(a.join("stdout.log")).unwrap(), "out\n");
    assert_eq!(std::fs::read_to_string(a.join("stderr.log")).unwrap(), "err\n");
    assert!(a.join("shim.json").exists());
    // SIGTERM to the shim reaches the command; the shim outlives it and records the signal.
    let b = d.path().join("b");
    std::fs::create_dir(&b).unwrap();
    let mut child = shim(&b, "echo up; exec sleep 30");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(b.join("stdout.log")).unwrap_or_default().is_empty() {
        assert!(Instant::now() < deadline, "the task never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let pid = i32::try_from(child.id()).unwrap();
    let me = suanli_agent::sys::ProcId::of(pid).unwrap();
    assert!(me.alive());
    std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap();
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(128 + 15));
    let exit: suanli_agent::ExitRecord = serde_json::from_slice(&std::fs::read(b.join("exit.json")).unwrap()).unwrap();
    assert_eq!(exit.signal, Some(15));
    // A task an agent declared lost never runs, even if its shim starts late.
    let c = d.path().join("c");
    std::fs::create_dir(&c).unwrap();
    std::fs::write(c.join("abandoned"), "lost\n").unwrap();
    let st = shim(&c, "touch ran").wait().unwrap();
    assert_eq!(st.code(), Some(3));
    assert!(!c.join("ran").exists() && !c.join("exit.json").exists());
}

#[test]
fn task_shim_journals_and_fences_by_its_lease() {
    use std::os::unix::process::CommandExt as _;
    use suanli_agent::sys::{boot_id, boottime_ms, now_ms};
    use suanli_agent::{ExitRecord, Lease, read_journal};
    let d = tempfile::tempdir().unwrap();
    let journal = d.path().join("journal.jsonl");
    let lease_path = d.path().join("lease");
    let lease = |sent: u64, f: u64, g: u64| Lease {
        sent_boottime_ms: sent,
        fence_after_ms: f,
        kill_grace_ms: g,
        boot_id: boot_id(),
        check: String::new(),
    };
    let alloc_dir = |name: &str, id: u64| {
        let dir = d.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        let alloc = serde_json::json!({"id": id, "epoch": 2, "job_id": 9, "node": "n1", "task": "main-0",
            "devices": [{"device": "gpu0", "milli": 500, "memory_mib": 0}]});
        std::fs::write(dir.join("alloc.json"), alloc.to_string()).unwrap();
        dir
    };
    // As the agent starts it: the leader of its own process group.
    let shim = |dir: &std::path::Path, script: &str| {
        std::process::Command::new(support::bin())
            .args(["task-shim", "--dir"])
            .arg(dir)
            .arg("--journal")
            .arg(&journal)
            .arg("--lease")
            .arg(&lease_path)
            .args(["--", "/bin/sh", "-c", script])
            .process_group(0)
            .spawn()
            .unwrap()
    };
    let exit_of = |dir: &std::path::Path| -> ExitRecord {
        serde_json::from_slice(&std::fs::read(dir.join("exit.json")).unwrap()).unwrap()
    };
    // No lease, or a stale one: the command does not start, and nothing is journaled.
    for (name, stale) in [("none", None), ("stale", Some(lease(boottime_ms().saturating_sub(5_000), 1_000, 500)))] {
        let dir = alloc_dir(name, 1);
        match stale {
            Some(l) => l.write(&lease_path).unwrap(),
            None => {
                let _ = std::fs::remove_file(&lease_path);
            }
        }
        assert_eq!(shim(&dir, "touch ran").wait().unwrap().code(), Some(127), "{name}");
        let exit = exit_of(&dir);
        let err = exit.error.clone().unwrap_or_default();
        assert!(exit.fenced && err.starts_with("fenced before start: "), "{name}: {exit:?}");
        assert!(!dir.join("ran").exists(), "{name}: the command ran");
        assert!(read_journal(&journal).unwrap().is_empty(), "{name}: journaled");
    }
    // A fresh lease: the command runs; one start and one stop line.
    let dir = alloc_dir("fresh", 2);
    lease(boottime_ms(), 60_000, 1_000).write(&lease_path).unwrap();
    let t0 = now_ms();
    assert_eq!(shim(&dir, "exit 3").wait().unwrap().code(), Some(3));
    let lines = read_journal(&journal).unwrap();
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert!(matches!(lines[0].event, JournalEvent::Start { pid } if pid > 1), "{lines:#?}");
    assert_eq!(lines[1].event, JournalEvent::Stop { exit_code: Some(3), signal: None, fenced: false });
    for l in &lines {
        assert_eq!((l.node.as_str(), l.alloc_id, l.epoch, l.job_id, l.task.as_str()), ("n1", 2, 2, 9, "main-0"));
        assert_eq!(l.devices, vec![JournalDevice { device: "gpu0".into(), milli: 500 }]);
    }
    assert!(t0 <= lines[0].at_ms && lines[0].at_ms <= lines[1].at_ms && lines[1].at_ms <= now_ms());
    let exit = exit_of(&dir);
    assert_eq!((exit.exit_code, exit.fenced, exit.started_at_ms), (Some(3), false, Some(lines[0].at_ms)));
    assert_eq!(exit.finished_at_ms, Some(lines[1].at_ms));
    // A lease that expires while the task runs: SIGTERM after F, SIGKILL after F + G, even
    // though the lease is renewed after SIGTERM (the task ignores SIGTERM but records it).
    let dir = alloc_dir("expiring", 3);
    let (f, g) = (2_000, 1_000);
    let sent = boottime_ms();
    let sent_wall = now_ms() - (boottime_ms() - sent);
    lease(sent, f, g).write(&lease_path).unwrap();
    let mut child = shim(&dir, "trap 'echo term >> got_term' TERM; echo up; while :; do sleep 0.05; done");
    let shim_pid = i32::try_from(child.id()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !dir.join("got_term").exists() {
        assert!(Instant::now() < deadline, "no SIGTERM reached the task");
        assert!(child.try_wait().unwrap().is_none(), "the shim ended before SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    lease(boottime_ms(), 60_000, 1_000).write(&lease_path).unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(128 + 9), "the shim exits as its task did: SIGKILL");
    let lines: Vec<JournalEntry> = read_journal(&journal).unwrap().into_iter().filter(|l| l.alloc_id == 3).collect();
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert_eq!(lines[1].event, JournalEvent::Stop { exit_code: None, signal: Some(9), fenced: true });
    assert!(lines[1].at_ms + 50 >= sent_wall + f + g, "killed before F + G: {lines:#?} sent at {sent_wall}");
    let exit = exit_of(&dir);
    assert!(exit.fenced && exit.signal == Some(9), "{exit:?}");
    let term_at = exit.fenced_at_ms.unwrap();
    assert!(term_at + 50 >= sent_wall + f && term_at < sent_wall + f + g, "SIGTERM at {term_at}, sent {sent_wall}");
    // Nothing of the task's process group is left running.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: Vec<i32> = std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|p| {
                suanli_agent::sys::proc_pgrp(*p) == Some(shim_pid)
                    && suanli_agent::sys::proc_stat(*p).is_some_and(|(_, s)| s != 'Z' && s != 'X')
            })
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "processes of the fenced task still run: {left:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Device plugin ABI 1.2 under a real agent: the fake plugin (1.3, enforcing shares, journaling
/// its calls) and the C example built as an ABI 1.1 plugin, loaded side by side. Two half-GPU
/// jobs share one fake GPU at once: each reserve carries its reservation id and a 500-milli
/// share (the plugin would refuse a share past 1000: its unit tests), and every reservation is
/// released once its task ends. A job on the 1.1 plugin's device runs as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn abi_1_2_shares_reach_the_plugin_and_are_released_and_a_1_1_plugin_still_runs() {
    let (_c, addr) = cluster(1).await;
    let tmp = tempfile::tempdir().unwrap();
    let journal = tmp.path().join("fake-calls.jsonl");
    let extra = format!(
        "health_poll_interval_ms = 200\n[plugin_config.fake.options]\nenforce_shares = \"true\"\njournal = {:?}\n",
        journal.display().to_string()
    );
    let mut a = AgentProc::new("node-a", std::slice::from_ref(&addr), &fake_config(1, 0, 0), &extra);
    let c11 =
        suanli_device_host::testing::build_c_example(tmp.path(), "example11", &["-DEXAMPLE_ABI_MINOR=1"]).unwrap();
    a.add_plugin(&c11, "example");
    a.start();
    wait_nodes(&addr, Duration::from_secs(30), "the agent registered the fake GPU and the example's two", |n| {
        ready_healthy(n, "node-a", 3)
    })
    .await;
    let log = a.log();
    assert!(log.contains("abi=1.3") && log.contains("abi=1.1"), "both plugins loaded:\n{log}");

    let rec = tmp.path().join("record.txt");
    let limits = tmp.path().join("limits.txt");
    // Each half records the limits it was given before the usual record lines.
    let half = |name: &str, model: &str| {
        let mut spec = record_job(name, &rec, 1.5, 1, false, Some(("gpu", 1, 500)));
        spec["constraints"] = serde_json::json!({"device_models": [model], "share_isolation": "enforced"});
        let script = spec["groups"][0]["task"]["args"][1].as_str().unwrap().to_owned();
        spec["groups"][0]["task"]["args"][1] = serde_json::Value::from(format!(
            "echo \"$SUANLI_JOB_ID $SUANLI_GPU_SHARE_ISOLATION $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT\" >> {:?}; {script}",
            limits.display().to_string()
        ));
        spec
    };
    let h1 = submit(&addr, "half-1", &half("half-1", "A100-80G")).await;
    let h2 = submit(&addr, "half-2", &half("half-2", "A100-80G")).await;
    // The 1.1 example plugin's GPU does not limit shares: a half that requires it waits, and
    // says why.
    let advisory = submit(&addr, "half-advisory", &half("half-advisory", "ExampleGPU-16G")).await;
    let mut whole = record_job("on-1.1", &rec, 0.2, 1, false, Some(("gpu", 1, 1000)));
    whole["constraints"] = serde_json::json!({"device_models": ["ExampleGPU-16G"]});
    let w = submit(&addr, "on-1.1", &whole).await;
    let jobs = wait_terminal(&addr, &[h1, h2, w], Duration::from_secs(60)).await;
    for (id, j) in &jobs {
        assert_eq!(j.state, "succeeded", "job {id}: {j:?}\n{}", a.log());
    }
    // Share isolation: both halves ran on the fake GPU, which enforces shares, with its limits;
    // the one asking it of the example's GPU still waits, naming the constraint.
    let got: BTreeSet<String> = std::fs::read_to_string(&limits).unwrap().lines().map(str::to_owned).collect();
    assert_eq!(got, BTreeSet::from([h1, h2].map(|j| format!("{j} enforced 50 0=20480M"))), "{got:?}");
    let j = support::job(&addr, advisory).await;
    assert_eq!(j.state, "pending", "{j:?}");
    assert!(j.reason.contains("gpu shares not isolated (constraints.share_isolation = enforced)"), "{}", j.reason);

    let lines = read_lines(&rec);
    let on_example = lines.iter().find(|l| l.start && l.job == w).expect("the 1.1 job ran");
    assert!(on_example.devices.iter().all(|(d, _)| d.starts_with("example")), "{on_example:?}");

    // The fake plugin's calls: both half shares of gpu0 were held at once (500 + 500), each
    // reservation released once, after its reserve, with the same id.
    let calls: Vec<serde_json::Value> =
        std::fs::read_to_string(&journal).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let reserves: Vec<&serde_json::Value> = calls.iter().filter(|c| c["call"] == "reserve").collect();
    assert_eq!(reserves.len(), 2, "{calls:#?}");
    for r in &reserves {
        assert_eq!(r["shares"], serde_json::json!([{"device": "gpu0", "milli": 500}]), "{r}");
        let id = r["reservation_id"].as_str().unwrap();
        assert!(id.starts_with(&format!("{}-", r["alloc_id"])), "reservation id {id} names its allocation");
        let at = calls.iter().position(|c| c == *r).unwrap();
        let released: Vec<usize> = calls
            .iter()
            .enumerate()
            .filter(|(_, c)| c["call"] == "release" && c["reservation_id"] == id)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(released.len(), 1, "{id} released once: {calls:#?}");
        assert!(released[0] > at, "{id} released after its reserve");
        assert_eq!(calls[released[0]]["held"], true, "{id} was held when released");
    }
    // Both halves ran at the same time on gpu0 (the plugin held 1000 milli then).
    let (s1, e1) = (
        lines.iter().find(|l| l.start && l.job == h1).unwrap(),
        lines.iter().find(|l| !l.start && l.job == h1).unwrap(),
    );
    let (s2, e2) = (
        lines.iter().find(|l| l.start && l.job == h2).unwrap(),
        lines.iter().find(|l| !l.start && l.job == h2).unwrap(),
    );
    assert!(s1.ns < e2.ns && s2.ns < e1.ns, "the two halves overlapped: {lines:?}");
}
