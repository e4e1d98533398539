//! `suanli dev` as a user runs it from a fresh directory (its default data directory,
//! `./.suanli/dev`), and the CLI as a shell in that directory runs it (no credential in the
//! environment: it finds the dev certificates by itself).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A running `suanli dev` in a temporary directory; SIGTERM (then SIGKILL after 10 s) on drop.
pub struct DevProc {
    child: Child,
    /// The directory it runs in (holds `dev.log` and `.suanli/dev`).
    pub dir: tempfile::TempDir,
    /// The addresses it printed.
    pub bound: suanli_server::Bound,
}

impl DevProc {
    /// Starts `suanli dev --listen 127.0.0.1:0` with the plugins built next to the binary, its
    /// stderr in `dev.log`; returns once it printed its addresses (within 60 s).
    pub fn start() -> DevProc {
        let dir = tempfile::tempdir().expect("a temp dir");
        let plugin_dir = crate::bin().parent().expect("the target dir").to_path_buf();
        let log = std::fs::File::create(dir.path().join("dev.log")).expect("dev.log");
        let mut child = Command::new(crate::bin())
            .current_dir(dir.path())
            .env_remove("SUANLI_DEV_DIR")
            .args(["dev", "--listen", "127.0.0.1:0"])
            .arg("--plugin-dir")
            .arg(&plugin_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("suanli dev starts");
        let stdout = child.stdout.take().expect("stdout");
        let bound = match suanli_server::listeners::await_line(stdout, Duration::from_secs(60)) {
            Ok(b) => b,
            Err(e) => {
                let _ = child.kill();
                panic!("suanli dev: {e}\n{}", std::fs::read_to_string(dir.path().join("dev.log")).unwrap_or_default());
            }
        };
        DevProc { child, dir, bound }
    }

    /// Its client address.
    pub fn addr(&self) -> String {
        self.bound.client.to_string()
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("dev.log")).unwrap_or_default()
    }

    /// The CLI run in its directory against its server.
    pub fn cli(&self, args: &[&str]) -> Output {
        suanli_in(self.dir.path(), &self.addr(), args)
    }

    /// Its dev certificates.
    pub fn tls_dir(&self) -> PathBuf {
        self.dir.path().join(".suanli/dev/tls")
    }
}

impl Drop for DevProc {
    fn drop(&mut self) {
        // SIGTERM: the dev command stops its agents and server.
        let _ = Command::new("kill").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The CLI as a shell in `cwd` runs it: no credential in the environment.
pub fn suanli_in(cwd: &Path, addr: &str, args: &[&str]) -> Output {
    let mut c = Command::new(crate::bin());
    for v in
        ["SUANLI_CA", "SUANLI_CERT", "SUANLI_KEY", "SUANLI_TOKEN", "SUANLI_INSECURE", "SUANLI_TLS_DIR", "SUANLI_ADDR"]
    {
        c.env_remove(v);
    }
    c.current_dir(cwd).args(args).args(["--server", addr]).output().expect("the CLI runs")
}

/// A successful command's JSON output (a failure panics with its stderr).
pub fn json(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("JSON output")
}

/// Polls `f` every 100 ms until it returns `Some`, or fails after `within`.
pub fn wait_for<T>(within: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
