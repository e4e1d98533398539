//! The workload: clients that submit, cancel, read jobs and change queue quotas while the
//! nemesis works, each through its own proxies, recording every operation in the history.
//!
//! A submission whose outcome is unknown (timeout, unavailable) is retried with the same client
//! request id on the other servers (once each, following a leader hint through the client's own
//! link), through `suanli-client`'s connection: the control plane promises that a retry never
//! creates a second job, and the checker verifies it. An operation that stays unknown is
//! recorded as `info`; one refused for good as `fail`.

use crate::cluster::From;
use crate::history::{History, Op, OpKind, Outcome, now_ms};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use suanli_client::CallChannel;
use suanli_client::{ClientError, Connection, ConnectionConfig, LeaderHints};
use suanli_proto::v1 as pb;
use suanli_proto::v1::jobs_client::JobsClient;
use suanli_proto::v1::queues_client::QueuesClient;
use suanli_scheduler::DetRng;
use tonic::Code;

/// What each client does.
#[derive(Debug, Clone)]
pub struct WorkloadSpec {
    /// Pause between a client's operations (ms).
    pub think_ms: u64,
    /// Task run time range (ms) for submitted jobs.
    pub task_ms: (u64, u64),
    /// Percent of operations that are submissions (the rest: cancel, queue, read).
    pub submit_pct: u64,
    /// Deadline of one request (ms); past it the outcome is unknown and the request is retried.
    pub request_timeout_ms: u64,
}

/// The retry policy of every submission: 3 attempts, 1-2 s backoff.
const RETRY: pb::RetryPolicy = pb::RetryPolicy { max_attempts: 3, backoff_base_s: 1, backoff_max_s: 2 };

impl WorkloadSpec {
    /// The longest retry backoff a submitted job can wait (s).
    pub fn max_backoff_s(&self) -> u64 {
        RETRY.backoff_max_s
    }
}

impl Default for WorkloadSpec {
    fn default() -> Self {
        Self { think_ms: 150, task_ms: (300, 1500), submit_pct: 70, request_timeout_ms: 1000 }
    }
}

/// One client: a connection over its own links to every server.
pub struct Client {
    id: usize,
    /// Leader hints (advertised addresses) are followed through the link to that server.
    conn: Connection,
    /// Link address → server index (the history records servers by index).
    by_link: BTreeMap<String, usize>,
    rng: DetRng,
    spec: WorkloadSpec,
    seq: u64,
    jobs: Vec<u64>,
    history: History,
}

impl Client {
    /// A client `id` of a cluster whose servers are reached at `links[j]` (advertised as
    /// `advertised[j]`).
    pub fn new(
        id: usize,
        links: &[String],
        advertised: &[String],
        seed: u64,
        spec: WorkloadSpec,
        history: History,
    ) -> anyhow::Result<Client> {
        let t = Duration::from_millis(spec.request_timeout_ms);
        let cfg = ConnectionConfig {
            connect_timeout: Duration::from_millis(500),
            request_timeout: Some(t),
            first_answer: t,
            probe_timeout: t,
            hints: LeaderHints::KnownOnly,
            move_on: unknown,
            aliases: advertised.iter().cloned().zip(links.iter().cloned()).collect(),
            tls: Some(crate::cluster::pki().admin_tls()),
            ..ConnectionConfig::default()
        };
        let conn = Connection::new(links, cfg)?;
        let by_link = links.iter().enumerate().map(|(i, a)| (a.clone(), i)).collect();
        Ok(Client { id, conn, by_link, rng: DetRng::new(seed), spec, seq: 0, jobs: Vec::new(), history })
    }

    fn pick_server(&mut self) -> usize {
        self.rng.below(self.by_link.len() as u64) as usize
    }

    fn job_spec(&mut self, name: &str) -> String {
        let (lo, hi) = self.spec.task_ms;
        // One task in ten runs long (4-8 s), so faults catch tasks mid-run: fenced by their
        // shims, lost with their node, requeued and started again elsewhere.
        let ms = if self.rng.below(10) == 0 {
            4_000 + self.rng.below(4_000)
        } else {
            lo + self.rng.below(hi.saturating_sub(lo).max(1))
        };
        let devices = match self.rng.below(10) {
            0..=4 => serde_json::json!({"kind": "gpu", "count": 1, "milli": 1000}),
            5..=7 => serde_json::json!({"kind": "gpu", "count": 1, "milli": 500, "memory_mib": 20480}),
            _ => serde_json::Value::Null,
        };
        let mut resources = serde_json::json!({"cpu_milli": 100, "memory_mib": 64});
        if !devices.is_null() {
            resources["devices"] = devices;
        }
        serde_json::json!({
            "name": name,
            "queue": "default",
            "kind": "batch",
            "groups": [{
                "name": "main",
                "replicas": 1,
                "resources": resources,
                "task": {"command": "/bin/sh", "args": ["-c", format!("sleep {}.{:03}", ms / 1000, ms % 1000)]}
            }]
        })
        .to_string()
    }

    /// Runs operations until `stop` is set.
    pub async fn run(mut self, stop: Arc<AtomicBool>) {
        while !stop.load(Ordering::Relaxed) {
            let roll = self.rng.below(100);
            if roll < self.spec.submit_pct || self.jobs.is_empty() {
                self.submit().await;
            } else if roll < self.spec.submit_pct + 10 {
                let job = self.jobs[self.rng.below(self.jobs.len() as u64) as usize];
                self.cancel(job).await;
            } else if roll < self.spec.submit_pct + 20 {
                self.queue().await;
            } else {
                let job = self.jobs[self.rng.below(self.jobs.len() as u64) as usize];
                self.read(job).await;
            }
            tokio::time::sleep(Duration::from_millis(self.spec.think_ms)).await;
        }
    }

    /// Runs `f` through the connection, starting at a server picked at random: an unknown
    /// outcome moves on to the next server (a leader hint first), each asked once. Returns every
    /// server asked, in order, and the final result.
    async fn attempt<T, F, Fut>(&mut self, f: F) -> (Vec<usize>, Result<T, ClientError>)
    where
        F: FnMut(CallChannel) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let first = self.pick_server();
        self.conn.start_at(first);
        let mut asked = Vec::new();
        let r = self.conn.call_traced(f, &mut asked).await;
        (asked.iter().filter_map(|a| self.by_link.get(a).copied()).collect(), r)
    }

    fn record(&self, kind: OpKind, invoked_ms: u64, asked: Vec<usize>, outcome: Outcome) {
        let server = asked.last().copied().unwrap_or(0);
        self.history.op(Op { client: self.id, kind, invoked_ms, completed_ms: now_ms(), server, asked, outcome });
    }

    async fn submit(&mut self) {
        self.seq += 1;
        let request_id = format!("c{}-{}", self.id, self.seq);
        let spec_json = self.job_spec(&request_id);
        let retry = Some(RETRY);
        let invoked = now_ms();
        let (asked, r) = self
            .attempt(|ch| {
                let req = pb::SubmitJobRequest {
                    global: false,
                    team: String::new(),
                    client_request_id: request_id.clone(),
                    spec_json: spec_json.clone(),
                    retry,
                };
                async move { JobsClient::new(ch).submit(req).await }
            })
            .await;
        let outcome = match r {
            Ok(resp) => {
                self.jobs.push(resp.job_id);
                Outcome::Ok { job: Some(resp.job_id) }
            }
            Err(s) => classify(&s),
        };
        self.record(OpKind::Submit { request_id }, invoked, asked, outcome);
    }

    async fn cancel(&mut self, job: u64) {
        let invoked = now_ms();
        let (asked, r) = self
            .attempt(|ch| async move {
                JobsClient::new(ch).cancel(pb::CancelJobRequest { job_id: job, reason: "chaos workload".into() }).await
            })
            .await;
        let outcome = match r {
            Ok(_) => Outcome::Ok { job: None },
            Err(s) => classify(&s),
        };
        self.record(OpKind::Cancel { job }, invoked, asked, outcome);
    }

    async fn queue(&mut self) {
        let queue = format!("team-{}", self.rng.below(3));
        let gpu_milli = 1000 * (1 + self.rng.below(8));
        let q = serde_json::json!({"id": queue, "nominal": {"cpu_milli": 64000, "memory_mib": 1 << 20, "gpu_milli": gpu_milli}})
            .to_string();
        let invoked = now_ms();
        let (asked, r) = self
            .attempt(|ch| {
                let q = q.clone();
                async move { QueuesClient::new(ch).upsert(pb::UpsertQueueRequest { queue_json: q }).await }
            })
            .await;
        let outcome = match r {
            Ok(_) => Outcome::Ok { job: None },
            Err(s) => classify(&s),
        };
        self.record(OpKind::Queue { queue, gpu_milli }, invoked, asked, outcome);
    }

    async fn read(&mut self, job: u64) {
        let invoked = now_ms();
        let (asked, r) = self
            .attempt(|ch| async move { JobsClient::new(ch).get(pb::GetJobRequest { job_id: job, stale: false }).await })
            .await;
        let outcome = match r {
            Ok(_) => Outcome::Ok { job: Some(job) },
            Err(s) => classify(&s),
        };
        self.record(OpKind::Read { job }, invoked, asked, outcome);
    }
}

/// Whether a status leaves the outcome unknown (the write may have committed).
fn unknown(c: Code) -> bool {
    matches!(
        c,
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled | Code::Internal | Code::Aborted
    )
}

fn classify(s: &ClientError) -> Outcome {
    let why = format!("{:?}: {}", s.code(), s.message().chars().take(160).collect::<String>());
    if unknown(s.code()) { Outcome::Info { why } } else { Outcome::Fail { why } }
}

/// Starts `n` clients of a cluster; they run until `stop` is set.
pub fn start(
    cluster: &crate::cluster::Cluster,
    clients: usize,
    seed: u64,
    spec: &WorkloadSpec,
    history: &History,
    stop: &Arc<AtomicBool>,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let advertised: Vec<String> = cluster.servers.iter().map(|s| s.addr.clone()).collect();
    let mut handles = Vec::new();
    for c in 0..clients {
        let links: Vec<String> = (0..advertised.len()).map(|j| cluster.link_addr(From::Client(c), j)).collect();
        let client = Client::new(
            c,
            &links,
            &advertised,
            seed ^ ((c as u64 + 1) * 0x2545_F491_4F6C_DD1D),
            spec.clone(),
            history.clone(),
        )?;
        handles.push(tokio::spawn(client.run(stop.clone())));
    }
    Ok(handles)
}
