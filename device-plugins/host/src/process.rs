//! The child side: `suanli plugin-host LIB`, one plugin library hosted for the agent.
//!
//! ```text
//!  agent (supervisor)                         child (serve)
//!     spawn ─────────────────────────────▶  take fd 0/1 for frames; fd 1 := pipe ─▶ fd 2, fd 0 := /dev/null
//!                                            Library::open (dlopen + checks)
//!           ◀──────────── HostHello ──────  (error set: load failed; the child exits 1)
//!     HostRequest{init, PluginConfig} ───▶  Library::init       (error: reply, exit 1)
//!           ◀──────────── HostReply ──────
//!     HostRequest{fingerprint|...} ──────▶  bounded queue ─▶ WORKERS threads ─▶ Instance
//!           ◀──────────── HostReply ──────  (same id; replies may come out of order)
//!     HostRequest{shutdown} ─────────────▶  wait for running calls, Instance::shutdown, exit 0
//!     (EOF on stdin) ────────────────────▶  the same as shutdown, without a reply
//! ```
//!
//! The frame channel is a private duplicate of the original stdout; the plugin's fd 1 is a pipe
//! forwarded to stderr (bytes counted, reported in every reply), its fd 0 /dev/null, so a plugin
//! that prints cannot corrupt the protocol.
//! Exit status: 0 after shutdown or EOF, 1 when the library or init failed, 3 on a protocol error
//! (or when calls were still running [`EXIT_WATCHDOG`] after the end of input).

#![allow(unsafe_code)]

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::FromRawFd;
use std::path::Path;
use std::process::ExitCode;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};

use prost::Message;

use crate::frame::{self, FrameError, code};
use crate::host::{Instance, Library};
use crate::pb;

/// Calls served at once (one thread each); more wait in the queue.
pub const WORKERS: usize = 16;
/// Requests read ahead of the workers; when full, the child stops reading its input.
pub const QUEUE_LEN: usize = 64;

/// How long running calls may take to finish once the input has ended or shutdown was asked for.
pub const EXIT_WATCHDOG: std::time::Duration = std::time::Duration::from_secs(10);

/// Exit status after a load or init failure.
pub const EXIT_LOAD_FAILED: u8 = 1;
/// Exit status after a protocol error (a bad frame from the agent).
pub const EXIT_PROTOCOL: u8 = 3;

type Writer = Arc<Mutex<File>>;

/// The main of `suanli plugin-host LIB`: see the module docs.
pub fn serve(lib: &Path) -> ExitCode {
    let (mut input, output) = match take_stdio() {
        Ok(io) => io,
        Err(e) => {
            eprintln!("plugin-host: cannot set up the frame channel: {e}");
            return ExitCode::from(EXIT_PROTOCOL);
        }
    };
    let out: Writer = Arc::new(Mutex::new(output));
    let library = match Library::open(lib) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("plugin-host: {e}");
            let hello = pb::HostHello { error: e.to_string(), ..Default::default() };
            let _ = send(&out, &hello);
            return ExitCode::from(EXIT_LOAD_FAILED);
        }
    };
    let (abi_major, abi_minor) = library.abi();
    let hello = pb::HostHello {
        plugin_name: library.name().to_string(),
        plugin_version: library.version().to_string(),
        abi_major,
        abi_minor,
        error: String::new(),
        calls: library.calls(),
        api_struct_size: library.info().api_struct_size as u64,
        table_minor: library.info().table_minor,
    };
    if send(&out, &hello).is_err() {
        return ExitCode::SUCCESS; // the agent is gone
    }

    // The first request must be init.
    let instance = loop {
        let req = match read_request(&mut input) {
            Ok(Some(r)) => r,
            Ok(None) => return ExitCode::SUCCESS,
            Err(code) => return code,
        };
        if req.method != "init" {
            reply_err(&out, req.id, code::PROTOCOL, format!("{}: the first request must be init", req.method));
            continue;
        }
        let config = match pb::PluginConfig::decode(req.payload.as_slice()) {
            Ok(c) => c,
            Err(e) => {
                reply_err(&out, req.id, code::PROTOCOL, format!("init: payload is not a PluginConfig: {e}"));
                return ExitCode::from(EXIT_PROTOCOL);
            }
        };
        match library.init(&config) {
            Ok(i) => {
                reply_ok(&out, req.id, Vec::new());
                break Arc::new(i);
            }
            Err(e) => {
                eprintln!("plugin-host: plugin {}: init failed: {e}", library.name());
                reply_err(&out, req.id, e.code as i32, e.message);
                return ExitCode::from(EXIT_LOAD_FAILED);
            }
        }
    };

    let (tx, rx) = sync_channel::<pb::HostRequest>(QUEUE_LEN);
    let rx = Arc::new(Mutex::new(rx));
    let mut workers = Vec::with_capacity(WORKERS);
    for n in 0..WORKERS {
        let (rx, inst, out) = (rx.clone(), instance.clone(), out.clone());
        match std::thread::Builder::new().name(format!("plugin-call-{n}")).spawn(move || work(&rx, &inst, &out)) {
            Ok(h) => workers.push(h),
            Err(e) => {
                eprintln!("plugin-host: cannot start worker thread {n}: {e}");
                break;
            }
        }
    }
    if workers.is_empty() {
        return ExitCode::from(EXIT_PROTOCOL);
    }

    let (shutdown_id, status) = dispatch(&mut input, &tx, &out);
    drop(tx);
    // A call that never returns must not keep an orphaned child alive: the agent has left (or
    // asked for shutdown, and will kill us after its deadline anyway).
    let _ = std::thread::Builder::new().name("plugin-exit-watchdog".into()).spawn(|| {
        std::thread::sleep(EXIT_WATCHDOG);
        eprintln!("plugin-host: calls still running {EXIT_WATCHDOG:?} after the end of input; exiting");
        std::process::exit(i32::from(EXIT_PROTOCOL));
    });
    for w in workers {
        let _ = w.join();
    }
    let res = instance.shutdown();
    if let Some(id) = shutdown_id {
        match res {
            Ok(()) => reply_ok(&out, id, Vec::new()),
            Err(e) => reply_err(&out, id, e.code as i32, e.message),
        }
    } else if let Err(e) = res {
        eprintln!("plugin-host: plugin {}: shutdown failed: {e}", library.name());
    }
    status
}

/// Reads requests after init until shutdown, EOF or a bad frame.
fn dispatch(input: &mut File, tx: &SyncSender<pb::HostRequest>, out: &Writer) -> (Option<u64>, ExitCode) {
    loop {
        let req = match read_request(input) {
            Ok(Some(r)) => r,
            Ok(None) => return (None, ExitCode::SUCCESS),
            Err(code) => return (None, code),
        };
        match req.method.as_str() {
            "shutdown" => return (Some(req.id), ExitCode::SUCCESS),
            "fingerprint" | "reserve" | "stats" | "health_events" | "release" | "reset" => {
                if tx.send(req).is_err() {
                    return (None, ExitCode::from(EXIT_PROTOCOL));
                }
            }
            "init" => reply_err(out, req.id, code::PROTOCOL, "init: the plugin is already initialized".into()),
            other => reply_err(
                out,
                req.id,
                code::PROTOCOL,
                format!(
                    "unknown method {other:?} (valid: init, fingerprint, reserve, stats, health_events, release, reset, shutdown)"
                ),
            ),
        }
    }
}

fn work(rx: &Mutex<Receiver<pb::HostRequest>>, inst: &Instance, out: &Writer) {
    loop {
        let req = {
            let guard = rx.lock().unwrap_or_else(|e| e.into_inner());
            match guard.recv() {
                Ok(r) => r,
                Err(_) => return,
            }
        };
        match inst.call_raw(&req.method, &req.payload) {
            Ok(payload) => reply_ok(out, req.id, payload),
            Err(e) => reply_err(out, req.id, e.code as i32, e.message),
        }
    }
}

/// `Ok(None)` on a clean EOF; `Err(exit code)` on a bad frame.
fn read_request(input: &mut File) -> Result<Option<pb::HostRequest>, ExitCode> {
    match frame::read_sync(input).and_then(|body| frame::decode::<pb::HostRequest>(&body, "HostRequest")) {
        Ok(r) => Ok(Some(r)),
        Err(FrameError::Eof(false)) => Ok(None),
        Err(e) => {
            eprintln!("plugin-host: bad request frame: {e}");
            Err(ExitCode::from(EXIT_PROTOCOL))
        }
    }
}

fn send<M: Message>(out: &Writer, msg: &M) -> io::Result<()> {
    let mut w = out.lock().unwrap_or_else(|e| e.into_inner());
    frame::write_sync(&mut *w, msg)
}

fn reply_ok(out: &Writer, id: u64, payload: Vec<u8>) {
    write_reply(out, pb::HostReply { id, payload, code: 0, error: String::new(), stdout_bytes: stdout_bytes() });
}

fn reply_err(out: &Writer, id: u64, code: i32, error: String) {
    write_reply(out, pb::HostReply { id, payload: Vec::new(), code, error, stdout_bytes: stdout_bytes() });
}

/// Bytes the plugin wrote to its stdout (the pipe that fd 1 became), forwarded to stderr.
static STDOUT_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn stdout_bytes() -> u64 {
    STDOUT_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

fn write_reply(out: &Writer, reply: pb::HostReply) {
    if let Err(e) = send(out, &reply) {
        // The agent closed the channel: nobody is left to serve.
        eprintln!("plugin-host: cannot send reply {}: {e}; exiting", reply.id);
        std::process::exit(0);
    }
}

/// Moves the frame channel off fds 0 and 1: returns private duplicates of them (close-on-exec),
/// then points fd 1 at a pipe whose bytes a thread counts and forwards to fd 2, and fd 0 at
/// /dev/null, for whatever the plugin does.
fn take_stdio() -> io::Result<(File, File)> {
    io::stdout().flush()?;
    let input = dup_cloexec(0)?;
    let output = dup_cloexec(1)?;
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two fds this process then owns.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    let (read_end, write_end) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    // SAFETY: dup2 on fds this process owns; the pipe's write end stays open until after it.
    if unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&write_end), 1) } < 0 {
        return Err(io::Error::last_os_error());
    }
    drop(write_end);
    std::thread::Builder::new().name("plugin-stdout".into()).spawn(move || forward_stdout(read_end))?;
    let null = File::open("/dev/null")?;
    // SAFETY: as above; `null` stays open until after the call.
    if unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((input, output))
}

/// Counts and forwards what the plugin writes to its stdout, until the pipe closes.
fn forward_stdout(mut from: File) {
    use std::io::Read as _;
    let mut buf = [0u8; 4096];
    loop {
        match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                STDOUT_BYTES.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                let _ = io::stderr().write_all(&buf[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

fn dup_cloexec(fd: i32) -> io::Result<File> {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on an fd of this process; the result is a new fd we own.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` is a freshly duplicated fd owned by nobody else.
    Ok(unsafe { File::from_raw_fd(new) })
}
