//! The two sockets a server serves on, bound by its caller, and how the bound addresses are
//! announced to whoever started it.
//!
//! ```text
//!  caller: Listeners::bind(&cfg) (or two TcpListeners of its own, e.g. 127.0.0.1:0 in tests)
//!      ─▶ serve(listeners, cfg, shutdown): listen/peer_listen become the bound addresses
//!         (and the advertised ones unless given), <data_dir>/listening.json is written
//!  `suanli server` also prints `Bound::line()` on stdout: what a test harness reads
//! ```
//!
//! Port 0 lets the system pick a port; nothing here ever binds a port to find out whether it
//! is free (a port found that way can be taken by anyone before it is used again).

use serde::{Deserialize, Serialize};
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use tokio::net::TcpListener;

/// The file in the data directory that holds the bound addresses (JSON, [`Bound`]).
pub const LISTENING_FILE: &str = "listening.json";

/// What starts the line `suanli server` prints on stdout once it listens.
const LINE_PREFIX: &str = "suanli server listening";

/// A server's listeners.
pub struct Listeners {
    /// The client listener: the public API, agents, health and reflection.
    pub client: TcpListener,
    /// The peer listener: raft and `Internal`, for the other servers only.
    pub peer: TcpListener,
    /// The HTTP listener: `/metrics` and the dashboard (`None`: `http_listen = "off"`).
    pub http: Option<TcpListener>,
}

impl Listeners {
    /// Binds what `cfg` names (`listen`, and `peer_listen` or its default); port 0 lets the
    /// system pick. An error names the field and the address (`listen 127.0.0.1:7400: ...`).
    pub async fn bind(cfg: &crate::ServerConfig) -> std::io::Result<Listeners> {
        let named = |what: String| move |e: std::io::Error| std::io::Error::new(e.kind(), format!("{what}: {e}"));
        let client = TcpListener::bind(&cfg.listen).await.map_err(named(format!("listen {}", cfg.listen)))?;
        let peer_addr = cfg.peer_listen_addr();
        let peer = TcpListener::bind(&peer_addr).await.map_err(named(format!("peer_listen {peer_addr}")))?;
        let http = match cfg.http_listen_addr() {
            Some(a) => Some(TcpListener::bind(&a).await.map_err(named(format!("http_listen {a}")))?),
            None => None,
        };
        Ok(Listeners { client, peer, http })
    }

    /// The addresses they are bound to.
    pub fn bound(&self) -> std::io::Result<Bound> {
        let http = self.http.as_ref().map(TcpListener::local_addr).transpose()?;
        Ok(Bound { client: self.client.local_addr()?, peer: self.peer.local_addr()?, http })
    }
}

/// The addresses a server listens on, once bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bound {
    /// The client listener's address.
    pub client: SocketAddr,
    /// The peer listener's address.
    pub peer: SocketAddr,
    /// The HTTP listener's address (`None`: none; absent in files of earlier builds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<SocketAddr>,
}

impl Bound {
    /// The line `suanli server` prints on stdout: `suanli server listening client=A peer=B`,
    /// then ` http=C` when it serves HTTP.
    pub fn line(&self) -> String {
        let http = self.http.map(|h| format!(" http={h}")).unwrap_or_default();
        format!("{LINE_PREFIX} client={} peer={}{http}", self.client, self.peer)
    }

    /// Reads a [`Bound::line`]; `None` for any other line.
    pub fn parse_line(line: &str) -> Option<Bound> {
        let rest = line.trim().strip_prefix(LINE_PREFIX)?;
        let mut client = None;
        let mut peer = None;
        let mut http = None;
        for word in rest.split_whitespace() {
            if let Some(a) = word.strip_prefix("client=") {
                client = a.parse().ok();
            } else if let Some(a) = word.strip_prefix("peer=") {
                peer = a.parse().ok();
            } else if let Some(a) = word.strip_prefix("http=") {
                http = a.parse().ok();
            }
        }
        Some(Bound { client: client?, peer: peer?, http })
    }

    /// Writes `<data_dir>/listening.json` atomically (a temporary file renamed over it), so a
    /// reader sees the previous addresses or these, never a part.
    pub fn write(&self, data_dir: &Path) -> std::io::Result<()> {
        let tmp = data_dir.join(format!(".{LISTENING_FILE}.tmp"));
        let json = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&json)?;
        f.write_all(b"\n")?;
        f.sync_all()?;
        std::fs::rename(&tmp, data_dir.join(LISTENING_FILE))
    }

    /// Reads `<data_dir>/listening.json` (the addresses of the server's latest start).
    pub fn read(data_dir: &Path) -> std::io::Result<Bound> {
        let text = std::fs::read(data_dir.join(LISTENING_FILE))?;
        serde_json::from_slice(&text).map_err(std::io::Error::other)
    }
}

/// Reads a started `suanli server`'s stdout until its [`Bound::line`] (how a harness learns
/// the ports a server on port 0 picked), waiting at most `within`; a thread keeps reading the
/// rest of its stdout so the server never blocks on it.
pub fn await_line(stdout: impl std::io::Read + Send + 'static, within: std::time::Duration) -> std::io::Result<Bound> {
    use std::io::BufRead as _;
    use std::sync::mpsc::RecvTimeoutError;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(b) = Bound::parse_line(&line)
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(b);
            }
        }
    });
    rx.recv_timeout(within).map_err(|e| match e {
        RecvTimeoutError::Timeout => std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no `{LINE_PREFIX} ...` line on the server's stdout within {within:?}"),
        ),
        RecvTimeoutError::Disconnected => {
            std::io::Error::other("the server closed its stdout (it exited) before it listened")
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn port_zero_binds_and_the_addresses_round_trip() {
        let cfg = crate::ServerConfig { listen: "127.0.0.1:0".into(), ..crate::ServerConfig::default() };
        let l = Listeners::bind(&cfg).await.expect("port 0 binds");
        let b = l.bound().expect("bound");
        assert_ne!(b.client.port(), 0);
        assert_ne!(b.peer.port(), 0, "the default peer listener of port 0 is port 0 too");
        assert_ne!(b.client, b.peer);
        assert_eq!(Bound::parse_line(&b.line()), Some(b));
        assert_eq!(Bound::parse_line(&format!("  {}\n", b.line())), Some(b));
        assert_eq!(Bound::parse_line("suanli server listening client=x peer=127.0.0.1:1"), None);
        assert_eq!(Bound::parse_line("listening client=127.0.0.1:1 peer=127.0.0.1:2"), None);
        let dir = tempfile::tempdir().expect("tempdir");
        b.write(dir.path()).expect("written");
        assert_eq!(Bound::read(dir.path()).expect("read"), b);
        assert!(!dir.path().join(format!(".{LISTENING_FILE}.tmp")).exists());
    }

    #[test]
    fn the_line_is_read_from_a_stream_among_others() {
        let b = Bound { client: ([127, 0, 0, 1], 4100).into(), peer: ([127, 0, 0, 1], 4101).into(), http: Some(([127, 0, 0, 1], 4102).into()) };
        let text = format!("something else\n{}\nmore\n", b.line());
        let got = await_line(std::io::Cursor::new(text.into_bytes()), std::time::Duration::from_secs(5));
        assert_eq!(got.expect("found"), b);
        let e = await_line(std::io::Cursor::new(b"no line\n".to_vec()), std::time::Duration::from_secs(5))
            .expect_err("closed first");
        assert!(e.to_string().contains("exited"), "{e}");
    }

    #[tokio::test]
    async fn a_taken_port_names_the_field() {
        let taken = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = taken.local_addr().expect("addr").to_string();
        let cfg = crate::ServerConfig {
            listen: "127.0.0.1:0".into(),
            peer_listen: Some(addr.clone()),
            ..crate::ServerConfig::default()
        };
        let Err(e) = Listeners::bind(&cfg).await else { panic!("the peer port is taken") };
        assert!(e.to_string().starts_with(&format!("peer_listen {addr}")), "{e}");
    }
}
