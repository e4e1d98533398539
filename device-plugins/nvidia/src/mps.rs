//! MPS isolation of fractional GPU shares: one MPS control daemon per shared GPU, each with
//! its own pipe directory, and per-task limits.
//!
//! ```text
//!  reserve(share of gpuN, milli < 1000) ─▶ daemon for gpuN answering? ─ no ─▶ nvidia-cuda-mps-control -d
//!                                           (pipe DIR/gpuN/pipe/control)        CUDA_VISIBLE_DEVICES=<uuid>
//!                                                                               CUDA_MPS_PIPE_DIRECTORY=DIR/gpuN/pipe
//!                                                                               CUDA_MPS_LOG_DIRECTORY=DIR/gpuN/log
//!     task env: CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = ceil(milli / 10),
//!               CUDA_MPS_PINNED_DEVICE_MEM_LIMIT = 0=<memory_mib>M (when the share has a memory slice);
//!               the pipe directory as a mount
//!  release(the last reservation holding gpuN) ─▶ echo quit | nvidia-cuda-mps-control
//! ```
//!
//! A CUDA client connects to the control daemon named by its `CUDA_MPS_PIPE_DIRECTORY`; the
//! daemon's server enforces the client's active-thread percentage (Volta and later) and its
//! pinned device-memory limit (CUDA 11.5 and later). What is and is not isolated:
//! docs/services.md, "Isolation of shared GPUs".

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use suanli_device_abi::{Code, PluginError, pb};

/// The MPS control program, looked up on `PATH` unless the option `mps_control` names it.
pub const MPS_CONTROL: &str = "nvidia-cuda-mps-control";
/// Where per-GPU pipe and log directories go unless the option `mps_dir` says otherwise.
pub const DEFAULT_MPS_DIR: &str = "/run/suanli/mps";
/// How long one run of the control program may take (starting a daemon, a query, `quit`), and
/// how long a started daemon may take to make its pipe: reserve and release have 5 s in all.
pub const CONTROL_TIMEOUT: Duration = Duration::from_millis(1500);
/// The most reservations holding MPS shares at once (a GPU serves at most 48 MPS clients).
pub const MAX_HELD: usize = 4096;
/// The longest `mps_dir`, so that `DIR/gpuNN/pipe/control` stays within a socket path's limit.
pub const MAX_DIR_LEN: usize = 64;

/// The plugin option `mps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Enforce through MPS when the control program is found (the default).
    Auto,
    /// Enforce through MPS; init fails when it cannot.
    On,
    /// Never: shares are advisory.
    Off,
}

/// MPS as configured: enforcing, or why not.
pub enum Setup {
    /// Shares of whole GPUs are limited through per-GPU control daemons.
    Enforced(Mps),
    /// Shares are advisory, and why.
    Advisory(String),
}

impl Setup {
    /// The daemons, when shares are enforced.
    pub fn enforcing(&self) -> Option<&Mps> {
        match self {
            Setup::Enforced(m) => Some(m),
            Setup::Advisory(_) => None,
        }
    }

    /// What the inventory's message says of it.
    pub fn describe(&self) -> String {
        match self {
            Setup::Enforced(m) => m.describe(),
            Setup::Advisory(why) => why.clone(),
        }
    }
}

/// The per-GPU control daemons this plugin runs and the reservations that hold them.
pub struct Mps {
    control: PathBuf,
    dir: PathBuf,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Reservation id → the GPU (`gpuN`) whose daemon serves it.
    held: BTreeMap<String, String>,
    /// GPUs whose daemon answered (started here or found running after a plugin restart).
    running: BTreeSet<String>,
}

/// One fractional share of a whole GPU.
pub struct Share<'a> {
    /// The GPU's plugin id (`gpuN`).
    pub gpu: &'a str,
    /// Its UUID (the daemon's `CUDA_VISIBLE_DEVICES`).
    pub uuid: &'a str,
    /// The share, 1..999.
    pub milli: u32,
    /// The device-memory slice, 0: none.
    pub memory_mib: u64,
}

/// The options `mps`, `mps_control` and `mps_dir`; a bad value is an error naming the option.
pub fn setup(options: &BTreeMap<String, String>) -> Result<Setup, PluginError> {
    let mode = match options.get("mps").map(String::as_str) {
        None | Some("auto") => Mode::Auto,
        Some("on") => Mode::On,
        Some("off") => Mode::Off,
        Some(other) => {
            return Err(PluginError::invalid(format!("option mps is {other:?}; expected auto, on or off")));
        }
    };
    let dir = PathBuf::from(options.get("mps_dir").map_or(DEFAULT_MPS_DIR, String::as_str));
    let dir_text = dir.display().to_string();
    if !dir.is_absolute() || dir_text.len() > MAX_DIR_LEN || dir_text.chars().any(char::is_control) {
        return Err(PluginError::invalid(format!(
            "option mps_dir is {dir_text:?}; expected an absolute path of at most {MAX_DIR_LEN} bytes"
        )));
    }
    if mode == Mode::Off {
        return Ok(Setup::Advisory("MPS off (option mps = off): GPU shares are advisory".into()));
    }
    let found = match options.get("mps_control") {
        Some(p) => {
            executable(Path::new(p)).then(|| PathBuf::from(p)).ok_or_else(|| format!("{p} is not an executable file"))
        }
        None => on_path(MPS_CONTROL).ok_or_else(|| format!("{MPS_CONTROL} is not on PATH")),
    };
    let ready = found.and_then(|control| {
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {dir_text}: {e}"))?;
        Ok(control)
    });
    match (ready, mode) {
        (Ok(control), _) => Ok(Setup::Enforced(Mps { control, dir, state: Mutex::new(State::default()) })),
        (Err(why), Mode::On) => {
            Err(PluginError::new(Code::FailedPrecondition, format!("option mps = on, and MPS cannot run: {why}")))
        }
        (Err(why), _) => Ok(Setup::Advisory(format!("MPS not available ({why}): GPU shares are advisory"))),
    }
}

fn executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(name)).find(|p| executable(p))
}

impl Mps {
    /// The control program and the directory, for the inventory's message.
    pub fn describe(&self) -> String {
        format!("GPU shares enforced through MPS ({}, daemons under {})", self.control.display(), self.dir.display())
    }

    fn pipe_dir(&self, gpu: &str) -> PathBuf {
        self.dir.join(gpu).join("pipe")
    }

    fn log_dir(&self, gpu: &str) -> PathBuf {
        self.dir.join(gpu).join("log")
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>, PluginError> {
        self.state.lock().map_err(|_| PluginError::internal("nvidia MPS lock poisoned"))
    }

    /// Runs the control program for `gpu` (`-d`, or a command on its stdin) for at most
    /// [`CONTROL_TIMEOUT`]; `Err` says why it failed.
    fn control(&self, gpu: &str, uuid: &str, command: Option<&str>) -> Result<(), String> {
        let mut cmd = Command::new(&self.control);
        cmd.env("CUDA_MPS_PIPE_DIRECTORY", self.pipe_dir(gpu))
            .env("CUDA_MPS_LOG_DIRECTORY", self.log_dir(gpu))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if command.is_none() {
            cmd.arg("-d").env("CUDA_VISIBLE_DEVICES", uuid);
        }
        let what = command.map_or_else(|| format!("{} -d", self.control.display()), |c| format!("{c:?}"));
        let input = command.map(|c| format!("{c}\n"));
        crate::run_bounded(&mut cmd, &format!("{what} for {gpu}"), input.as_deref(), CONTROL_TIMEOUT)
    }

    /// Whether a daemon answers on `gpu`'s pipe directory (its `control` pipe exists and a
    /// query succeeds).
    fn answers(&self, gpu: &str) -> bool {
        self.pipe_dir(gpu).join("control").exists() && self.control(gpu, "", Some("get_server_list")).is_ok()
    }

    /// Makes sure `gpu`'s daemon runs, holds it for `reservation_id` (a repeat holds nothing
    /// more; an empty id, from a 1.1 agent, holds nothing), and returns the task's part.
    pub fn reserve(&self, reservation_id: &str, share: &Share<'_>) -> Result<pb::Reservation, PluginError> {
        let mut st = self.lock()?;
        let refuse = |why: String| PluginError::new(Code::FailedPrecondition, format!("device {:?}: {why}", share.gpu));
        if let Some(g) = st.held.get(reservation_id) {
            if g != share.gpu {
                return Err(refuse(format!("reservation {reservation_id:?} already holds an MPS share of {g}")));
            }
        } else if st.held.len() >= MAX_HELD {
            return Err(refuse(format!("{MAX_HELD} MPS reservations held, the limit")));
        }
        // Asked every time: a daemon that died would leave the task unlimited (a CUDA client
        // that finds no daemon runs without MPS).
        if !self.answers(share.gpu) {
            for d in [self.pipe_dir(share.gpu), self.log_dir(share.gpu)] {
                std::fs::create_dir_all(&d).map_err(|e| refuse(format!("cannot create {}: {e}", d.display())))?;
            }
            self.control(share.gpu, share.uuid, None)
                .map_err(|e| refuse(format!("the MPS control daemon did not start: {e}")))?;
            // The daemon forks; its pipe appears soon after the program returns.
            let control = self.pipe_dir(share.gpu).join("control");
            let deadline = Instant::now() + CONTROL_TIMEOUT;
            while !control.exists() {
                if Instant::now() >= deadline {
                    return Err(refuse(format!(
                        "the MPS control daemon made no {} within {CONTROL_TIMEOUT:?}",
                        control.display()
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        st.running.insert(share.gpu.to_owned());
        if !reservation_id.is_empty() {
            st.held.insert(reservation_id.to_owned(), share.gpu.to_owned());
        }
        let pipe = self.pipe_dir(share.gpu).display().to_string();
        let mut r = pb::Reservation::default();
        r.env.insert("CUDA_MPS_PIPE_DIRECTORY".into(), pipe.clone());
        r.env.insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), share.milli.div_ceil(10).clamp(1, 100).to_string());
        if share.memory_mib > 0 {
            // The client sees one GPU (its CUDA_VISIBLE_DEVICES), ordinal 0.
            r.env.insert("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), format!("0={}M", share.memory_mib));
        }
        r.mounts.push(pb::Mount { host_path: pipe.clone(), container_path: pipe, read_only: false });
        Ok(r)
    }

    /// Drops `reservation_id`; stops its GPU's daemon when no other reservation holds it. An id
    /// not held changes nothing (its GPU's daemon may serve tasks reserved before a restart).
    /// A daemon that does not quit is logged, not an error: the task is gone either way.
    pub fn release(&self, reservation_id: &str) -> Result<(), PluginError> {
        let mut st = self.lock()?;
        let Some(gpu) = st.held.remove(reservation_id) else {
            return Ok(());
        };
        if st.held.values().any(|g| *g == gpu) {
            return Ok(());
        }
        st.running.remove(&gpu);
        if self.pipe_dir(&gpu).join("control").exists()
            && let Err(e) = self.control(&gpu, "", Some("quit"))
        {
            eprintln!("suanli nvidia plugin: stopping the MPS daemon of {gpu}: {e}");
        }
        Ok(())
    }

    /// GPUs with a running daemon, and how many reservations hold each (for tests and messages).
    pub fn holders(&self) -> BTreeMap<String, usize> {
        let st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out: BTreeMap<String, usize> = st.running.iter().map(|g| (g.clone(), 0)).collect();
        for g in st.held.values() {
            *out.entry(g.clone()).or_default() += 1;
        }
        out
    }
}
