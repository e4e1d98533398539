//! The leader-following connection: the one place that decides which server a call goes to.

use crate::error::ClientError;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Mutex, PoisonError, RwLock};
use std::time::Duration;
use suanli_proto::v1 as pb;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

/// What [`Connection::call`] hands its closure: the channel to one server (over TLS when the
/// configuration has it), with the configuration's bearer token added to every request.
pub type CallChannel = InterceptedService<Channel, Bearer>;

/// Adds `authorization: Bearer <token>` to every request, when there is a token.
#[derive(Clone, Default)]
pub struct Bearer {
    value: Option<MetadataValue<Ascii>>,
    /// Why the configured token is unusable: every call fails with it (never sent without it).
    refused: Option<std::sync::Arc<str>>,
}

impl std::fmt::Debug for Bearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token itself: it is a credential.
        f.write_str(if self.value.is_some() { "Bearer(..)" } else { "Bearer(none)" })
    }
}

impl Bearer {
    /// The header of `token` (`None`: no header). A token must be printable ASCII without
    /// spaces and at most [`suanli_security::token::MAX_TOKEN_BYTES`] long; an error names
    /// `token` and what is wrong.
    pub fn new(token: Option<&str>) -> Result<Bearer, ClientError> {
        let Some(t) = token.map(str::trim) else { return Ok(Bearer::default()) };
        let bad = |message: String| ClientError::Config { field: "token".into(), message };
        if t.is_empty() {
            return Err(bad("is empty".into()));
        }
        let max = suanli_security::token::MAX_TOKEN_BYTES;
        if t.len() > max {
            return Err(bad(format!("is {} bytes, more than the limit of {max}", t.len())));
        }
        if !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad("holds characters other than printable ASCII (is it a token?)".into()));
        }
        let v = format!("Bearer {t}").parse().map_err(|e| bad(format!("not a header value: {e}")))?;
        Ok(Bearer { value: Some(v), refused: None })
    }

    /// [`Bearer::new`], or one that fails every call with its error.
    fn or_refusing(token: Option<&str>) -> Bearer {
        Bearer::new(token).unwrap_or_else(|e| Bearer { value: None, refused: Some(e.to_string().into()) })
    }

    /// Whether it adds a header.
    pub fn is_set(&self) -> bool {
        self.value.is_some()
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(e) = &self.refused {
            return Err(Status::invalid_argument(e.to_string()));
        }
        if let Some(v) = &self.value {
            req.metadata_mut().insert(suanli_security::token::METADATA_KEY, v.clone());
        }
        Ok(req)
    }
}

/// What to do with a `suanli-leader` hint on an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaderHints {
    /// Retry once at the named address, listed or not (a CLI given any one server).
    Follow,
    /// Retry once there only when it is one of the connection's addresses: a hint names a
    /// server's own address, which may sit behind a proxy the caller cannot reach (agents).
    KnownOnly,
    /// Ignore hints; move round the list.
    Ignore,
}

/// Timeouts and policies of a [`Connection`]. Every limit is here, with the CLI's values as
/// defaults.
#[derive(Debug, Clone)]
pub struct ConnectionConfig {
    /// Time allowed to open a connection to one server.
    pub connect_timeout: Duration,
    /// Deadline of one request (`None`: none, for streams that stay open).
    pub request_timeout: Option<Duration>,
    /// How long a call waits for its answer before the server is probed.
    pub first_answer: Duration,
    /// How long the probe (`Cluster.Leader` on the same connection) may take.
    pub probe_timeout: Duration,
    /// Leader hints.
    pub hints: LeaderHints,
    /// Error codes after which the next server is tried (connection failures and hung
    /// servers always are). Default: UNAVAILABLE only.
    pub move_on: fn(Code) -> bool,
    /// Largest reply accepted, in bytes (typed calls).
    pub max_reply_bytes: usize,
    /// HTTP/2 keepalive interval and timeout (streams: finds a dead server); `None`: off.
    pub keepalive: Option<Duration>,
    /// Addresses a leader hint may name, each with the address to dial instead (a server's
    /// own address when the caller reaches it through a proxy). Empty: hints are dialed as
    /// they are.
    pub aliases: BTreeMap<String, String>,
    /// TLS to the servers (their certificates are verified against its CA; its certificate is
    /// presented as the client's). `None`: plaintext, only for servers started `--insecure`.
    pub tls: Option<suanli_security::tls::Tls>,
    /// A bearer token sent with every call (`authorization: Bearer ...`); it is then the
    /// caller's identity (docs/security.md).
    pub token: Option<String>,
}

/// Only UNAVAILABLE moves a call to the next server (a leader change, a server shutting down).
pub fn unavailable_only(c: Code) -> bool {
    c == Code::Unavailable
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        ConnectionConfig {
            connect_timeout: Duration::from_secs(2),
            request_timeout: Some(Duration::from_secs(10)),
            first_answer: Duration::from_secs(2),
            probe_timeout: Duration::from_secs(1),
            hints: LeaderHints::Follow,
            move_on: unavailable_only,
            // The reply limit of a server left at its defaults (4 x 4 MiB), which one whole
            // job (`Jobs.Get`, `Jobs.Watch`) may reach; list pages stay under 4 MiB.
            max_reply_bytes: 4 * suanli_proto::DEFAULT_MAX_MESSAGE_BYTES,
            keepalive: None,
            aliases: BTreeMap::new(),
            tls: None,
            token: None,
        }
    }
}

/// Connections to a list of servers (the configured ones, then members learnt from the
/// cluster); remembers the one that last answered and starts there. Shared by reference:
/// every method takes `&self`.
pub struct Connection {
    cfg: ConnectionConfig,
    bearer: Bearer,
    configured: Vec<String>,
    learned: RwLock<Vec<String>>,
    /// The server that answered last, with its channel.
    current: Mutex<Option<(String, CallChannel)>>,
    /// Where the next call starts when there is no current server: after the last one that
    /// failed, so a loop of calls goes round the list.
    next_start: Mutex<usize>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").field("addrs", &self.addrs()).field("current", &self.current_addr()).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The leader's address a status names in its `suanli-leader` metadata, if any.
pub fn leader_hint(s: &Status) -> Option<String> {
    let v = s.metadata().get(suanli_proto::LEADER_HEADER)?.to_str().ok()?.trim();
    (!v.is_empty()).then(|| v.to_owned())
}

impl Connection {
    /// A connection to `addrs` (`host:port` or a URI), tried in order; connects lazily.
    pub fn new(addrs: &[String], cfg: ConnectionConfig) -> Result<Connection, ClientError> {
        let configured: Vec<String> = addrs.iter().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect();
        if configured.is_empty() {
            return Err(ClientError::Config {
                field: "--server".into(),
                message: "no address given (expected host:port[,host:port...])".into(),
            });
        }
        for a in &configured {
            endpoint(a)?;
        }
        let bearer = Bearer::new(cfg.token.as_deref())?;
        Ok(Connection {
            bearer,
            cfg,
            configured,
            learned: RwLock::new(Vec::new()),
            current: Mutex::new(None),
            next_start: Mutex::new(0),
        })
    }

    /// Its configuration.
    pub fn config(&self) -> &ConnectionConfig {
        &self.cfg
    }

    /// The same servers with another configuration (e.g. no request timeout for streams).
    pub fn with_config(&self, cfg: ConnectionConfig) -> Connection {
        let bearer =
            if cfg.token == self.cfg.token { self.bearer.clone() } else { Bearer::or_refusing(cfg.token.as_deref()) };
        Connection {
            bearer,
            cfg,
            configured: self.configured.clone(),
            learned: RwLock::new(self.learned()),
            current: Mutex::new(None),
            next_start: Mutex::new(*lock(&self.next_start)),
        }
    }

    /// The same servers, for streams: no request deadline, HTTP/2 keepalives every 5 s.
    pub fn streaming(&self) -> Connection {
        self.with_config(ConnectionConfig {
            request_timeout: None,
            keepalive: Some(Duration::from_secs(5)),
            ..self.cfg.clone()
        })
    }

    /// The addresses called, configured first, then learnt.
    pub fn addrs(&self) -> Vec<String> {
        let mut all = self.configured.clone();
        all.extend(self.learned().into_iter().filter(|a| !self.configured.contains(a)));
        all
    }

    /// The configured addresses.
    pub fn configured(&self) -> &[String] {
        &self.configured
    }

    /// The learnt addresses.
    pub fn learned(&self) -> Vec<String> {
        self.learned.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Replaces the learnt addresses (members the cluster named); configured ones stay.
    /// Addresses that do not parse are left out and returned.
    pub fn set_learned(&self, addrs: &[String]) -> Vec<String> {
        let (ok, bad): (Vec<String>, Vec<String>) = addrs.iter().cloned().partition(|a| endpoint(a).is_ok());
        *self.learned.write().unwrap_or_else(PoisonError::into_inner) = ok;
        bad
    }

    /// The server the next call starts at, when one answered last.
    pub fn current_addr(&self) -> Option<String> {
        lock(&self.current).as_ref().map(|(a, _)| a.clone())
    }

    /// Makes the next call start at address `i` (of [`Connection::addrs`], modulo their number)
    /// rather than at the server that answered last.
    pub fn start_at(&self, i: usize) {
        *lock(&self.current) = None;
        *lock(&self.next_start) = i;
    }

    /// Moves on from the current server (a stream it served failed): the next call starts at
    /// the one after it.
    pub fn advance(&self) {
        let cur = lock(&self.current).take();
        if let Some((a, _)) = cur {
            self.forget(&a);
        }
    }

    fn forget(&self, addr: &str) {
        let mut cur = lock(&self.current);
        if cur.as_ref().is_some_and(|(a, _)| a == addr) {
            *cur = None;
        }
        drop(cur);
        let all = self.addrs();
        if let Some(i) = all.iter().position(|a| a == addr) {
            *lock(&self.next_start) = (i + 1) % all.len().max(1);
        }
    }

    /// The order of one call: the current server, then the others from `next_start` round.
    fn order(&self) -> Vec<String> {
        let all = self.addrs();
        let mut order = Vec::with_capacity(all.len() + 1);
        if let Some(a) = self.current_addr() {
            order.push(a);
        }
        let start = *lock(&self.next_start) % all.len().max(1);
        for a in all.iter().skip(start).chain(all.iter().take(start)) {
            if !order.contains(a) {
                order.push(a.clone());
            }
        }
        order
    }

    fn channel(&self, addr: &str) -> Result<CallChannel, String> {
        if let Some((a, ch)) = lock(&self.current).as_ref()
            && a == addr
        {
            return Ok(ch.clone());
        }
        connect(addr, &self.cfg, &self.bearer).map_err(|e| e.to_string())
    }

    /// Calls `f` on the first server that answers: connection failures, the `move_on` codes
    /// and a hung server ([`answer_unless_hung`]) move on to the next address; an error
    /// naming the leader is retried there once (as [`LeaderHints`] allows). Any other error
    /// is the answer.
    pub async fn call<T, F, Fut>(&self, f: F) -> Result<T, ClientError>
    where
        F: FnMut(CallChannel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.call_traced(f, &mut Vec::new()).await
    }

    /// [`Connection::call`], appending to `asked` every address `f` was sent to, in order (a
    /// history of which servers saw a request whose outcome may be unknown).
    pub async fn call_traced<T, F, Fut>(&self, mut f: F, asked: &mut Vec<String>) -> Result<T, ClientError>
    where
        F: FnMut(CallChannel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut order = self.order();
        let mut failures: Vec<String> = Vec::new();
        let mut redirected = false;
        let mut i = 0;
        while i < order.len() {
            let addr = order[i].clone();
            i += 1;
            let ch = match self.channel(&addr) {
                Ok(ch) => ch,
                Err(e) => {
                    failures.push(format!("{addr}: {e}"));
                    self.forget(&addr);
                    continue;
                }
            };
            asked.push(addr.clone());
            let answer = answer_unless_hung(ch.clone(), self.cfg.first_answer, self.cfg.probe_timeout, f(ch.clone()));
            let Some(answer) = answer.await else {
                failures.push(format!(
                    "{addr}: no answer within {} ms, nor to a probe",
                    (self.cfg.first_answer + self.cfg.probe_timeout).as_millis()
                ));
                self.forget(&addr);
                continue;
            };
            match answer {
                Ok(r) => {
                    *lock(&self.current) = Some((addr, ch));
                    return Ok(r.into_inner());
                }
                Err(st) => {
                    if !redirected
                        && let Some(leader) = leader_hint(&st).map(|l| self.cfg.aliases.get(&l).cloned().unwrap_or(l))
                        && leader != addr
                        && self.may_follow(&leader)
                    {
                        redirected = true;
                        failures.push(format!("{addr}: {} (leader is {leader})", st.message()));
                        self.forget(&addr);
                        // Next in line: the leader, moved up if it was further down the list.
                        if let Some(p) = order.iter().position(|a| *a == leader) {
                            order.remove(p);
                            if p < i {
                                i -= 1;
                            }
                        }
                        order.insert(i, leader);
                        continue;
                    }
                    if (self.cfg.move_on)(st.code()) {
                        failures.push(format!("{addr}: {}", status_text(&st)));
                        self.forget(&addr);
                        continue;
                    }
                    return Err(st.into());
                }
            }
        }
        Err(ClientError::NoServer { failures })
    }

    fn may_follow(&self, leader: &str) -> bool {
        match self.cfg.hints {
            LeaderHints::Follow => true,
            LeaderHints::KnownOnly => self.addrs().iter().any(|a| a == leader),
            LeaderHints::Ignore => false,
        }
    }

    /// A connection to one address only (a member asked directly, an agent), with this
    /// connection's configuration (TLS, token); no following. It connects lazily: a server that
    /// cannot be reached fails the first call on it with UNAVAILABLE, naming why.
    pub fn direct(&self, addr: &str) -> Result<CallChannel, ClientError> {
        connect(addr, &self.cfg, &self.bearer)
    }
}

/// A status's message and the causes under it (a transport error's cause names the refused
/// connection or the TLS failure).
fn status_text(st: &Status) -> String {
    let mut msg = st.message().to_owned();
    let mut src = std::error::Error::source(st);
    while let Some(s) = src {
        let part = s.to_string();
        if !msg.contains(&part) {
            msg = format!("{msg}: {part}");
        }
        src = s.source();
    }
    msg
}

/// The endpoint of `addr`: `host:port` is `http://host:port` (TLS, when configured, runs over
/// it: the host is the name checked in the server's certificate).
fn endpoint(addr: &str) -> Result<Endpoint, ClientError> {
    let uri = if addr.contains("://") { addr.to_owned() } else { format!("http://{addr}") };
    Endpoint::from_shared(uri).map_err(|e| ClientError::Config {
        field: "server address".into(),
        message: format!("{addr:?} is not host:port: {e}"),
    })
}

/// A lazily connected channel to `addr` (connecting within `cfg.connect_timeout`, over TLS when
/// `cfg.tls` is set), carrying `bearer`.
fn connect(addr: &str, cfg: &ConnectionConfig, bearer: &Bearer) -> Result<CallChannel, ClientError> {
    let mut ep = endpoint(addr)?.connect_timeout(cfg.connect_timeout).tcp_nodelay(true);
    if let Some(t) = cfg.request_timeout {
        ep = ep.timeout(t);
    }
    if let Some(k) = cfg.keepalive {
        ep = ep.http2_keep_alive_interval(k).keep_alive_timeout(k).keep_alive_while_idle(true);
    }
    Ok(InterceptedService::new(suanli_security::tls::channel(ep, cfg.tls.as_ref()), bearer.clone()))
}

/// `call`'s answer, or `None` when its server is hung: no answer within `wait`, and none to a
/// `Cluster.Leader` probe on the same channel within `probe`. A server that answers the probe
/// (even with an error) is alive and only slow: the call keeps its own deadline.
pub async fn answer_unless_hung<T>(
    ch: CallChannel,
    wait: Duration,
    probe: Duration,
    call: impl Future<Output = T>,
) -> Option<T> {
    tokio::pin!(call);
    tokio::select! {
        r = &mut call => return Some(r),
        () = tokio::time::sleep(wait) => {}
    }
    let probing = async move {
        let mut req = tonic::Request::new(pb::LeaderRequest {});
        req.set_timeout(probe);
        tokio::time::timeout(probe, pb::cluster_client::ClusterClient::new(ch).leader(req)).await
    };
    tokio::select! {
        r = &mut call => Some(r),
        // An answer from the server, even an error, shows it is alive (only slow); a
        // timeout or a transport failure of the probe is a hung or gone server.
        p = probing => match p {
            Ok(Ok(_)) => Some(call.await),
            Ok(Err(s)) if !matches!(
                s.code(),
                Code::Cancelled | Code::DeadlineExceeded | Code::Unavailable | Code::Unknown
            ) => Some(call.await),
            _ => None,
        },
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn conn(addrs: &[&str], hints: LeaderHints) -> Connection {
        let addrs: Vec<String> = addrs.iter().map(|s| (*s).to_owned()).collect();
        Connection::new(&addrs, ConnectionConfig { hints, ..ConnectionConfig::default() }).unwrap()
    }

    #[test]
    fn no_address_is_a_config_error_naming_the_flag() {
        let e = Connection::new(&[" ".into()], ConnectionConfig::default()).unwrap_err();
        assert!(e.to_string().starts_with("--server: no address given"), "{e}");
    }

    #[test]
    fn learnt_members_follow_the_configured_ones_and_a_failure_moves_the_start() {
        let c = conn(&["127.0.0.1:7400"], LeaderHints::KnownOnly);
        let bad = c.set_learned(&["127.0.0.1:7401".into(), "127.0.0.1:7400".into(), "no port here".into()]);
        assert_eq!(bad, ["no port here"]);
        assert_eq!(c.addrs(), ["127.0.0.1:7400", "127.0.0.1:7401"]);
        assert_eq!(c.order(), ["127.0.0.1:7400", "127.0.0.1:7401"]);
        c.forget("127.0.0.1:7400");
        assert_eq!(c.order(), ["127.0.0.1:7401", "127.0.0.1:7400"]);
    }

    #[test]
    fn hints_are_followed_as_configured() {
        let c = conn(&["10.0.0.1:7400", "10.0.0.2:7400"], LeaderHints::KnownOnly);
        assert!(c.may_follow("10.0.0.2:7400"));
        assert!(!c.may_follow("10.9.9.9:7400"), "never a server not listed");
        assert!(conn(&["10.0.0.1:7400"], LeaderHints::Follow).may_follow("10.9.9.9:7400"));
        assert!(!conn(&["10.0.0.1:7400", "10.0.0.2:7400"], LeaderHints::Ignore).may_follow("10.0.0.2:7400"));
    }

    #[test]
    fn the_leader_hint_is_read_from_the_shared_header() {
        let mut s = Status::unavailable("not the leader");
        assert_eq!(leader_hint(&s), None);
        s.metadata_mut().insert(suanli_proto::LEADER_HEADER, "10.0.0.3:7400".parse().unwrap());
        assert_eq!(leader_hint(&s).as_deref(), Some("10.0.0.3:7400"));
    }
}
