//! The one authorization layer: every call on the client and peer listeners goes through it
//! before any handler runs. It names the caller, limits its rate, checks the access matrix
//! (`suanli_security::policy`) and the object the call is about, hands the caller to the
//! handler, and writes mutating and denied calls to the audit log.
//!
//! ```text
//!  request ─▶ caller: bearer token (verified here) │ TLS certificate (PeerInfo) │ anonymous │ insecure
//!          ─▶ rate limit (users; anonymous by address) ── over ─▶ RESOURCE_EXHAUSTED
//!          ─▶ policy::rule(path) + decide ── none/deny ─▶ PERMISSION_DENIED / UNAUTHENTICATED
//!          ─▶ AllowIfTeam / AllowIfNode: the unary request is buffered (max_request_bytes) and decoded:
//!               job, queue, node or allocation ─▶ its team / node ── another ─▶ PERMISSION_DENIED
//!          ─▶ extensions += Principal ─▶ handler ─▶ answer (its grpc-status, headers or trailers)
//!          ─▶ audit (mutating calls; denials of authenticated callers) ─▶ bounded channel
//!               ─▶ batches (≤ 200 ms or 256 entries) ─▶ Command::RecordAudit through Core
//! ```
//!
//! An object that does not exist is not checked: the handler answers (NOT_FOUND, or the
//! command's own refusal). A caller with a token is the token's user, whatever certificate its
//! connection presented. It never lets a call through without a rule, and never blocks on the
//! audit log (a full channel drops the entry and counts it).

use crate::core::Core;
use bytes::{Buf, Bytes};
use http_body::Frame;
use http_body_util::BodyExt;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use suanli_client::code_name;
use suanli_model::{AllocId, JobId, JobSpec, Node, QueueId};
use suanli_proto::v1 as pb;
use suanli_security::policy::{self, Decision, Listener};
use suanli_security::tls::PeerInfo;
use suanli_security::{Principal, token};
use suanli_state::security::MAX_AUDIT_TEXT;
use suanli_state::{AuditEntry, Command, RecordAudit, State};
use tokio::sync::mpsc;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::{Code, Status};

/// Audit entries waiting to be proposed, at most.
const AUDIT_QUEUE: usize = 4096;
/// Most entries in one `RecordAudit`.
const AUDIT_BATCH: usize = 256;
/// Longest an entry waits for its batch to fill.
const AUDIT_LINGER: Duration = Duration::from_millis(200);
/// Most callers the rate limiter tracks; beyond it, new callers share one bucket until idle
/// ones are forgotten.
const MAX_RATE_KEYS: usize = 10_000;
/// How often a dropped audit entry or a rate-limited caller is logged, at most.
const WARN_EVERY_MS: u64 = 60_000;
/// Deepest queue hierarchy searched for a team.
const MAX_QUEUE_DEPTH: usize = 32;

/// The authorization shared by both listeners of a server: the audit channel, the rate
/// limiter, the cached token key.
#[derive(Clone)]
pub(crate) struct Access {
    shared: Arc<Shared>,
}

struct Shared {
    core: Arc<Core>,
    insecure: bool,
    audit: mpsc::Sender<AuditEntry>,
    dropped: AtomicU64,
    last_drop_warn_ms: AtomicU64,
    last_limit_warn_ms: AtomicU64,
    limiter: Option<Mutex<Limiter>>,
    /// The token signing key (the first committed key is the cluster's for good).
    key: OnceLock<Vec<u8>>,
}

impl Access {
    /// The layer's shared part; starts the task that proposes audit entries (it ends when
    /// every layer is dropped, that is when both listeners stopped). `insecure`: every caller
    /// is [`Principal::Insecure`].
    pub fn start(core: Arc<Core>, insecure: bool) -> Access {
        let (tx, rx) = mpsc::channel(AUDIT_QUEUE);
        let limiter = (core.cfg.rate_limit_per_s > 0)
            .then(|| Mutex::new(Limiter::new(core.cfg.rate_limit_per_s, core.cfg.rate_limit_burst)));
        tokio::spawn(audit_loop(core.clone(), rx));
        Access {
            shared: Arc::new(Shared {
                core,
                insecure,
                audit: tx,
                dropped: AtomicU64::new(0),
                last_drop_warn_ms: AtomicU64::new(0),
                last_limit_warn_ms: AtomicU64::new(0),
                limiter,
                key: OnceLock::new(),
            }),
        }
    }

    /// The layer for one listener (`Listener::Client` or `Listener::Peer`).
    pub fn layer(&self, listener: Listener) -> AccessLayer {
        AccessLayer { shared: self.shared.clone(), listener }
    }

    /// Who sent a request with these headers over this connection, by the same rules as the
    /// gRPC listeners (a bearer token, else the certificate, else anonymous; `Insecure` on an
    /// insecure server): what the HTTP listener (`/metrics`, the dashboard) authorizes by.
    pub fn principal(&self, headers: &http::HeaderMap, peer: Option<&PeerInfo>) -> Result<Principal, Status> {
        self.shared.principal(headers, peer)
    }
}

/// The tower layer (`Server::builder().layer(...)`).
#[derive(Clone)]
pub(crate) struct AccessLayer {
    shared: Arc<Shared>,
    listener: Listener,
}

impl<S> tower::Layer<S> for AccessLayer {
    type Service = AccessService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AccessService { inner, shared: self.shared.clone(), listener: self.listener }
    }
}

/// The layer's service.
#[derive(Clone)]
pub(crate) struct AccessService<S> {
    inner: S,
    shared: Arc<Shared>,
    listener: Listener,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>;

impl<S> tower::Service<http::Request<Body>> for AccessService<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        // The clone is not ready; the one that was polled serves this call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        let listener = self.listener;
        Box::pin(async move { shared.handle(listener, req, inner).await })
    }
}

/// What a call was about, for the audit log and the object checks.
#[derive(Debug, Default)]
struct Target {
    /// A short description ("queue q1", "job 42", "node n1 drain").
    text: String,
    /// Queues the call submits into.
    queues: Vec<QueueId>,
    /// The job it acts on.
    job: Option<JobId>,
    /// The node it names.
    node: Option<String>,
    /// The allocation it reports on.
    alloc: Option<AllocId>,
    /// The team a global submit is charged to (`Jobs.Submit{global}`), instead of a queue of
    /// this region; empty: the caller's team.
    team: Option<String>,
}

/// One call as the layer saw it, until its answer is known.
struct Pending {
    principal: String,
    method: String,
    target: String,
    remote: String,
}

impl Shared {
    async fn handle<S>(
        self: Arc<Self>,
        listener: Listener,
        mut req: http::Request<Body>,
        mut inner: S,
    ) -> Result<http::Response<Body>, S::Error>
    where
        S: tower::Service<http::Request<Body>, Response = http::Response<Body>> + Send + 'static,
        S::Future: Send + 'static,
    {
        let path = req.uri().path().to_owned();
        let peer = req.extensions().get::<PeerInfo>().cloned();
        let remote = peer.as_ref().and_then(|p| p.remote).or_else(|| {
            req.extensions().get::<tonic::transport::server::TcpConnectInfo>().and_then(|c| c.remote_addr())
        });
        let remote_text = remote.map(|r| r.to_string()).unwrap_or_default();
        let who = match self.principal(req.headers(), peer.as_ref()) {
            Ok(p) => p,
            Err(s) => {
                tracing::info!(method = %path, remote = %remote_text, error = %s.message(), "refused: bad token");
                return Ok(s.into_http());
            }
        };
        if let Err(s) = self.rate_limit(&who, remote) {
            return Ok(s.into_http());
        }
        let pending = |target: &str| Pending {
            principal: who.to_string(),
            method: path.clone(),
            target: target.to_owned(),
            remote: remote_text.clone(),
        };
        let Some(rule) = policy::rule(&path).filter(|r| served_on(r, listener)) else {
            let s = match policy::rule(&path) {
                // A federation method at a region server's address: say what this address is.
                Some(r)
                    if matches!(r.listener, Listener::Federation | Listener::FederationPeer)
                        && matches!(listener, Listener::Client | Listener::Peer) =>
                {
                    let method = path.trim_start_matches('/').replace("suanli.v1.", "");
                    Status::permission_denied(format!(
                        "this address is a region server; {method} is served by a federation server \
                         (suanli federation serve)"
                    ))
                }
                _ => Status::permission_denied(format!("{path}: unknown method (not in the access matrix)")),
            };
            self.denied(&who, pending(""), &s);
            return Ok(s.into_http());
        };
        let decision = policy::decide(rule, &who);
        if matches!(decision, Decision::Unauthenticated) {
            let s = Status::unauthenticated(format!(
                "{path} needs a credential: a client certificate signed by the cluster's CA, or a bearer token"
            ));
            self.denied(&who, pending(""), &s);
            return Ok(s.into_http());
        }
        if let Decision::Deny(why) = &decision {
            let s = Status::permission_denied(why.clone());
            self.denied(&who, pending(""), &s);
            return Ok(s.into_http());
        }
        let checks_object = matches!(decision, Decision::AllowIfTeam(_) | Decision::AllowIfNode(_));
        let mut target = Target::default();
        if rule.mutating || checks_object {
            let (parts, body) = req.into_parts();
            let bytes = match self.buffer(body).await {
                Ok(b) => b,
                Err(s) => {
                    if rule.mutating {
                        self.answered(&who, pending(""), &s);
                    }
                    return Ok(s.into_http());
                }
            };
            let strict = checks_object;
            match message(&bytes).and_then(|m| inspect(&path, m, strict)) {
                Ok(t) => target = t,
                // Only a caller whose object must be checked needs a readable request; for
                // the audit alone, the handler answers a bad one.
                Err(s) if strict => {
                    self.answered(&who, pending(""), &s);
                    return Ok(s.into_http());
                }
                Err(_) => {}
            }
            let object = self.core.state.read(|s| self.check_object(s, &decision, &who, &path, &target));
            if let Err(s) = object {
                self.denied(&who, pending(&target.text), &s);
                return Ok(s.into_http());
            }
            req = http::Request::from_parts(parts, Body::new(http_body_util::Full::new(bytes)));
        }
        req.extensions_mut().insert(who.clone());
        let resp = inner.call(req).await?;
        if !rule.mutating {
            return Ok(resp);
        }
        let pending = pending(&target.text);
        // An error answered at once carries its status in the headers (trailers-only).
        if let Some(s) = Status::from_header_map(resp.headers()) {
            self.answered(&who, pending, &s);
            return Ok(resp);
        }
        let (parts, body) = resp.into_parts();
        let body = AuditBody { inner: body, pending: Some((pending, self.clone(), who)) };
        Ok(http::Response::from_parts(parts, Body::new(body)))
    }

    /// The caller: the bearer token's user, else the TLS certificate's identity, else
    /// anonymous; on an insecure server, [`Principal::Insecure`].
    fn principal(&self, headers: &http::HeaderMap, peer: Option<&PeerInfo>) -> Result<Principal, Status> {
        if self.insecure {
            return Ok(Principal::Insecure);
        }
        if let Some(v) = headers.get(token::METADATA_KEY) {
            let tok = token::bearer(v.as_bytes()).map_err(Status::unauthenticated)?;
            let key = match self.key.get() {
                Some(k) => k.clone(),
                None => match self.core.state.read(State::token_key) {
                    Some(k) => self.key.get_or_init(|| k).clone(),
                    None => {
                        return Err(Status::unauthenticated(format!("authorization: {}", token::TokenError::NoKey)));
                    }
                },
            };
            let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
            let claims = token::verify(&key, tok, now, |id| self.core.state.read(|s| s.token_revoked(id)))
                .map_err(|e| Status::unauthenticated(format!("authorization: {e}")))?;
            return Ok(claims.principal());
        }
        Ok(peer.and_then(|p| p.principal.clone()).unwrap_or(Principal::Anonymous))
    }

    /// Users by identity and anonymous callers by address; nodes, servers and insecure
    /// callers are not limited.
    fn rate_limit(&self, who: &Principal, remote: Option<SocketAddr>) -> Result<(), Status> {
        let Some(limiter) = &self.limiter else { return Ok(()) };
        let key = match who {
            Principal::User { .. } => who.to_string(),
            Principal::Anonymous => format!("anonymous@{}", remote.map(|r| r.ip().to_string()).unwrap_or_default()),
            Principal::Node { .. } | Principal::Server { .. } | Principal::Insecure => return Ok(()),
        };
        let ok =
            limiter.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take(&key, tokio::time::Instant::now());
        if ok {
            return Ok(());
        }
        let (per_s, burst) = (self.core.cfg.rate_limit_per_s, self.core.cfg.rate_limit_burst);
        if self.every_minute(&self.last_limit_warn_ms) {
            tracing::warn!(caller = %key, per_s, burst, "rate limit reached (logged once a minute)");
        }
        Err(Status::resource_exhausted(format!(
            "rate limit: {key} made more than {per_s} calls/s (burst {burst}; the server's rate_limit_per_s and rate_limit_burst); retry later"
        )))
    }

    /// The request's body, whole, bounded by `max_request_bytes` (and the frame's header) and
    /// by the request timeout.
    async fn buffer(&self, body: Body) -> Result<Bytes, Status> {
        let max = self.core.cfg.max_request_bytes;
        // The services decode up to `max_request_bytes` + 64 KiB (so a handler can name the
        // field that is over the limit, e.g. `spec_json`); buffer as much, plus the frame header.
        let limited = http_body_util::Limited::new(body, max.saturating_add(64 * 1024 + 5));
        match tokio::time::timeout(self.core.timeout(), limited.collect()).await {
            Err(_) => Err(Status::deadline_exceeded("the request's body did not arrive within the request timeout")),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                Err(Status::resource_exhausted(format!("request: over the limit of {max} bytes (max_request_bytes)")))
            }
            Ok(Err(e)) => Err(Status::cancelled(format!("request: reading the body: {e}"))),
            Ok(Ok(c)) => Ok(c.to_bytes()),
        }
    }

    /// The object check of a member (`AllowIfTeam`) or an agent (`AllowIfNode`).
    fn check_object(
        &self,
        s: &State,
        decision: &Decision,
        who: &Principal,
        method: &str,
        t: &Target,
    ) -> Result<(), Status> {
        match decision {
            Decision::AllowIfTeam(team) => {
                if let Some(charged) = t.team.as_ref().filter(|c| !c.is_empty() && *c != team) {
                    return Err(Status::permission_denied(format!(
                        "{who} may not call {method} for team {charged} (only for team {team})"
                    )));
                }
                let mut queues: Vec<QueueId> = t.queues.clone();
                if let Some(job) = t.job.and_then(|j| s.job(j)) {
                    queues.push(job.spec.queue.clone());
                }
                for q in &queues {
                    if let Some(owner) = queue_team(s, q)
                        && owner != *team
                    {
                        let owner = if owner.is_empty() { "no team".to_owned() } else { format!("team {owner}") };
                        return Err(Status::permission_denied(format!(
                            "{who} may not call {method} for queue {q} of {owner} (only for team {team}'s queues)"
                        )));
                    }
                }
                Ok(())
            }
            Decision::AllowIfNode(own) => {
                let about = match (&t.node, t.alloc) {
                    (Some(n), _) => Some(n.clone()),
                    (None, Some(a)) => s.allocs().get(&a).map(|a| a.alloc.node.0.clone()),
                    (None, None) => None,
                };
                match about {
                    Some(n) if n != *own => Err(Status::permission_denied(format!(
                        "{who} may not call {method} for node {n} (only for its own node, {own})"
                    ))),
                    _ => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    /// A call the layer refused: logged; recorded when it was mutating or its caller is
    /// authenticated.
    fn denied(&self, who: &Principal, p: Pending, s: &Status) {
        tracing::info!(caller = %who, method = %p.method, remote = %p.remote, code = code_name(s.code()), message = %s.message(), "denied");
        if !matches!(who, Principal::Anonymous) {
            self.record(p, s.code(), s.message());
        }
    }

    /// A call's answer (mutating calls): recorded unless the caller is anonymous.
    fn answered(&self, who: &Principal, p: Pending, s: &Status) {
        if matches!(who, Principal::Anonymous) {
            tracing::info!(method = %p.method, remote = %p.remote, code = code_name(s.code()), "anonymous call answered");
            return;
        }
        self.record(p, s.code(), s.message());
    }

    fn record(&self, p: Pending, code: Code, message: &str) {
        let entry = AuditEntry {
            at_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
            principal: cut(&p.principal),
            method: cut(&p.method),
            target: cut(&p.target),
            code: code_name(code).to_owned(),
            message: cut(message),
            server: self.core.id,
            remote: p.remote,
        };
        if self.audit.try_send(entry).is_err() {
            let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if self.every_minute(&self.last_drop_warn_ms) {
                tracing::warn!(
                    dropped_total = n,
                    queue = AUDIT_QUEUE,
                    "audit queue full: entries dropped (logged once a minute)"
                );
            }
        }
    }

    /// True at most once per [`WARN_EVERY_MS`] for one `last` marker.
    fn every_minute(&self, last: &AtomicU64) -> bool {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let prev = last.load(Ordering::Relaxed);
        now.saturating_sub(prev) >= WARN_EVERY_MS
            && last.compare_exchange(prev, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }
}

/// Whether `rule` is served on `listener` (health checks are served everywhere).
fn served_on(rule: &policy::Rule, listener: Listener) -> bool {
    rule.allow == policy::Allow::Anyone || rule.listener == listener
}

/// The team that owns queue `q`: its own `team`, else its nearest ancestor's; `Some("")` for a
/// queue no team owns, `None` for an unknown queue.
pub(crate) fn queue_team(s: &State, q: &QueueId) -> Option<String> {
    let mut queue = s.queues().get(q)?;
    for _ in 0..MAX_QUEUE_DEPTH {
        if !queue.team.is_empty() {
            return Some(queue.team.clone());
        }
        match queue.parent.as_ref().and_then(|p| s.queues().get(p)) {
            Some(parent) => queue = parent,
            None => break,
        }
    }
    Some(String::new())
}

/// The one message of a unary gRPC request body (flag byte, 4-byte big-endian length, the
/// message).
fn message(body: &[u8]) -> Result<&[u8], Status> {
    let bad = |why: &str| Status::invalid_argument(format!("request: {why}"));
    if body.len() < 5 {
        return Err(bad("not a gRPC message (under 5 bytes)"));
    }
    if body[0] != 0 {
        return Err(bad("compressed messages are not accepted"));
    }
    let mut len = &body[1..5];
    let n = len.get_u32() as usize;
    if body.len() - 5 != n {
        return Err(bad(&format!(
            "one message of {n} bytes expected, the body holds {} bytes after the header",
            body.len() - 5
        )));
    }
    Ok(&body[5..])
}

/// Decodes what a call is about. `strict`: the objects must be read exactly as the handler
/// will read them (the checks depend on it); otherwise only the audit text is wanted.
fn inspect(path: &str, msg: &[u8], strict: bool) -> Result<Target, Status> {
    use prost::Message;
    let bad = |e: prost::DecodeError| Status::invalid_argument(format!("request: {e}"));
    let mut t = Target::default();
    let method = path.rsplit('/').next().unwrap_or_default();
    let service = path.trim_start_matches('/').split('/').next().unwrap_or_default();
    match (service, method) {
        ("suanli.v1.Jobs", "Submit") => {
            let r = pb::SubmitJobRequest::decode(msg).map_err(bad)?;
            if r.global {
                // Charged to a team worldwide, not to a queue of this region.
                t.text = if r.team.is_empty() { "global".into() } else { format!("global, team {}", r.team) };
                t.team = Some(r.team);
            } else {
                let q = spec_queue("spec_json", &r.spec_json, strict)?;
                t.text = format!("queue {q}");
                t.queues.push(q);
            }
        }
        ("suanli.v1.Jobs", "SubmitMany") => {
            let r = pb::SubmitJobsRequest::decode(msg).map_err(bad)?;
            for (i, j) in r.jobs.iter().enumerate() {
                let q = spec_queue(&format!("jobs[{i}].spec_json"), &j.spec_json, strict)?;
                if !t.queues.contains(&q) {
                    t.queues.push(q);
                }
            }
            let names: Vec<&str> = t.queues.iter().map(QueueId::as_str).collect();
            t.text = format!("{} jobs into queue {}", r.jobs.len(), names.join(", "));
        }
        ("suanli.v1.Jobs", "Cancel") => {
            let r = pb::CancelJobRequest::decode(msg).map_err(bad)?;
            t.text = format!("job {}", r.job_id);
            t.job = Some(JobId(r.job_id));
        }
        ("suanli.v1.Jobs", "Migrate") => {
            let r = pb::MigrateJobRequest::decode(msg).map_err(bad)?;
            let to = match (r.to_pool.as_str(), r.to_node.as_str()) {
                ("", "") => String::new(),
                (p, "") => format!(" to pool {p}"),
                (_, n) => format!(" to node {n}"),
            };
            t.text = format!("job {}{to}", r.job_id);
            t.job = Some(JobId(r.job_id));
        }
        ("suanli.v1.Jobs", "UpdateService") => {
            let r = pb::UpdateServiceRequest::decode(msg).map_err(bad)?;
            // The new spec's queue is checked too (the state machine refuses another queue,
            // but a member must not learn that about another team's service).
            let q = spec_queue("spec_json", &r.spec_json, strict)?;
            t.text = format!("service {} in queue {q}", r.job_id);
            t.queues.push(q);
            t.job = Some(JobId(r.job_id));
        }
        ("suanli.v1.Queues", "Upsert") => {
            let r = pb::UpsertQueueRequest::decode(msg).map_err(bad)?;
            #[derive(serde::Deserialize)]
            struct Id {
                id: String,
            }
            let id = serde_json::from_str::<Id>(&r.queue_json).map(|q| q.id).unwrap_or_default();
            t.text = format!("queue {id}");
        }
        ("suanli.v1.Queues", "Delete") => {
            t.text = format!("queue {}", pb::DeleteQueueRequest::decode(msg).map_err(bad)?.id);
        }
        ("suanli.v1.Nodes", "SetMode") => {
            let r = pb::SetNodeModeRequest::decode(msg).map_err(bad)?;
            let mode = match pb::NodeMode::try_from(r.mode) {
                Ok(pb::NodeMode::Schedulable) => "uncordon",
                Ok(pb::NodeMode::Cordoned) => "cordon",
                Ok(pb::NodeMode::Draining) => "drain",
                _ => "mode ?",
            };
            t.text = format!("node {} {mode}", r.id);
        }
        ("suanli.v1.Nodes", "ClearQuarantine") => {
            let r = pb::ClearQuarantineRequest::decode(msg).map_err(bad)?;
            t.text = format!("node {} clear-quarantine {}", r.id, r.device);
        }
        ("suanli.v1.Cluster", "AddServer") => {
            let r = pb::AddServerRequest::decode(msg).map_err(bad)?;
            t.text = format!("server {} at {}", r.id, r.addr);
        }
        ("suanli.v1.Cluster", "RemoveServer") => {
            t.text = format!("server {}", pb::RemoveServerRequest::decode(msg).map_err(bad)?.id);
        }
        ("suanli.v1.Cluster", "SkipEntry") => {
            let r = pb::SkipEntryRequest::decode(msg).map_err(bad)?;
            t.text = format!("entry {} ({})", r.index, r.kind);
        }
        ("suanli.v1.Cluster", "SetConfig") => {
            let r = pb::SetConfigRequest::decode(msg).map_err(bad)?;
            let keys: Vec<&str> = r.set.keys().map(String::as_str).collect();
            t.text = format!("config {}", keys.join(", "));
        }
        ("suanli.v1.Access", "CreateToken") => {
            let r = pb::CreateTokenRequest::decode(msg).map_err(bad)?;
            let team = if r.team.is_empty() { String::new() } else { format!(",{}", r.team) };
            t.text = format!("token for {}({}{team})", r.name, r.role);
        }
        ("suanli.v1.Access", "RevokeToken") => {
            t.text = format!("token {}", pb::RevokeTokenRequest::decode(msg).map_err(bad)?.id);
        }
        ("suanli.v1.Agent", "Register") => {
            let r = pb::RegisterNodeRequest::decode(msg).map_err(bad)?;
            let node: Node = crate::status::decode_json("node_json", &r.node_json, usize::MAX)?;
            t.text = format!("node {}", node.id);
            t.node = Some(node.id.0);
        }
        ("suanli.v1.Agent", "Heartbeat") => {
            t.node = Some(pb::HeartbeatRequest::decode(msg).map_err(bad)?.node_id);
        }
        ("suanli.v1.Agent", "WatchAllocations") => {
            t.node = Some(pb::WatchAllocationsRequest::decode(msg).map_err(bad)?.node_id);
        }
        ("suanli.v1.Agent", "ReportStatus") => {
            t.alloc = Some(AllocId(pb::ReportStatusRequest::decode(msg).map_err(bad)?.alloc_id));
        }
        ("suanli.v1.Agent", "ReportCheckpoint") => {
            t.alloc = Some(AllocId(pb::ReportCheckpointRequest::decode(msg).map_err(bad)?.alloc_id));
        }
        _ => {}
    }
    Ok(t)
}

/// The queue a job spec submits to: with `strict`, read as the handler reads the spec (so the
/// check and the submission cannot disagree); else leniently, for the audit text.
fn spec_queue(field: &str, spec_json: &str, strict: bool) -> Result<QueueId, Status> {
    if strict {
        let spec: JobSpec = crate::status::decode_json(field, spec_json, usize::MAX)?;
        return Ok(spec.queue);
    }
    #[derive(serde::Deserialize)]
    struct Queue {
        queue: QueueId,
    }
    serde_json::from_str::<Queue>(spec_json)
        .map(|q| q.queue)
        .map_err(|e| Status::invalid_argument(format!("{field}: {e}")))
}

/// Cuts a text to [`MAX_AUDIT_TEXT`] bytes on a character boundary.
fn cut(s: &str) -> String {
    if s.len() <= MAX_AUDIT_TEXT {
        return s.to_owned();
    }
    let mut end = MAX_AUDIT_TEXT;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// A response body that records its call in the audit log once its status is known (the
/// trailers), or when it ends or is dropped without one.
struct AuditBody {
    inner: Body,
    pending: Option<(Pending, Arc<Shared>, Principal)>,
}

impl AuditBody {
    fn finish(&mut self, code: Code, message: &str) {
        if let Some((p, shared, who)) = self.pending.take() {
            shared.answered(&who, p, &Status::new(code, message));
        }
    }
}

impl http_body::Body for AuditBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        match &r {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(t) = f.trailers_ref() {
                    let s = Status::from_header_map(t);
                    let (code, msg) = s.map_or((Code::Ok, String::new()), |s| (s.code(), s.message().to_owned()));
                    self.finish(code, &msg);
                }
            }
            Poll::Ready(Some(Err(s))) => {
                let (code, msg) = (s.code(), s.message().to_owned());
                self.finish(code, &msg);
            }
            Poll::Ready(None) => self.finish(Code::Unknown, "the answer ended without a status"),
            Poll::Pending => {}
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for AuditBody {
    fn drop(&mut self) {
        self.finish(Code::Cancelled, "the caller went away before the answer ended");
    }
}

/// Proposes the audit entries in batches until every layer is gone.
async fn audit_loop(core: Arc<Core>, mut rx: mpsc::Receiver<AuditEntry>) {
    while let Some(first) = rx.recv().await {
        let mut entries = vec![first];
        let linger = tokio::time::sleep(AUDIT_LINGER);
        tokio::pin!(linger);
        while entries.len() < AUDIT_BATCH {
            tokio::select! {
                e = rx.recv() => match e {
                    Some(e) => entries.push(e),
                    None => break,
                },
                () = &mut linger => break,
            }
        }
        let n = entries.len();
        if let Err(s) = core.propose(Command::RecordAudit(RecordAudit { entries })).await {
            tracing::warn!(entries = n, code = code_name(s.code()), error = %s.message(), "audit entries not recorded");
        }
    }
}

/// Token buckets per caller, bounded in number.
struct Limiter {
    per_s: f64,
    burst: f64,
    buckets: HashMap<String, Bucket>,
}

#[derive(Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: tokio::time::Instant,
}

/// The bucket callers share while the map is full of active ones.
const OVERFLOW_KEY: &str = "(callers over the limiter's capacity)";

impl Limiter {
    fn new(per_s: u32, burst: u32) -> Limiter {
        Limiter { per_s: f64::from(per_s), burst: f64::from(burst.max(1)), buckets: HashMap::new() }
    }

    /// Takes one call from `key`'s bucket; false when it is empty.
    fn take(&mut self, key: &str, now: tokio::time::Instant) -> bool {
        if !self.buckets.contains_key(key) && self.buckets.len() >= MAX_RATE_KEYS {
            // Forget the callers whose buckets refilled (they lose nothing), at once.
            let (per_s, burst) = (self.per_s, self.burst);
            self.buckets.retain(|_, b| b.tokens + now.duration_since(b.at).as_secs_f64() * per_s < burst);
        }
        let key = if self.buckets.contains_key(key) || self.buckets.len() < MAX_RATE_KEYS { key } else { OVERFLOW_KEY };
        let burst = self.burst;
        let b = self.buckets.entry(key.to_owned()).or_insert(Bucket { tokens: burst, at: now });
        b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * self.per_s).min(self.burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn frame(m: &impl Message) -> Vec<u8> {
        let body = m.encode_to_vec();
        let mut out = vec![0u8];
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend(body);
        out
    }

    #[test]
    fn frames_are_read_exactly_or_refused() {
        let f = frame(&pb::CancelJobRequest { job_id: 42, reason: String::new() });
        let m = message(&f).expect("one message");
        let t = inspect("/suanli.v1.Jobs/Cancel", m, true).expect("decodes");
        assert_eq!((t.text.as_str(), t.job), ("job 42", Some(JobId(42))));
        assert!(message(&f[..f.len() - 1]).is_err(), "short");
        let mut two = f.clone();
        two.extend(&f);
        assert!(message(&two).is_err(), "two messages");
        let mut z = f.clone();
        z[0] = 1;
        assert!(message(&z).expect_err("compressed").message().contains("compressed"));
        assert!(message(&[0, 0]).is_err());
    }

    #[test]
    fn submissions_name_their_queues_and_a_bad_spec_is_refused_when_it_matters() {
        let spec = |q: &str| format!(r#"{{"name":"j","queue":"{q}","groups":[]}}"#);
        let many = pb::SubmitJobsRequest {
            jobs: vec![
                pb::SubmitJobRequest {
                    global: false,
                    team: String::new(),
                    client_request_id: "a".into(),
                    spec_json: spec("q1"),
                    retry: None,
                },
                pb::SubmitJobRequest {
                    global: false,
                    team: String::new(),
                    client_request_id: "b".into(),
                    spec_json: spec("q2"),
                    retry: None,
                },
                pb::SubmitJobRequest {
                    global: false,
                    team: String::new(),
                    client_request_id: "c".into(),
                    spec_json: spec("q1"),
                    retry: None,
                },
            ],
        };
        let t = inspect("/suanli.v1.Jobs/SubmitMany", &many.encode_to_vec(), true).expect("decodes");
        assert_eq!(t.queues, vec![QueueId::from("q1"), QueueId::from("q2")]);
        assert_eq!(t.text, "3 jobs into queue q1, q2");
        let bad = pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: "a".into(),
            spec_json: "{".into(),
            retry: None,
        };
        let e = inspect("/suanli.v1.Jobs/Submit", &bad.encode_to_vec(), true).expect_err("unreadable");
        assert!(e.message().starts_with("spec_json"), "{e:?}");
        // Two `queue` keys: the strict reader refuses, never picks one the handler would not.
        let dup = pb::SubmitJobRequest {
            global: false,
            team: String::new(),
            client_request_id: "a".into(),
            spec_json: r#"{"name":"j","queue":"mine","queue":"theirs","groups":[]}"#.into(),
            retry: None,
        };
        assert!(inspect("/suanli.v1.Jobs/Submit", &dup.encode_to_vec(), true).is_err());
        let hb = pb::HeartbeatRequest { node_id: "n2".into(), ..Default::default() };
        assert_eq!(
            inspect("/suanli.v1.Agent/Heartbeat", &hb.encode_to_vec(), true).expect("hb").node.as_deref(),
            Some("n2")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_bucket_refills_at_its_rate_and_the_map_stays_bounded() {
        let mut l = Limiter::new(10, 20);
        let t0 = tokio::time::Instant::now();
        assert_eq!((0..25).filter(|_| l.take("u", t0)).count(), 20, "the burst");
        assert!(!l.take("u", t0));
        assert!(l.take("v", t0), "another caller has its own bucket");
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!((0..10).filter(|_| l.take("u", t1)).count(), 5, "half a second: 5 more");
        for i in 0..MAX_RATE_KEYS + 50 {
            l.take(&format!("k{i}"), t1);
        }
        assert!(l.buckets.len() <= MAX_RATE_KEYS + 1, "{}", l.buckets.len());
        // Once their buckets refilled, idle callers are forgotten for new ones.
        let t2 = t1 + Duration::from_secs(10);
        assert!(l.take("new", t2));
        assert!(l.buckets.contains_key("new"));
        assert!(l.buckets.len() < 10, "{}", l.buckets.len());
    }

    #[test]
    fn audit_texts_are_cut_on_a_character_boundary() {
        let s = "é".repeat(MAX_AUDIT_TEXT);
        let c = cut(&s);
        assert!(c.len() <= MAX_AUDIT_TEXT && c.chars().all(|ch| ch == 'é'));
        assert_eq!(code_name(Code::PermissionDenied), "PERMISSION_DENIED");
    }
}
