//! The `AgentLogs` service: a task's stdout or stderr for `suanli job logs`, read from its
//! allocation directory, optionally followed until the task ends or the client goes away.
//!
//! Who may read what is the access matrix's `/suanli.v1.AgentLogs/Logs` row
//! (docs/security.md): the caller is a bearer token's user (asked of the servers'
//! `Access.WhoAmI`, answers cached) or the identity of its TLS certificate; a member reads only
//! its team's tasks (the team kept in `task.json`).

use crate::tasks::{finished, parse_dir_name};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use suanli_proto::v1 as pb;
use suanli_proto::v1::agent_logs_server::AgentLogs;
use suanli_security::policy::{self, Decision};
use suanli_security::principal::Credential;
use suanli_security::tls::PeerInfo;
use suanli_security::{Principal, token};
use tokio::sync::Semaphore;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Largest chunk sent at once.
const CHUNK_BYTES: usize = 64 * 1024;
/// How often a followed file is checked for more output.
const FOLLOW_POLL: Duration = Duration::from_millis(200);

/// Serves task logs from `allocs_dir`.
pub(crate) struct LogsService {
    pub allocs_dir: PathBuf,
    pub streams: Arc<Semaphore>,
    /// Who may read.
    pub auth: LogsAuth,
}

/// The method's path in the access matrix.
const METHOD: &str = "/suanli.v1.AgentLogs/Logs";
/// Longest a token's answer is trusted without asking the servers again.
const TOKEN_CACHE_TTL: Duration = Duration::from_secs(60);
/// Most tokens whose answers are kept.
const TOKEN_CACHE_MAX: usize = 1024;

/// Asks the servers who holds a token (`Access.WhoAmI` with it).
pub(crate) type WhoAmI = Box<
    dyn Fn(String) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<pb::WhoAmIResponse, Status>> + Send>>
        + Send
        + Sync,
>;

/// A token's answer and when it was given.
type Answer = (tokio::time::Instant, Result<Principal, Status>);

/// The log service's authorization: who the caller is, and whether it may read a task.
pub(crate) struct LogsAuth {
    /// Plaintext, no identities: everyone may read (the agent warned at start).
    insecure: bool,
    whoami: WhoAmI,
    /// Definitive answers per token (a user, or a refusal), with when they were given.
    cache: std::sync::Mutex<std::collections::HashMap<String, Answer>>,
}

impl LogsAuth {
    /// `insecure`: the agent serves plaintext; `whoami`: how a token is checked.
    pub fn new(insecure: bool, whoami: WhoAmI) -> LogsAuth {
        LogsAuth { insecure, whoami, cache: Default::default() }
    }

    /// The caller: the token's user when the call carries one, else the certificate's identity,
    /// else anonymous.
    async fn principal<T>(&self, req: &Request<T>) -> Result<Principal, Status> {
        if self.insecure {
            return Ok(Principal::Insecure);
        }
        let Some(v) = req.metadata().get(token::METADATA_KEY) else {
            let peer = req.extensions().get::<PeerInfo>();
            return Ok(peer.and_then(|p| p.principal.clone()).unwrap_or(Principal::Anonymous));
        };
        let tok = token::bearer(v.as_bytes()).map_err(Status::unauthenticated)?.to_owned();
        let now = tokio::time::Instant::now();
        {
            let cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some((at, answer)) = cache.get(&tok)
                && now.duration_since(*at) < TOKEN_CACHE_TTL
            {
                return answer.clone();
            }
        }
        let answer = match (self.whoami)(tok.clone()).await {
            Ok(r) => Ok(principal_of(&r)),
            Err(s) if s.code() == tonic::Code::Unauthenticated => Err(s),
            // Not an answer about the token (no server reachable, ...): not kept.
            Err(s) => {
                return Err(Status::unavailable(format!("checking the token with the servers: {}", s.message())));
            }
        };
        let mut cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if cache.len() >= TOKEN_CACHE_MAX {
            cache.retain(|_, (at, _)| now.duration_since(*at) < TOKEN_CACHE_TTL);
            if cache.len() >= TOKEN_CACHE_MAX {
                cache.clear();
            }
        }
        cache.insert(tok, (now, answer.clone()));
        answer
    }
}

/// The principal a `WhoAmI` answer names. Only users hold tokens; anything else names nobody.
fn principal_of(r: &pb::WhoAmIResponse) -> Principal {
    let role = r.role.parse::<suanli_security::Role>();
    match (r.kind.as_str(), role) {
        ("user", Ok(role)) => Principal::User {
            name: r.name.clone(),
            role,
            team: (!r.team.is_empty()).then(|| r.team.clone()),
            credential: if r.token_id.is_empty() {
                Credential::Certificate
            } else {
                Credential::Token { id: r.token_id.clone() }
            },
        },
        _ => Principal::Anonymous,
    }
}

/// Whether `who` may read task logs at all: `Ok(None)` any task's, `Ok(Some(team))` only the
/// tasks of `team`.
fn may_read(who: &Principal) -> Result<Option<String>, Status> {
    let rule = policy::rule(METHOD).ok_or_else(|| Status::permission_denied(format!("{METHOD}: no rule")))?;
    match policy::decide(rule, who) {
        Decision::Allow => Ok(None),
        Decision::AllowIfTeam(t) => Ok(Some(t)),
        Decision::AllowIfNode(_) => Err(Status::permission_denied(format!("{who} may not call {METHOD}"))),
        Decision::Unauthenticated => Err(Status::unauthenticated(format!(
            "{METHOD} needs a credential: a client certificate signed by the cluster's CA, or a bearer token"
        ))),
        Decision::Deny(why) => Err(Status::permission_denied(why)),
    }
}

/// Whether a member of `team` may read a task of `owner` (empty: no team known).
fn same_team(who: &Principal, team: &str, owner: &str) -> Result<(), Status> {
    if team == owner {
        return Ok(());
    }
    let owner = if owner.is_empty() { "no known team".to_owned() } else { format!("team {owner}") };
    Err(Status::permission_denied(format!(
        "{who} may not read the logs of a task of {owner} (only of team {team}'s tasks)"
    )))
}

/// The team recorded for the task in `dir` (empty when none is).
fn task_team(dir: &Path) -> String {
    std::fs::read(dir.join("task.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<crate::tasks::TaskRecord>(&b).ok())
        .map(|r| r.team)
        .unwrap_or_default()
}

/// The newest attempt's directory of allocation `alloc`.
fn find_dir(allocs: &Path, alloc: u64) -> Option<PathBuf> {
    let rd = std::fs::read_dir(allocs).ok()?;
    rd.filter_map(Result::ok)
        .filter_map(|e| {
            let k = parse_dir_name(e.file_name().to_str()?)?;
            (k.0 == alloc).then_some((k.1, e.path()))
        })
        .max_by_key(|(epoch, _)| *epoch)
        .map(|(_, p)| p)
}

/// The files of one output stream, oldest first: the rotated `<name>.1`, then the current
/// `<name>` (docs/agent.md, "Files"). The one place that knows how the shim names them.
pub(crate) fn stream_files(dir: &Path, name: &str) -> [PathBuf; 2] {
    [dir.join(format!("{name}.1")), dir.join(name)]
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// Up to `max` bytes of `path` from `offset`, the file's length and its inode (0 when the
/// file does not exist).
fn read_from(path: &Path, offset: u64, max: usize) -> std::io::Result<(Vec<u8>, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0, 0)),
        Err(e) => return Err(e),
    };
    let meta = f.metadata()?;
    let len = meta.len();
    f.seek(SeekFrom::Start(offset.min(len)))?;
    let mut buf = vec![0u8; max];
    let n = f.read(&mut buf)?;
    buf.truncate(n);
    Ok((buf, len, meta.ino()))
}

/// A position in a stream read as one text: the rotated file, then the current one. Offsets
/// the client sees (`offset`, `next_offset`) count from the start of the rotated file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cursor {
    /// 0: in the rotated file; 1: in the current file.
    file: usize,
    /// Byte offset in that file.
    offset: u64,
    /// Length of the rotated file when the cursor entered the current one (for `next_offset`).
    base: u64,
    /// Inode of the current file as last read (0: not read yet): another inode there means
    /// the shim rotated it.
    inode: u64,
}

impl Cursor {
    /// Where a request's `offset` starts (negative: that many bytes before the end of both).
    fn start(files: &[PathBuf; 2], requested: i64) -> Cursor {
        let (old, cur) = (file_len(&files[0]), file_len(&files[1]));
        let total = old + cur;
        let at =
            if requested < 0 { total.saturating_sub(requested.unsigned_abs()) } else { (requested as u64).min(total) };
        if at < old {
            Cursor { file: 0, offset: at, base: 0, inode: 0 }
        } else {
            Cursor { file: 1, offset: at - old, base: old, inode: 0 }
        }
    }

    /// The next chunk (empty at the end of the current file), and moves past it. A rotation
    /// seen while in the current file (another inode there, or it shrank below the cursor)
    /// continues in the rotated file at the same offset: what was not yet read moved there.
    fn next(&mut self, files: &[PathBuf; 2], max: usize) -> std::io::Result<Vec<u8>> {
        loop {
            let (data, len, inode) = read_from(&files[self.file], self.offset, max)?;
            if self.file == 1 {
                let rotated = len < self.offset || (self.inode != 0 && inode != 0 && inode != self.inode);
                if rotated {
                    self.file = 0;
                    self.inode = 0;
                    continue;
                }
                if inode != 0 {
                    self.inode = inode;
                }
            }
            if data.is_empty() && self.file == 0 {
                self.base = self.offset;
                self.file = 1;
                self.offset = 0;
                continue;
            }
            self.offset += data.len() as u64;
            return Ok(data);
        }
    }

    fn position(&self) -> u64 {
        if self.file == 0 { self.offset } else { self.base + self.offset }
    }
}

#[tonic::async_trait]
impl AgentLogs for LogsService {
    type LogsStream = ReceiverStream<Result<pb::LogChunk, Status>>;

    async fn logs(&self, req: Request<pb::LogsRequest>) -> Result<Response<Self::LogsStream>, Status> {
        let who = self.auth.principal(&req).await?;
        // Refused before anything about the allocation is looked at.
        let team =
            may_read(&who).inspect_err(|s| tracing::info!(caller = %who, error = %s.message(), "log read denied"))?;
        let r = req.into_inner();
        let file = match r.stream.as_str() {
            "" | "stdout" => "stdout.log",
            "stderr" => "stderr.log",
            other => return Err(Status::invalid_argument(format!("stream: {other:?} is not stdout or stderr"))),
        };
        let permit = self.streams.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "too many log streams on this agent (max_log_streams = {})",
                self.streams.available_permits()
            ))
        })?;
        let dir = find_dir(&self.allocs_dir, r.alloc_id).ok_or_else(|| {
            Status::not_found(format!(
                "alloc_id: allocation {} never ran on this node (or its logs were deleted)",
                r.alloc_id
            ))
        })?;
        if let Some(team) = team {
            same_team(&who, &team, &task_team(&dir)).inspect_err(|s| {
                tracing::info!(caller = %who, alloc = r.alloc_id, error = %s.message(), "log read denied");
            })?;
        }
        let files = stream_files(&dir, file);
        let mut cursor = Cursor::start(&files, r.offset);
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let _permit = permit;
            loop {
                // Checked before reading, so output written before the end is never missed.
                let done = !r.follow || finished(&dir);
                let data = match cursor.next(&files, CHUNK_BYTES) {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = tx.send(Err(Status::internal(format!("reading {}: {e}", dir.display())))).await;
                        return;
                    }
                };
                if !data.is_empty() {
                    if tx.send(Ok(pb::LogChunk { data, next_offset: cursor.position() })).await.is_err() {
                        return;
                    }
                    continue;
                }
                if done {
                    return;
                }
                tokio::select! {
                    () = tokio::time::sleep(FOLLOW_POLL) => {}
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(files: &[PathBuf; 2], offset: i64) -> Vec<u8> {
        let mut c = Cursor::start(files, offset);
        let mut out = Vec::new();
        loop {
            let d = c.next(files, 3).expect("read");
            if d.is_empty() {
                return out;
            }
            out.extend(d);
        }
    }

    #[test]
    fn reads_across_the_rotated_file_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = stream_files(dir.path(), "stdout.log");
        // Nothing yet: empty, not an error.
        assert!(read_all(&files, 0).is_empty());
        std::fs::write(&files[1], b"only current\n").expect("write");
        assert_eq!(read_all(&files, 0), b"only current\n");
        std::fs::write(&files[0], b"old 1\nold 2\n").expect("write");
        std::fs::write(&files[1], b"new 3\n").expect("write");
        assert_eq!(read_all(&files, 0), b"old 1\nold 2\nnew 3\n");
        // A tail reaches back into the rotated file; an offset counts from its start.
        assert_eq!(read_all(&files, -11), b"ld 2\nnew 3\n");
        assert_eq!(read_all(&files, -100), b"old 1\nold 2\nnew 3\n");
        assert_eq!(read_all(&files, 6), b"old 2\nnew 3\n");
        assert_eq!(read_all(&files, 13), b"ew 3\n");
    }

    #[test]
    fn a_rotation_while_following_loses_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = stream_files(dir.path(), "stdout.log");
        std::fs::write(&files[1], b"abcdef").expect("write");
        let mut c = Cursor::start(&files, 0);
        assert_eq!(c.next(&files, 4).expect("read"), b"abcd");
        // The shim rotates: the current file becomes `.1` and a new one starts.
        std::fs::rename(&files[1], &files[0]).expect("rotate");
        // Longer than what was read of the old one: only its inode tells the rotation.
        std::fs::write(&files[1], b"ghijkl").expect("write");
        let mut rest = Vec::new();
        loop {
            let d = c.next(&files, 4).expect("read");
            if d.is_empty() {
                break;
            }
            rest.extend(d);
        }
        assert_eq!(rest, b"efghijkl");
    }

    fn svc(dir: &Path, auth: LogsAuth) -> LogsService {
        LogsService { allocs_dir: dir.to_owned(), streams: Arc::new(Semaphore::new(4)), auth }
    }

    /// A task directory of allocation 7 owned by `team`, with some output.
    fn task(dir: &Path, team: &str) {
        let d = dir.join(crate::tasks::dir_name((7, 1)));
        std::fs::create_dir_all(&d).expect("mkdir");
        std::fs::write(d.join("stdout.log"), b"hello\n").expect("write");
        let rec = serde_json::json!({
            "alloc_id": 7, "epoch": 1, "job_id": 1, "task": "0-0",
            "shim": {"pid": 1, "start_time": 0}, "started_at": 0, "team": team
        });
        std::fs::write(d.join("task.json"), rec.to_string()).expect("write");
    }

    fn request(who: Option<Principal>, token: Option<&str>) -> Request<pb::LogsRequest> {
        let mut r = Request::new(pb::LogsRequest { alloc_id: 7, ..Default::default() });
        r.extensions_mut().insert(PeerInfo { remote: None, principal: who });
        if let Some(t) = token {
            r.metadata_mut().insert("authorization", format!("Bearer {t}").parse().expect("ascii"));
        }
        r
    }

    fn user(role: suanli_security::Role, team: Option<&str>) -> Principal {
        Principal::User { name: "u".into(), role, team: team.map(Into::into), credential: Credential::Certificate }
    }

    fn no_tokens() -> WhoAmI {
        Box::new(|_| Box::pin(async { Err(Status::unauthenticated("no tokens here")) }))
    }

    #[tokio::test]
    async fn members_read_their_teams_tasks_only_and_strangers_nothing() {
        use suanli_security::Role;
        let dir = tempfile::tempdir().expect("tempdir");
        task(dir.path(), "nlp");
        let s = svc(dir.path(), LogsAuth::new(false, no_tokens()));
        let code = |r: Result<_, Status>| r.map(|_| ()).map_err(|s| s.code());
        assert_eq!(code(s.logs(request(Some(user(Role::Member, Some("nlp"))), None)).await), Ok(()));
        assert_eq!(code(s.logs(request(Some(user(Role::Operator, None)), None)).await), Ok(()));
        assert_eq!(code(s.logs(request(Some(user(Role::Admin, None)), None)).await), Ok(()));
        assert_eq!(
            code(s.logs(request(Some(user(Role::Member, Some("cv"))), None)).await),
            Err(tonic::Code::PermissionDenied)
        );
        assert_eq!(
            code(s.logs(request(Some(user(Role::Viewer, None)), None)).await),
            Err(tonic::Code::PermissionDenied)
        );
        let node = Principal::Node { name: "n1".into() };
        assert_eq!(code(s.logs(request(Some(node), None)).await), Err(tonic::Code::PermissionDenied));
        assert_eq!(code(s.logs(request(None, None)).await), Err(tonic::Code::Unauthenticated));
        assert_eq!(code(s.logs(request(None, Some("bad"))).await), Err(tonic::Code::Unauthenticated));
        // A task with no team recorded: not a member's.
        let old = tempfile::tempdir().expect("tempdir");
        task(old.path(), "");
        let s = svc(old.path(), LogsAuth::new(false, no_tokens()));
        assert_eq!(
            code(s.logs(request(Some(user(Role::Member, Some("nlp"))), None)).await),
            Err(tonic::Code::PermissionDenied)
        );
        let s = svc(old.path(), LogsAuth::new(true, no_tokens()));
        assert_eq!(code(s.logs(request(None, None)).await), Ok(()), "insecure: anyone");
    }

    #[tokio::test]
    async fn a_token_is_its_users_and_the_answer_is_cached_for_a_minute() {
        let dir = tempfile::tempdir().expect("tempdir");
        task(dir.path(), "nlp");
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let n = asked.clone();
        let whoami: WhoAmI = Box::new(move |t| {
            n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Box::pin(async move {
                Ok(pb::WhoAmIResponse {
                    kind: "user".into(),
                    name: "bob".into(),
                    role: "member".into(),
                    team: if t == "cv-token" { "cv".into() } else { "nlp".into() },
                    token_id: "t1".into(),
                    ..Default::default()
                })
            })
        });
        let s = svc(dir.path(), LogsAuth::new(false, whoami));
        // The token decides, not the certificate (an admin's here).
        let admin = user(suanli_security::Role::Admin, None);
        let denied = s.logs(request(Some(admin.clone()), Some("cv-token"))).await.map(|_| ()).expect_err("cv");
        assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
        assert!(denied.message().contains("token:t1:bob(member,cv)"), "{denied:?}");
        s.logs(request(Some(admin.clone()), Some("nlp-token"))).await.expect("nlp reads nlp");
        s.logs(request(None, Some("nlp-token"))).await.expect("cached");
        assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 2);
        // A minute later (the answers are backdated).
        for (at, _) in s.auth.cache.lock().expect("not poisoned").values_mut() {
            *at = at.checked_sub(TOKEN_CACHE_TTL).expect("the clock runs longer than a minute");
        }
        s.logs(request(None, Some("nlp-token"))).await.expect("asked again");
        assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 3);
    }
}
