//! The agent side: one `suanli plugin-host` child per plugin, calls with deadlines, restarts.
//!
//! ```text
//!   PluginProcess::start ── spawn child ── HostHello (error: Load, never retried) ── init ── Up
//!        │ init UNAVAILABLE (driver not loaded yet): Down, retried by the restart task
//!        │ call(method) ── HostRequest{id} ──▶ child ──▶ HostReply{id} ── Ok / Plugin(error)
//!        │    no reply before the deadline ─▶ SIGKILL ─┐
//!        │    EOF, bad frame, child exit ──────────────┴─▶ Down{reason}; pending calls: Crashed
//!        │                                                 calls while Down fail fast (Down)
//!        └ restart task: sleep(backoff) ─ spawn ─ Hello ─ init(same config) ─▶ Up, restarts += 1
//!              backoff: backoff_min, doubling up to backoff_max; back to backoff_min once a
//!              child has stayed up for backoff_max
//! ```
//!
//! The child's stderr is inherited (it goes to the agent's log). Dropping the last
//! `PluginProcess` clone kills the child and stops restarts; [`PluginProcess::shutdown`] asks the
//! plugin to shut down first.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use prost::Message;
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::{oneshot, watch};

use crate::frame::{self, FrameError};
use crate::{Code, PluginError, pb};

/// Calls in flight on one child at most; more fail with `Unavailable`.
pub const MAX_PENDING_CALLS: usize = 1024;
/// How long a child that closed its output may take to exit before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// How children are started and watched.
#[derive(Debug, Clone)]
pub struct Options {
    /// The program and its leading arguments; the library path is appended. Default: this
    /// executable and `plugin-host`.
    pub host_cmd: Vec<OsString>,
    /// Deadline of every call but fingerprint and init (and of the child's Hello).
    pub call_timeout: Duration,
    /// Deadline of fingerprint and init (vendor libraries can be slow to enumerate devices).
    pub fingerprint_timeout: Duration,
    /// First restart delay after a failure.
    pub backoff_min: Duration,
    /// Largest restart delay; a child that stays up this long resets the delay to `backoff_min`.
    pub backoff_max: Duration,
    /// An `init` that fails with `UNAVAILABLE` (a driver that loads late at boot) is retried with
    /// the restart backoff, the plugin Down meanwhile, instead of failing `start`. The agent's
    /// choice; the conformance kit reports such an init as a failure.
    pub retry_unavailable_init: bool,
}

impl Default for Options {
    fn default() -> Self {
        let exe = std::env::current_exe().map(OsString::from).unwrap_or_else(|_| OsString::from("suanli"));
        Options {
            host_cmd: vec![exe, OsString::from("plugin-host")],
            call_timeout: Duration::from_secs(5),
            fingerprint_timeout: Duration::from_secs(30),
            backoff_min: Duration::from_millis(200),
            backoff_max: Duration::from_secs(30),
            retry_unavailable_init: true,
        }
    }
}

impl Options {
    /// Checks the values: a command is given and every duration is positive and ordered.
    pub fn validate(&self) -> Result<(), HostError> {
        let bad = |m: String| Err(HostError::Load(format!("invalid plugin host options: {m}")));
        if self.host_cmd.is_empty() {
            return bad("host_cmd is empty (expected e.g. [\"/usr/bin/suanli\", \"plugin-host\"])".into());
        }
        for (name, d) in [
            ("call_timeout", self.call_timeout),
            ("fingerprint_timeout", self.fingerprint_timeout),
            ("backoff_min", self.backoff_min),
            ("backoff_max", self.backoff_max),
        ] {
            if d.is_zero() {
                return bad(format!("{name} is 0 (expected a positive duration)"));
            }
        }
        if self.backoff_max < self.backoff_min {
            return bad(format!(
                "backoff_max {:?} is smaller than backoff_min {:?}",
                self.backoff_max, self.backoff_min
            ));
        }
        Ok(())
    }
}

/// Whether a plugin's child is serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PluginState {
    /// The child is running and initialized.
    Up,
    /// The child crashed, hung or failed to restart; a restart is pending (unless shut down).
    Down {
        /// Why, e.g. "plugin example: killed by signal 11 (SIGSEGV)".
        reason: String,
    },
}

/// Why a call through the supervisor failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// The plugin answered with an error (its message names the plugin and the call).
    #[error("{0}")]
    Plugin(PluginError),
    /// No reply before the deadline; the child was killed and will be restarted.
    #[error("device plugin call {method} got no reply within {after:?}; the plugin host was killed")]
    Timeout {
        /// `plugin.method`, e.g. `nvidia.fingerprint`.
        method: String,
        /// The deadline.
        after: Duration,
    },
    /// The child died while the call was in flight.
    #[error("device plugin call {method} failed: the plugin host {detail}")]
    Crashed {
        /// `plugin.method`.
        method: String,
        /// e.g. "was killed by signal 11 (SIGSEGV)", "exited with status 101".
        detail: String,
    },
    /// The child is down (restarting); the call was not attempted.
    #[error("device plugin is down: {reason}")]
    Down {
        /// Why it is down.
        reason: String,
    },
    /// The library could not be loaded or the host could not be started (never retried by
    /// `start`).
    #[error("{0}")]
    Load(String),
    /// The child broke the protocol or refused a request as malformed.
    #[error("device plugin protocol error: {0}")]
    Protocol(String),
}

/// One plugin library hosted in a supervised child process. Cheap to clone.
#[derive(Clone)]
pub struct PluginProcess {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PluginProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginProcess")
            .field("lib", &self.inner.lib)
            .field("state", &*self.inner.state.borrow())
            .field("restarts", &self.restarts())
            .finish()
    }
}

struct Inner {
    lib: PathBuf,
    config: pb::PluginConfig,
    opts: Options,
    hello: Mutex<pb::HostHello>,
    conn: Mutex<Option<Arc<Conn>>>,
    state: watch::Sender<PluginState>,
    restarts: AtomicU64,
    generation: AtomicU64,
    /// The restart delays (backon: `backoff_min` doubling up to `backoff_max`).
    backoff: Mutex<backon::ExponentialBackoff>,
    /// Set by shutdown: no more restarts.
    closing: AtomicBool,
    /// Wakes a sleeping restart task at shutdown (dropped with `Inner`, which wakes it too).
    stop: watch::Sender<bool>,
    runtime: tokio::runtime::Handle,
    /// The latest child's count of bytes its plugin wrote to stdout (from its replies).
    stdout_bytes: AtomicU64,
}

/// Timings of a start, for the conformance kit.
#[derive(Debug, Default)]
pub(crate) struct StartTimes {
    /// The Hello (also when it carried an error) and how long spawn + load took.
    pub hello: Option<(pb::HostHello, Duration)>,
    /// How long init took, when it succeeded.
    pub init: Option<Duration>,
}

impl PluginProcess {
    /// Spawns the child, waits for its Hello, sends init. A Hello error (e.g. an ABI major
    /// mismatch) or an init error is returned, never retried.
    pub async fn start(lib: PathBuf, config: pb::PluginConfig, opts: Options) -> Result<PluginProcess, HostError> {
        Self::start_timed(lib, config, opts).await.0
    }

    pub(crate) async fn start_timed(
        lib: PathBuf,
        config: pb::PluginConfig,
        opts: Options,
    ) -> (Result<PluginProcess, HostError>, StartTimes) {
        let mut times = StartTimes::default();
        if let Err(e) = opts.validate() {
            return (Err(e), times);
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return (Err(HostError::Load("PluginProcess::start must run inside a tokio runtime".into())), times);
        };
        let inner = Arc::new(Inner {
            lib,
            config,
            hello: Mutex::new(pb::HostHello::default()),
            conn: Mutex::new(None),
            state: watch::channel(PluginState::Down { reason: "starting".into() }).0,
            restarts: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            backoff: Mutex::new(restart_delays(&opts)),
            closing: AtomicBool::new(false),
            stop: watch::channel(false).0,
            runtime,
            opts,
            stdout_bytes: AtomicU64::new(0),
        });
        let t0 = Instant::now();
        let (conn, hello) = match inner.spawn_child().await {
            Ok(x) => x,
            Err(SpawnError { error, hello }) => {
                times.hello = hello.map(|h| (*h, t0.elapsed()));
                return (Err(error), times);
            }
        };
        times.hello = Some((hello.clone(), t0.elapsed()));
        *lock(&inner.hello) = hello;
        let t1 = Instant::now();
        if let Err(e) = inner.init_conn(&conn).await {
            if inner.opts.retry_unavailable_init && matches!(&e, HostError::Plugin(pe) if pe.code == Code::Unavailable)
            {
                let reason = format!("plugin {}: init: {e}; retrying with backoff", inner.name());
                tracing::warn!(%reason, "device plugin not available yet");
                inner.state.send_replace(PluginState::Down { reason });
                inner.runtime.spawn(restart_loop(Arc::downgrade(&inner)));
                return (Ok(PluginProcess { inner }), times);
            }
            return (Err(e), times);
        }
        times.init = Some(t1.elapsed());
        inner.install(conn);
        (Ok(PluginProcess { inner }), times)
    }

    /// The Hello of the current (or last) child: name, version, ABI, calls offered.
    pub fn hello(&self) -> pb::HostHello {
        lock(&self.inner.hello).clone()
    }

    /// Every device, its health and topology (deadline: `fingerprint_timeout`).
    pub async fn fingerprint(&self) -> Result<pb::Inventory, HostError> {
        self.call_decoded("fingerprint", &pb::FingerprintRequest {}, self.inner.opts.fingerprint_timeout).await
    }

    /// What a task given these devices needs.
    pub async fn reserve(&self, req: pb::ReserveRequest) -> Result<pb::Reservation, HostError> {
        self.call_decoded("reserve", &req, self.inner.opts.call_timeout).await
    }

    /// Utilization and counters.
    pub async fn stats(&self, req: pb::StatsRequest) -> Result<pb::StatsResponse, HostError> {
        self.call_decoded("stats", &req, self.inner.opts.call_timeout).await
    }

    /// Health events since the previous call; `Ok(empty)` for a plugin without them (ABI 1.0).
    pub async fn health_events(&self) -> Result<pb::HealthEvents, HostError> {
        if !self.offers("health_events") {
            return Ok(pb::HealthEvents::default());
        }
        self.call_decoded("health_events", &pb::HealthRequest {}, self.inner.opts.call_timeout).await
    }

    /// Release of a reservation (ABI 1.2); `Ok` without a call for a plugin that lacks it.
    pub async fn release(&self, req: pb::ReleaseRequest) -> Result<pb::ReleaseResponse, HostError> {
        if !self.offers("release") {
            return Ok(pb::ReleaseResponse::default());
        }
        self.call_decoded("release", &req, self.inner.opts.call_timeout).await
    }

    /// Reset of one device after a recoverable error (ABI 1.3), under the fingerprint deadline
    /// (a GPU reset takes seconds); UNIMPLEMENTED without a call for a plugin that lacks it.
    pub async fn reset(&self, req: pb::ResetRequest) -> Result<pb::ResetResponse, HostError> {
        if !self.offers("reset") {
            return Err(HostError::Plugin(PluginError::new(
                Code::Unimplemented,
                "reset: the plugin does not offer it (ABI before 1.3)",
            )));
        }
        self.call_decoded("reset", &req, self.inner.opts.fingerprint_timeout).await
    }

    /// Whether the plugin offers `call` (from its Hello).
    pub fn offers(&self, call: &str) -> bool {
        lock(&self.inner.hello).calls.iter().any(|c| c == call)
    }

    /// False from a crash or timeout until the restarted child has re-run init.
    pub fn is_up(&self) -> bool {
        matches!(*self.inner.state.borrow(), PluginState::Up)
    }

    /// Bytes the plugin has written to its stdout, as the current child counts them.
    pub fn stdout_bytes(&self) -> u64 {
        self.inner.stdout_bytes.load(Ordering::Relaxed)
    }

    /// The current child's process id (none while down).
    pub fn pid(&self) -> Option<u32> {
        let conn = lock(&self.inner.conn).clone()?;
        lock(&conn.child).as_ref().and_then(|c| c.id())
    }

    /// Kills the current child (SIGKILL) as a crash would: the plugin goes Down and is restarted
    /// with backoff. False when no child runs. For the conformance kit's restart check.
    pub fn kill_host(&self, reason: &str) -> bool {
        let Some(conn) = lock(&self.inner.conn).clone() else { return false };
        conn.kill(reason.to_string());
        true
    }

    /// How many times the child was restarted.
    pub fn restarts(&self) -> u64 {
        self.inner.restarts.load(Ordering::Relaxed)
    }

    /// State changes (Up / Down with the reason).
    pub fn subscribe(&self) -> watch::Receiver<PluginState> {
        self.inner.state.subscribe()
    }

    /// Asks the plugin to shut down, waits for the child to exit (killing it after
    /// `call_timeout`) and stops restarts. Calls afterwards fail with `Down`.
    pub async fn shutdown(&self) {
        if let Err(e) = self.shutdown_detailed().await {
            tracing::warn!(plugin = %self.inner.name(), error = %e, "device plugin shutdown");
        }
    }

    /// [`shutdown`](Self::shutdown), reporting how it went: the child's exit, e.g. "exited with
    /// status 0".
    pub(crate) async fn shutdown_detailed(&self) -> Result<String, HostError> {
        let inner = &self.inner;
        inner.closing.store(true, Ordering::SeqCst);
        inner.stop.send_replace(true);
        let conn = lock(&inner.conn).take();
        inner.state.send_replace(PluginState::Down { reason: format!("plugin {}: shut down", inner.name()) });
        let Some(conn) = conn else {
            return Err(HostError::Down { reason: format!("plugin {}: not running", inner.name()) });
        };
        let timeout = inner.opts.call_timeout;
        let res = conn.call("shutdown", Vec::new(), timeout).await;
        conn.close_input().await;
        let exited = conn.wait_done(timeout).await;
        let detail = match exited {
            Some(d) => d,
            None => {
                conn.kill(format!("did not exit within {timeout:?} of shutdown"));
                conn.wait_done(EXIT_GRACE).await.unwrap_or_else(|| "did not exit after SIGKILL".into())
            }
        };
        inner.reply_result("shutdown", timeout, res).map(|_| detail)
    }

    async fn call_decoded<Req: Message, Resp: Message + Default>(
        &self,
        method: &str,
        req: &Req,
        timeout: Duration,
    ) -> Result<Resp, HostError> {
        let payload = self.inner.call(method, req.encode_to_vec(), timeout).await?;
        Resp::decode(payload.as_slice()).map_err(|e| {
            HostError::Protocol(format!("plugin {}: {method} reply does not decode: {e}", self.inner.name()))
        })
    }

    /// Waits until the plugin is up, for at most `timeout`; returns whether it is.
    pub async fn wait_up(&self, timeout: Duration) -> bool {
        let mut rx = self.subscribe();
        matches!(tokio::time::timeout(timeout, rx.wait_for(|s| matches!(s, PluginState::Up))).await, Ok(Ok(_)))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    fn name(&self) -> String {
        let h = lock(&self.hello);
        if !h.plugin_name.is_empty() {
            return h.plugin_name.clone();
        }
        self.lib.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| self.lib.display().to_string())
    }

    fn down_reason(&self) -> String {
        match &*self.state.borrow() {
            PluginState::Down { reason } => reason.clone(),
            PluginState::Up => format!("plugin {}: restarting", self.name()),
        }
    }

    /// One call on the current child.
    async fn call(self: &Arc<Self>, method: &str, payload: Vec<u8>, timeout: Duration) -> Result<Vec<u8>, HostError> {
        let conn = lock(&self.conn).clone();
        let Some(conn) = conn else {
            return Err(HostError::Down { reason: self.down_reason() });
        };
        let res = conn.call(method, payload, timeout).await;
        if let Err(CallFail::Timeout) = res {
            let reason = format!("no reply to {method} within {timeout:?}");
            conn.kill(reason.clone());
            self.mark_down(conn.generation, &conn, format!("plugin {}: {reason}", self.name()));
        }
        self.reply_result(method, timeout, res)
    }

    fn reply_result(
        &self,
        method: &str,
        timeout: Duration,
        res: Result<pb::HostReply, CallFail>,
    ) -> Result<Vec<u8>, HostError> {
        let name = self.name();
        let qualified = || format!("{name}.{method}");
        match res {
            Ok(r) if r.code == 0 => Ok(r.payload),
            Ok(r) if (1..=6).contains(&r.code) => Err(HostError::Plugin(PluginError::new(
                Code::from_raw(r.code),
                format!("plugin {name}: {method}: {}", r.error),
            ))),
            Ok(r) => Err(HostError::Protocol(format!("plugin {name}: {method}: {} (host code {})", r.error, r.code))),
            Err(CallFail::Timeout) => Err(HostError::Timeout { method: qualified(), after: timeout }),
            Err(CallFail::Dead(detail)) => Err(HostError::Crashed { method: qualified(), detail }),
            Err(CallFail::Busy) => Err(HostError::Plugin(PluginError::unavailable(format!(
                "plugin {name}: {method}: {MAX_PENDING_CALLS} calls already in flight (the limit)"
            )))),
        }
    }

    /// Spawns a child and reads its Hello. On error, also returns the Hello if one came.
    async fn spawn_child(self: &Arc<Self>) -> Result<(Arc<Conn>, pb::HostHello), SpawnError> {
        let opts = &self.opts;
        let mut cmd = Command::new(&opts.host_cmd[0]);
        cmd.args(&opts.host_cmd[1..])
            .arg(&self.lib)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| {
            SpawnError::new(HostError::Load(format!(
                "cannot start the plugin host {:?} for {}: {e}",
                opts.host_cmd,
                self.lib.display()
            )))
        })?;
        let (Some(stdin), Some(mut stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(SpawnError::new(HostError::Load("plugin host started without piped stdin/stdout".into())));
        };
        let lib = self.lib.display().to_string();
        let hello = match tokio::time::timeout(opts.call_timeout, frame::read_async(&mut stdout)).await {
            Err(_) => {
                return Err(SpawnError::new(HostError::Timeout {
                    method: format!("{lib}: load"),
                    after: opts.call_timeout,
                }));
            }
            Ok(Err(FrameError::Eof(_))) => {
                let status = wait_exit(&mut child, EXIT_GRACE).await;
                return Err(SpawnError::new(HostError::Crashed {
                    method: format!("{lib}: load"),
                    detail: format!("{status} before its Hello"),
                }));
            }
            Ok(Err(e)) => {
                return Err(SpawnError::new(HostError::Protocol(format!("plugin host for {lib}: Hello: {e}"))));
            }
            Ok(Ok(body)) => match frame::decode::<pb::HostHello>(&body, "HostHello") {
                Ok(h) => h,
                Err(e) => return Err(SpawnError::new(HostError::Protocol(format!("plugin host for {lib}: {e}")))),
            },
        };
        if !hello.error.is_empty() {
            let _ = wait_exit(&mut child, EXIT_GRACE).await;
            return Err(SpawnError { error: HostError::Load(hello.error.clone()), hello: Some(Box::new(hello)) });
        }
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        let conn = Arc::new(Conn {
            generation,
            child: Mutex::new(Some(child)),
            input: tokio::sync::Mutex::new(Some(stdin)),
            pending: Mutex::new(Pending { closed: false, map: HashMap::new() }),
            next_id: AtomicU64::new(1),
            kill_reason: OnceLock::new(),
            done: watch::channel(None).0,
            started: Instant::now(),
        });
        self.runtime.spawn(read_loop(Arc::downgrade(self), conn.clone(), stdout));
        Ok((conn, hello))
    }

    /// Sends init on a fresh child; on failure the child is killed.
    async fn init_conn(self: &Arc<Self>, conn: &Arc<Conn>) -> Result<(), HostError> {
        let timeout = self.opts.fingerprint_timeout;
        let res = conn.call("init", self.config.encode_to_vec(), timeout).await;
        let out = self.reply_result("init", timeout, res).map(|_| ());
        if out.is_err() {
            conn.kill("init failed".into());
        }
        out
    }

    fn install(&self, conn: Arc<Conn>) {
        *lock(&self.conn) = Some(conn);
        self.state.send_replace(PluginState::Up);
    }

    /// The child of `generation` failed: forget it, report Down, schedule a restart. Idempotent.
    fn mark_down(self: &Arc<Self>, generation: u64, conn: &Conn, reason: String) {
        {
            let mut cur = lock(&self.conn);
            match &*cur {
                Some(c) if c.generation == generation => *cur = None,
                _ => return,
            }
        }
        {
            let mut b = lock(&self.backoff);
            if conn.started.elapsed() >= self.opts.backoff_max {
                *b = restart_delays(&self.opts);
            }
        }
        tracing::warn!(plugin = %self.name(), %reason, "device plugin host down; restarting with backoff");
        self.state.send_replace(PluginState::Down { reason });
        if !self.closing.load(Ordering::SeqCst) {
            self.runtime.spawn(restart_loop(Arc::downgrade(self)));
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(conn) = lock(&self.conn).take() {
            conn.kill("the supervisor was dropped".into());
        }
    }
}

/// The restart delays of `opts`: `backoff_min` doubling up to `backoff_max`, without end (a
/// plugin is retried as long as the agent runs; `shutdown` ends the loop).
fn restart_delays(opts: &Options) -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::new()
        .with_factor(2.0)
        .with_min_delay(opts.backoff_min)
        .with_max_delay(opts.backoff_max)
        .without_max_times()
        .build()
}

/// Restarts the child with backoff until it is up again, shut down, or the supervisor is gone.
async fn restart_loop(weak: Weak<Inner>) {
    loop {
        let (delay, mut stop) = {
            let Some(inner) = weak.upgrade() else { return };
            let b = lock(&inner.backoff).next().unwrap_or(inner.opts.backoff_max);
            (b, inner.stop.subscribe())
        };
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let Some(inner) = weak.upgrade() else { return };
        if inner.closing.load(Ordering::SeqCst) {
            return;
        }
        let res = match inner.spawn_child().await {
            Ok((conn, hello)) => {
                *lock(&inner.hello) = hello;
                inner.init_conn(&conn).await.map(|()| conn)
            }
            Err(e) => Err(e.error),
        };
        match res {
            Ok(conn) if !inner.closing.load(Ordering::SeqCst) => {
                inner.restarts.fetch_add(1, Ordering::Relaxed);
                tracing::info!(plugin = %inner.name(), "device plugin host restarted");
                inner.install(conn);
                return;
            }
            Ok(conn) => {
                conn.kill("shut down while restarting".into());
                return;
            }
            Err(e) => {
                let reason = format!(
                    "plugin {}: restart failed: {e}; retrying with backoff (last wait {delay:?})",
                    inner.name()
                );
                tracing::warn!(%reason, "device plugin host restart");
                inner.state.send_replace(PluginState::Down { reason });
            }
        }
    }
}

/// A failed spawn, with the Hello when one came (it carries the load error).
struct SpawnError {
    error: HostError,
    hello: Option<Box<pb::HostHello>>,
}

impl SpawnError {
    fn new(error: HostError) -> Self {
        SpawnError { error, hello: None }
    }
}

enum CallFail {
    Timeout,
    Dead(String),
    Busy,
}

struct Pending {
    closed: bool,
    map: HashMap<u64, oneshot::Sender<pb::HostReply>>,
}

/// One child process and its frame channel.
struct Conn {
    generation: u64,
    /// Taken by the reader once the child's output ends (so that no kill can hit a reaped pid).
    child: Mutex<Option<Child>>,
    input: tokio::sync::Mutex<Option<ChildStdin>>,
    pending: Mutex<Pending>,
    next_id: AtomicU64,
    /// Why the supervisor killed the child (reported instead of "killed by signal 9").
    kill_reason: OnceLock<String>,
    /// Set once the child is gone: how it ended.
    done: watch::Sender<Option<String>>,
    started: Instant,
}

impl Conn {
    async fn call(&self, method: &str, payload: Vec<u8>, timeout: Duration) -> Result<pb::HostReply, CallFail> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut p = lock(&self.pending);
            if p.closed {
                return Err(CallFail::Dead(self.death()));
            }
            if p.map.len() >= MAX_PENDING_CALLS {
                return Err(CallFail::Busy);
            }
            p.map.insert(id, tx);
        }
        let req = pb::HostRequest { id, method: method.to_string(), payload };
        let exchange = async {
            {
                let mut input = self.input.lock().await;
                let Some(w) = input.as_mut() else {
                    return Err(CallFail::Dead(self.death()));
                };
                if frame::write_async(w, &req).await.is_err() {
                    // The child closed its input: it is exiting; its exit status tells why.
                    drop(input);
                    return Err(CallFail::Dead(self.wait_done(EXIT_GRACE).await.unwrap_or_else(|| self.death())));
                }
            }
            match rx.await {
                Ok(reply) => Ok(reply),
                Err(_) => Err(CallFail::Dead(self.death())),
            }
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(r) => {
                lock(&self.pending).map.remove(&id);
                r
            }
            Err(_) => {
                lock(&self.pending).map.remove(&id);
                Err(CallFail::Timeout)
            }
        }
    }

    fn death(&self) -> String {
        self.done.borrow().clone().unwrap_or_else(|| "closed its channel".into())
    }

    /// Kills the child (once; later reasons are ignored).
    fn kill(&self, reason: String) {
        let _ = self.kill_reason.set(reason);
        if let Some(child) = lock(&self.child).as_mut() {
            let _ = child.start_kill();
        }
    }

    async fn close_input(&self) {
        self.input.lock().await.take();
    }

    /// Waits up to `timeout` for the child to be gone; its end, if it is.
    async fn wait_done(&self, timeout: Duration) -> Option<String> {
        let mut rx = self.done.subscribe();
        match tokio::time::timeout(timeout, rx.wait_for(|d| d.is_some())).await {
            Ok(Ok(d)) => d.clone(),
            _ => None,
        }
    }
}

/// Reads replies until the child's output ends, then reaps it and reports how it ended.
async fn read_loop(weak: Weak<Inner>, conn: Arc<Conn>, mut out: ChildStdout) {
    let broken = loop {
        match frame::read_async(&mut out).await {
            Ok(body) => match frame::decode::<pb::HostReply>(&body, "HostReply") {
                Ok(reply) => {
                    if reply.stdout_bytes > 0
                        && let Some(inner) = weak.upgrade()
                    {
                        let before = inner.stdout_bytes.swap(reply.stdout_bytes, Ordering::Relaxed);
                        if before == 0 {
                            tracing::warn!(plugin = %inner.name(), "the device plugin writes to stdout (forwarded to the log); a plugin must not");
                        }
                    }
                    // A reply to a call that already timed out finds no one; that is fine.
                    if let Some(tx) = lock(&conn.pending).map.remove(&reply.id) {
                        let _ = tx.send(reply);
                    }
                }
                Err(e) => break Some(format!("sent a bad frame ({e})")),
            },
            Err(FrameError::Eof(_)) => break None,
            Err(e) => break Some(format!("sent a bad frame ({e})")),
        }
    };
    if let Some(reason) = broken {
        conn.kill(reason);
    }
    let child = lock(&conn.child).take();
    let status = match child {
        Some(mut c) => wait_exit(&mut c, EXIT_GRACE).await,
        None => "is gone".to_string(),
    };
    let detail = match conn.kill_reason.get() {
        Some(r) => format!("was killed: {r}"),
        None => status,
    };
    // Down first, then tell the callers: one that sees Crashed also sees `is_up() == false`.
    if let Some(inner) = weak.upgrade() {
        let reason = format!("plugin {}: the plugin host {detail}", inner.name());
        inner.mark_down(conn.generation, &conn, reason);
    }
    conn.done.send_replace(Some(detail));
    let mut p = lock(&conn.pending);
    p.closed = true;
    p.map.clear();
}

/// Waits for `child` up to `grace`, then kills it; describes how it ended.
async fn wait_exit(child: &mut Child, grace: Duration) -> String {
    let status = match tokio::time::timeout(grace, child.wait()).await {
        Ok(s) => s,
        Err(_) => {
            let _ = child.start_kill();
            child.wait().await
        }
    };
    match status {
        Ok(s) => describe_exit(s),
        Err(e) => format!("could not be waited for ({e})"),
    }
}

/// "exited with status 101", "was killed by signal 11 (SIGSEGV)".
pub fn describe_exit(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exited with status {code}");
    }
    match status.signal() {
        Some(sig) => {
            let core = if status.core_dumped() { ", core dumped" } else { "" };
            format!("was killed by signal {sig} ({}{core})", signal_name(sig))
        }
        None => format!("ended with {status}"),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSYS => "SIGSYS",
        _ => "unknown signal",
    }
}
