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

/// Every job a server knows (linearizable unless `stale`), by id.
pub async fn all_jobs(addr: &str, stale: bool) -> Result<Vec<pb::JobInfo>, tonic::Status> {
    let mut c = {
        let mut tries = 0;
        loop {
            match jobs_client(addr).await {
                Ok(c) => break c,
                Err(e) if tries < 20 => {
                    tries += 1;
                    eprintln!("connecting to {addr}: {e:?}; retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(e) => return Err(tonic::Status::unavailable(format!("connecting to {addr}: {e:?}"))),
            }
        }
    };
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let req = pb::ListJobsRequest { queue: String::new(), states: vec![], limit: 1000, after_id: after, stale };
        // UNAVAILABLE is the server's "retry": leadership moving, or a lease not yet confirmed.
        let mut tries = 0;
        let r = loop {
            match c.list(req.clone()).await {
                Ok(r) => break r.into_inner(),
                Err(s) if s.code() == tonic::Code::Unavailable && tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(s) => return Err(s),
            }
        };
        out.extend(r.jobs);
        if r.next_after_id == 0 {
            return Ok(out);
        }
        after = r.next_after_id;
    }
}
