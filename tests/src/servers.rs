//! Servers and jobs over gRPC; the cluster itself is `suanli_server::local` (feature
//! `testing`), real `suanli server` processes on loopback ports with RocksDB in temp dirs.

use suanli_proto::v1 as pb;
use suanli_proto::v1::jobs_client::JobsClient;
pub use suanli_server::local::{ProcessCluster, channel};
use tonic::transport::Channel;

/// Starts `n` servers of the binary under test.
pub fn start(n: usize, extra: &[&str]) -> ProcessCluster {
    ProcessCluster::start(&crate::bin(), n, extra).unwrap()
}

/// A `Jobs` client connected to `addr`.
pub async fn jobs_client(addr: &str) -> Result<JobsClient<Channel>, tonic::transport::Error> {
    Ok(JobsClient::new(channel(addr).await?))
}

/// A small CPU-only job spec in queue `queue`.
pub fn cpu_job(name: &str, queue: &str, cpu_milli: u64) -> String {
    serde_json::json!({
        "name": name,
        "queue": queue,
        "groups": [{"name": "main", "replicas": 1, "resources": {"cpu_milli": cpu_milli, "memory_mib": 64}}]
    })
    .to_string()
}

/// Retries of the harness's calls: 50 ms doubling to 1 s, at most 20 retries (~15 s).
pub const RETRY: suanli_client::backoff::Backoff =
    suanli_client::backoff::Backoff::new(std::time::Duration::from_millis(50), std::time::Duration::from_secs(1))
        .with_max_retries(20);

/// Every job a server knows (linearizable unless `stale`), by id.
pub async fn all_jobs(addr: &str, stale: bool) -> Result<Vec<pb::JobInfo>, tonic::Status> {
    // Connecting and UNAVAILABLE (leadership moving, a lease not yet confirmed) are retried
    // with the workspace's one backoff.
    let c = RETRY
        .retry(|| jobs_client(addr), |_| true, |e, d| eprintln!("connecting to {addr}: {e:?}; retrying in {d:?}"))
        .await
        .map_err(|e| tonic::Status::unavailable(format!("connecting to {addr}: {e:?}")))?;
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let req = pb::ListJobsRequest { queue: String::new(), states: vec![], limit: 1000, after_id: after, stale };
        let r = RETRY
            .retry(
                || {
                    let mut c = c.clone();
                    let req = req.clone();
                    async move { c.list(req).await }
                },
                |s: &tonic::Status| s.code() == tonic::Code::Unavailable,
                |_, _| {},
            )
            .await?
            .into_inner();
        out.extend(r.jobs);
        if r.next_after_id == 0 {
            return Ok(out);
        }
        after = r.next_after_id;
    }
}
