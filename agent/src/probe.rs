//! Service replicas (docs/services.md): the port a replica serves on, and the readiness and
//! liveness checks the agent runs against it.
//!
//! ```text
//!  start ─▶ port: the spec's, or a free one (SUANLI_PORT) ─▶ service.json in the alloc dir
//!  running ─▶ every period: readiness ─▶ ready / not ready ─▶ ReportStatus(readiness_report)
//!                           liveness  ─▶ failure_threshold failures in a row ─▶ SIGTERM the
//!                                        task's group, SIGKILL 5 s later (the end says
//!                                        "liveness check failed")
//!  autoscaled ─▶ every period_s / 3 (≥ 1 s): the load (the `load` file, or a Prometheus
//!                sample from /metrics) ─▶ reported when it changed, and at least every period_s
//!  report ─────▶ every period_s: latency and success ratio (the `latency_ms` and
//!                `success_ratio` files, or Prometheus samples) ─▶ reported when either is read
//! ```
//!
//! A replica without a readiness check is ready once it runs. A replica is not ready until
//! its first successful check, and stops being ready after `failure_threshold` failures in a
//! row. Checks run from the node (127.0.0.1), so they see the replica as a local load
//! balancer would.

use crate::Agent;
use crate::tasks::Key;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use suanli_model::{Autoscale, LoadSource, MAX_REPORTED_LATENCY_MS, Probe, ProbeKind, ServiceReport, ServiceSpec};
use suanli_proto::v1 as pb;
use tokio::sync::watch;
use tokio::time::Instant;

/// The replica's service settings, in its allocation directory (an agent that adopts the
/// task after a restart reads its port from it).
pub(crate) const SERVICE_FILE: &str = "service.json";
/// Written when a liveness check killed the task: why (the final report says so).
pub(crate) const LIVENESS_FILE: &str = "liveness-failed";

/// The file a replica writes its load into (`source = "file"`): one number.
pub(crate) const LOAD_FILE: &str = "load";
/// Largest load a replica may report (in the metric's units); larger values are capped.
const MAX_LOAD: f64 = 1e12;
/// The file a replica writes its request latency into (`service.report`, `source = "file"`):
/// one number, in ms.
pub(crate) const LATENCY_FILE: &str = "latency_ms";
/// The file a replica writes the fraction of its requests that succeeded into: one number,
/// 0 to 1.
pub(crate) const SUCCESS_FILE: &str = "success_ratio";
/// Largest scrape of a replica's `/metrics` that is read, in bytes.
const MAX_SCRAPE_BYTES: usize = 4 << 20;

/// Between the SIGTERM of a replica that failed its liveness check and the SIGKILL.
const LIVENESS_KILL_GRACE: Duration = Duration::from_secs(5);

/// A service replica as the agent runs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ServiceRun {
    /// The job's service section.
    pub spec: ServiceSpec,
    /// The port the replica serves on (`SUANLI_PORT`).
    pub port: u16,
}

impl ServiceRun {
    /// The allocation's service settings (`None` for work that runs to completion), with the
    /// port: the spec's, or a free one on the node.
    pub fn of(a: &pb::AllocInfo) -> Result<Option<ServiceRun>, String> {
        if a.service_json.is_empty() {
            return Ok(None);
        }
        let spec: ServiceSpec =
            serde_json::from_str(&a.service_json).map_err(|e| format!("its service section cannot be read: {e}"))?;
        let port = if spec.port > 0 { spec.port } else { free_port().map_err(|e| format!("no free port: {e}"))? };
        Ok(Some(ServiceRun { spec, port }))
    }

    /// As written by [`ServiceRun::write`] into `dir`.
    pub fn read(dir: &Path) -> Option<ServiceRun> {
        serde_json::from_slice(&std::fs::read(dir.join(SERVICE_FILE)).ok()?).ok()
    }

    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        crate::sys::write_atomic(&dir.join(SERVICE_FILE), &serde_json::to_vec(self).unwrap_or_default())
    }
}

/// A port no socket of this node holds now. The task binds it moments later; a port is not
/// reserved in between, so another process of the node could take it first (the task then
/// fails to start and the replica is replaced).
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The host part of `addr` (`host:port` or `[v6]:port`), or 127.0.0.1 when there is none.
fn host_of(addr: &str) -> &str {
    match addr.rsplit_once(':') {
        Some((h, _)) if !h.is_empty() => h,
        _ => "127.0.0.1",
    }
}

/// One check of `p` against the replica; `Err(why)` when it fails.
async fn check(p: &Probe, port: u16, dir: &Path, http: &reqwest::Client) -> Result<(), String> {
    let t = Duration::from_millis(p.timeout_ms);
    let late = || format!("no answer within {} ms", p.timeout_ms);
    match p.kind {
        ProbeKind::Http => {
            let url = format!("http://127.0.0.1:{port}{}", p.path);
            let r = tokio::time::timeout(t, http.get(&url).send()).await.map_err(|_| late())?;
            let r = r.map_err(|e| format!("GET {url}: {e}"))?;
            let code = r.status();
            if code.is_success() || code.is_redirection() { Ok(()) } else { Err(format!("GET {url}: HTTP {code}")) }
        }
        ProbeKind::Tcp => {
            let c = tokio::time::timeout(t, tokio::net::TcpStream::connect(("127.0.0.1", port)))
                .await
                .map_err(|_| late())?;
            c.map(drop).map_err(|e| format!("connect 127.0.0.1:{port}: {e}"))
        }
        ProbeKind::Command => {
            let mut c = tokio::process::Command::new(&p.command);
            c.args(&p.args)
                .current_dir(dir)
                .env_clear()
                .env("PATH", std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into()))
                .env("SUANLI_PORT", port.to_string())
                .env("SUANLI_ALLOC_DIR", dir)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .kill_on_drop(true);
            let s = tokio::time::timeout(t, c.status()).await.map_err(|_| late())?;
            match s {
                Ok(s) if s.success() => Ok(()),
                Ok(s) => Err(format!("{} {s}", p.command)),
                Err(e) => Err(format!("{}: {e}", p.command)),
            }
        }
    }
}

/// A finite number from its text.
fn number(text: &str) -> Result<f64, String> {
    let v: f64 = text.trim().parse().map_err(|_| format!("{:?} is not a number", text.trim()))?;
    if v.is_finite() { Ok(v) } else { Err(format!("{v} is not a finite number")) }
}

/// A load value in thousandths, from its text (finite, not negative; capped).
fn milli_of(text: &str) -> Result<u64, String> {
    let v = number(text)?;
    if v < 0.0 {
        return Err(format!("{v} is not a load (finite, at least 0)"));
    }
    Ok((v.min(MAX_LOAD) * 1000.0).round() as u64)
}

/// A latency in ms as microseconds (not negative; capped at an hour).
fn latency_us_of(ms: f64) -> Result<u64, String> {
    if ms < 0.0 {
        return Err(format!("{ms} is not a latency (at least 0 ms)"));
    }
    Ok((ms.min(MAX_REPORTED_LATENCY_MS as f64) * 1000.0).round() as u64)
}

/// A success ratio (0 to 1) in parts per million.
fn success_ppm_of(ratio: f64) -> Result<u32, String> {
    if !(0.0..=1.0).contains(&ratio) {
        return Err(format!("{ratio} is not a success ratio (0 to 1)"));
    }
    Ok((ratio * 1e6).round() as u32)
}

/// The value texts of the samples of `metric` in a Prometheus text exposition (its
/// unlabelled sample, or its labelled ones); an error when there is none.
fn prometheus_samples<'a>(body: &'a str, metric: &str) -> Result<Vec<&'a str>, String> {
    let mut out = Vec::new();
    for line in body.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).unwrap_or(line.len());
        if &line[..name_end] != metric {
            continue;
        }
        let rest = &line[name_end..];
        let rest = match rest.strip_prefix('{') {
            Some(r) => r.split_once('}').map(|(_, v)| v).ok_or_else(|| format!("{metric}: unclosed labels"))?,
            None => rest,
        };
        out.push(rest.split_whitespace().next().ok_or_else(|| format!("{metric}: a sample without a value"))?);
    }
    if out.is_empty() { Err(format!("no sample named {metric}")) } else { Ok(out) }
}

/// The value of `metric` in thousandths: its unlabelled sample, or the sum of its labelled
/// ones (a load).
fn prometheus_value(body: &str, metric: &str) -> Result<u64, String> {
    let mut total = 0u64;
    for v in prometheus_samples(body, metric)? {
        total = total.saturating_add(milli_of(v)?);
    }
    Ok(total)
}

/// The mean of the samples of `metric` (a latency, a ratio).
fn prometheus_mean(body: &str, metric: &str) -> Result<f64, String> {
    let samples = prometheus_samples(body, metric)?;
    let mut sum = 0.0;
    for v in &samples {
        sum += number(v).map_err(|e| format!("{metric}: {e}"))?;
    }
    Ok(sum / samples.len() as f64)
}

/// `GET http://127.0.0.1:{port}/metrics` (its first 4 MiB).
async fn scrape(port: u16, http: &reqwest::Client) -> Result<String, String> {
    let url = format!("http://127.0.0.1:{port}/metrics");
    let r = http.get(&url).timeout(Duration::from_secs(2)).send().await.map_err(|e| format!("{url}: {e}"))?;
    if !r.status().is_success() {
        return Err(format!("{url}: {}", r.status()));
    }
    let mut body = r.text().await.map_err(|e| format!("{url}: {e}"))?;
    if body.len() > MAX_SCRAPE_BYTES {
        let mut end = MAX_SCRAPE_BYTES;
        while !body.is_char_boundary(end) {
            end -= 1;
        }
        body.truncate(end);
    }
    Ok(body)
}

/// Reads the replica's load as its autoscaling section says.
async fn read_load(a: &Autoscale, port: u16, dir: &Path, http: &reqwest::Client) -> Result<u64, String> {
    match a.source {
        LoadSource::File => {
            let text = tokio::fs::read_to_string(dir.join(LOAD_FILE)).await.map_err(|e| format!("{LOAD_FILE}: {e}"))?;
            milli_of(&text)
        }
        LoadSource::Prometheus => prometheus_value(&scrape(port, http).await?, &a.metric),
    }
}

/// What a replica reports with its readiness (each absent when not read).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Measured {
    /// Its load (`service.autoscale`), in thousandths.
    load_milli: Option<u64>,
    /// Its request latency (`service.report`), in microseconds.
    latency_us: Option<u64>,
    /// The fraction of its requests that succeeded, in parts per million.
    success_ppm: Option<u32>,
}

/// Reads the replica's latency and success ratio as its `service.report` section says; one
/// that cannot be read (no file yet, no sample, not a number, out of range) is left out.
async fn read_report(r: &ServiceReport, port: u16, dir: &Path, http: &reqwest::Client) -> Measured {
    let (latency, success) = match r.source {
        LoadSource::File => {
            let read = |name: &'static str| {
                let path = dir.join(name);
                async move {
                    let text = tokio::fs::read_to_string(path).await.map_err(|e| format!("{name}: {e}"))?;
                    number(&text).map_err(|e| format!("{name}: {e}"))
                }
            };
            (read(LATENCY_FILE).await, read(SUCCESS_FILE).await)
        }
        LoadSource::Prometheus => match scrape(port, http).await {
            Ok(body) => (prometheus_mean(&body, &r.latency_metric), prometheus_mean(&body, &r.success_metric)),
            Err(e) => (Err(e.clone()), Err(e)),
        },
    };
    let latency_us = latency.and_then(latency_us_of).map_err(|e| tracing::debug!(error = %e, "latency not read")).ok();
    let success_ppm =
        success.and_then(success_ppm_of).map_err(|e| tracing::debug!(error = %e, "success ratio not read")).ok();
    Measured { latency_us, success_ppm, ..Measured::default() }
}

/// When the load is read next, and what was last told and when.
struct LoadDue {
    every: Duration,
    refresh: Duration,
    next: Instant,
    told: Option<(u64, Instant)>,
}

/// A probe's schedule and its failures in a row.
struct Due {
    probe: Probe,
    next: Instant,
    failures: u32,
}

impl Due {
    fn new(p: &Probe, started: Instant) -> Due {
        Due { probe: p.clone(), next: started + Duration::from_millis(p.initial_delay_ms), failures: 0 }
    }
}

/// Runs the replica's checks until `ended` turns true (its task ended) and reports its
/// readiness whenever it changes (retried each period until the control plane takes it).
pub(crate) async fn watch(
    agent: Arc<Agent>,
    k: Key,
    dir: PathBuf,
    run: ServiceRun,
    pgid: i32,
    mut ended: watch::Receiver<bool>,
) {
    let http = match reqwest::Client::builder().no_proxy().redirect(reqwest::redirect::Policy::none()).build() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "cannot build the HTTP client for checks; the replica is never reported ready");
            return;
        }
    };
    let endpoint = format!("{}:{}", host_of(&agent.agent_addr), run.port);
    let started = Instant::now();
    let mut readiness = run.spec.readiness.as_ref().map(|p| Due::new(p, started));
    let mut liveness = run.spec.liveness.as_ref().map(|p| Due::new(p, started));
    let mut ready = readiness.is_none();
    let mut told: Option<bool> = None;
    let autoscale = run.spec.autoscale.clone();
    let mut load = autoscale.as_ref().map(|a| {
        let period = Duration::from_secs(a.period_s);
        LoadDue { every: (period / 3).max(Duration::from_secs(1)), refresh: period, next: started, told: None }
    });
    // When the latency and success ratio are read next (once a period).
    let report = run.spec.report.clone();
    let mut report_next = report.as_ref().map(|_| started);
    let idle = Duration::from_secs(1);
    loop {
        if told != Some(ready) {
            match tell(&agent, k, ready, &endpoint, Measured::default()).await {
                Ok(()) => {
                    tracing::info!(ready, endpoint = %endpoint, "readiness reported");
                    told = Some(ready);
                }
                Err(true) => return, // the allocation is gone or stale: nothing more to say
                Err(false) => {}
            }
        }
        let now = Instant::now();
        let next = [readiness.as_ref(), liveness.as_ref()]
            .into_iter()
            .flatten()
            .map(|d| d.next)
            .chain(load.as_ref().map(|l| l.next))
            .chain(report_next)
            .min();
        // An untold readiness is retried within a second.
        let wake = match next {
            Some(t) if told == Some(ready) => t,
            Some(t) => t.min(now + idle),
            None => now + if told == Some(ready) { Duration::from_secs(3600) } else { idle },
        };
        tokio::select! {
            () = tokio::time::sleep_until(wake) => {}
            r = ended.changed() => if r.is_err() || *ended.borrow() { return },
        }
        if *ended.borrow() {
            return;
        }
        let now = Instant::now();
        if let Some(d) = readiness.as_mut().filter(|d| d.next <= now) {
            d.next = now + Duration::from_millis(d.probe.period_ms);
            match check(&d.probe, run.port, &dir, &http).await {
                Ok(()) => {
                    d.failures = 0;
                    ready = true;
                }
                Err(why) => {
                    d.failures = d.failures.saturating_add(1);
                    if ready && d.failures >= d.probe.failure_threshold {
                        tracing::warn!(failures = d.failures, error = %why, "readiness check failing: not ready");
                        ready = false;
                    }
                }
            }
        }
        if let (Some(l), Some(a)) = (load.as_mut().filter(|l| l.next <= now), autoscale.as_ref()) {
            l.next = now + l.every;
            match read_load(a, run.port, &dir, &http).await {
                Ok(v) => {
                    let stale = l.told.is_none_or(|(last, at)| last != v || now.duration_since(at) >= l.refresh);
                    if stale {
                        let m = Measured { load_milli: Some(v), ..Measured::default() };
                        match tell(&agent, k, ready, &endpoint, m).await {
                            Ok(()) => {
                                l.told = Some((v, now));
                                told = Some(ready);
                            }
                            Err(true) => return,
                            Err(false) => {}
                        }
                    }
                }
                Err(why) => tracing::debug!(error = %why, "load not read"),
            }
        }
        if let (Some(next), Some(r)) = (report_next.as_mut().filter(|n| **n <= now), report.as_ref()) {
            *next = now + Duration::from_secs(r.period_s);
            let m = read_report(r, run.port, &dir, &http).await;
            if m != Measured::default() {
                match tell(&agent, k, ready, &endpoint, m).await {
                    Ok(()) => told = Some(ready),
                    Err(true) => return,
                    Err(false) => {}
                }
            }
        }
        if let Some(d) = liveness.as_mut().filter(|d| d.next <= now) {
            d.next = now + Duration::from_millis(d.probe.period_ms);
            match check(&d.probe, run.port, &dir, &http).await {
                Ok(()) => d.failures = 0,
                Err(why) => {
                    d.failures = d.failures.saturating_add(1);
                    if d.failures >= d.probe.failure_threshold {
                        let why = format!("{} failures in a row, last: {why}", d.failures);
                        tracing::warn!(error = %why, "liveness check failed: killing the task");
                        if let Err(e) = crate::sys::write_atomic(&dir.join(LIVENESS_FILE), why.as_bytes()) {
                            tracing::warn!(error = %e, "recording the liveness failure");
                        }
                        // SIGTERM first: the shim outlives it and records how the task ended.
                        if let Err(e) = crate::sys::kill_group(pgid, libc::SIGTERM) {
                            tracing::warn!(error = %e, "SIGTERM after the liveness failure");
                        }
                        tokio::select! {
                            () = tokio::time::sleep(LIVENESS_KILL_GRACE) => {
                                tracing::warn!("the task outlived the liveness grace: SIGKILL");
                                let _ = crate::sys::kill_group(pgid, libc::SIGKILL);
                            }
                            _ = ended.changed() => {}
                        }
                        return;
                    }
                }
            }
        }
    }
}

/// Reports the replica's readiness, with what was measured. `Err(true)`: refused for good
/// (the allocation ended or is unknown); `Err(false)`: not delivered, try again.
async fn tell(agent: &Agent, k: Key, ready: bool, endpoint: &str, m: Measured) -> Result<(), bool> {
    let req = pb::ReportStatusRequest {
        alloc_id: k.0,
        epoch: k.1,
        status: pb::AllocReport::Running as i32,
        readiness_report: true,
        ready,
        endpoint: endpoint.to_owned(),
        load_milli: m.load_milli,
        latency_us: m.latency_us,
        success_ppm: m.success_ppm,
        ..Default::default()
    };
    let r = agent
        .servers
        .call(|mut c| {
            let req = req.clone();
            async move { c.report_status(req).await }
        })
        .await;
    match r {
        Ok(_) => Ok(()),
        Err(e) if matches!(e.code(), tonic::Code::FailedPrecondition | tonic::Code::NotFound) => Err(true),
        Err(e) => {
            tracing::debug!(error = %e, "readiness report failed; will retry");
            Err(false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_are_read_from_text_and_prometheus_samples() {
        assert_eq!(milli_of(" 12.5\n"), Ok(12_500));
        assert!(milli_of("-1").is_err());
        assert!(milli_of("NaN").is_err());
        assert!(milli_of("lots").is_err());
        let body =
            "# HELP q queue\n# TYPE q gauge\nq 3\nq_total 99\nreq{path=\"/a\"} 2\nreq{path=\"/b\"} 1.5 1700000000\n";
        assert_eq!(prometheus_value(body, "q"), Ok(3_000));
        assert_eq!(prometheus_value(body, "req"), Ok(3_500));
        assert!(prometheus_value(body, "missing").is_err());
    }

    #[tokio::test]
    async fn latency_and_success_are_read_from_files_and_prometheus_samples() {
        let dir = tempfile::tempdir().expect("dir");
        let http = reqwest::Client::builder().no_proxy().build().expect("client");
        let file = ServiceReport::default();
        // Nothing written yet: nothing to report.
        assert_eq!(read_report(&file, 1, dir.path(), &http).await, Measured::default());
        std::fs::write(dir.path().join(LATENCY_FILE), "12.25\n").expect("write");
        std::fs::write(dir.path().join(SUCCESS_FILE), "0.995").expect("write");
        let m = read_report(&file, 1, dir.path(), &http).await;
        assert_eq!((m.latency_us, m.success_ppm, m.load_milli), (Some(12_250), Some(995_000), None));
        // A ratio above 1 is left out, the latency still goes; a day of latency is capped.
        std::fs::write(dir.path().join(SUCCESS_FILE), "1.5").expect("write");
        std::fs::write(dir.path().join(LATENCY_FILE), "86400000").expect("write");
        let m = read_report(&file, 1, dir.path(), &http).await;
        assert_eq!((m.latency_us, m.success_ppm), (Some(MAX_REPORTED_LATENCY_MS * 1000), None));
        assert!(latency_us_of(-1.0).is_err());
        assert!(success_ppm_of(-0.1).is_err());
        assert!(number("NaN").is_err());

        // Prometheus samples: the mean of labelled ones.
        let body = "# TYPE p99 gauge\np99{route=\"/a\"} 10\np99{route=\"/b\"} 30\nok 0.75\n";
        assert_eq!(prometheus_mean(body, "p99"), Ok(20.0));
        assert_eq!(prometheus_mean(body, "ok"), Ok(0.75));
        assert!(prometheus_mean(body, "missing").is_err());
        assert!(prometheus_mean("ok +Inf\n", "ok").is_err());
    }

    #[test]
    fn hosts_of_addresses() {
        assert_eq!(host_of("10.0.0.7:7401"), "10.0.0.7");
        assert_eq!(host_of("[::1]:7401"), "[::1]");
        assert_eq!(host_of(""), "127.0.0.1");
    }

    #[tokio::test]
    async fn checks_pass_and_fail() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = l.local_addr().expect("addr").port();
        let dir = tempfile::tempdir().expect("dir");
        let http = reqwest::Client::builder().no_proxy().build().expect("client");
        let p = |kind| Probe {
            kind,
            path: "/healthz".into(),
            command: "true".into(),
            args: Vec::new(),
            period_ms: 100,
            timeout_ms: 500,
            failure_threshold: 1,
            initial_delay_ms: 0,
        };
        assert_eq!(check(&p(ProbeKind::Tcp), port, dir.path(), &http).await, Ok(()));
        assert_eq!(check(&p(ProbeKind::Command), port, dir.path(), &http).await, Ok(()));
        let f = Probe { command: "false".into(), ..p(ProbeKind::Command) };
        assert!(check(&f, port, dir.path(), &http).await.is_err());
        // An HTTP server (its own listener: the TCP check's connection waits in the first one's
        // backlog) answering 503, then 200.
        drop(l);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = l.local_addr().expect("addr").port();
        let server = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            for status in ["503 Service Unavailable", "200 OK"] {
                let (mut s, _) = l.accept().await.expect("accept");
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let body = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                s.write_all(body.as_bytes()).await.expect("write");
            }
        });
        let e = check(&p(ProbeKind::Http), port, dir.path(), &http).await.expect_err("503 fails");
        assert!(e.contains("503"), "{e}");
        assert_eq!(check(&p(ProbeKind::Http), port, dir.path(), &http).await, Ok(()));
        server.await.expect("server");
        drop(dir);
        let closed = free_port().expect("port");
        assert!(check(&p(ProbeKind::Tcp), closed, Path::new("/"), &http).await.is_err());
    }
}
