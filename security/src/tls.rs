//! The rustls configuration of every link, from three PEM files (the cluster's CA, this
//! process's certificate chain and its key), reloaded without a restart: [`Tls::spawn_reloader`]
//! re-reads the files when they change (polled) or on SIGHUP, and new connections use the new
//! certificate (open ones keep theirs).
//!
//! ```text
//!  server side: TcpListener ─▶ incoming(listener, tls, auth) ─▶ ServerConn (Connected: PeerInfo)
//!               ─▶ tonic serve_with_incoming; a handler or layer reads PeerInfo from the request's extensions
//!  client side: channel(endpoint, Some(tls)) ─▶ tonic Channel over a rustls connector (the
//!               endpoint's host is the name checked in the server's certificate)
//! ```
//!
//! Peers verify each other against the CA only (webpki, with the ring provider); the identity
//! a certificate names is read from its URI SAN ([`crate::Principal::from_uri`]).

use crate::principal::Principal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// Where the PEM files are.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// The CA certificate(s) peers are verified against.
    pub ca: PathBuf,
    /// This process's certificate chain (leaf first).
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// Why TLS material could not be loaded.
#[derive(Debug, Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("{what} {path}: {source}")]
    Io {
        /// Which file (`ca`, `cert`, `key`).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file holds no usable PEM item, or rustls refused the material.
    #[error("{what} {path}: {message}")]
    Invalid {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Whether the server side asks for a client certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// A client must present a certificate signed by the CA (peer listener, agent links).
    Required,
    /// A client may present one; without it, it is anonymous unless it sends a token (the
    /// client listener).
    Optional,
}

/// Reloadable TLS material: cheap to clone (shared).
#[derive(Clone)]
pub struct Tls {
    #[allow(dead_code)]
    inner: Arc<()>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls")
    }
}

impl Tls {
    /// Loads the files; an error names the file and what is wrong with it.
    pub fn load(files: TlsFiles) -> Result<Tls, TlsError> {
        let _ = files;
        todo!("h-tls")
    }

    /// Re-reads the files; `Ok(true)` when anything changed (new connections use it), `Ok(false)`
    /// when nothing did. On an error the previous material stays in use.
    pub fn reload(&self) -> Result<bool, TlsError> {
        todo!("h-tls")
    }

    /// Reloads every `every` when a file's modification time or size changed, and at once on
    /// SIGHUP; logs each reload and each failure (and keeps the previous material on failure).
    pub fn spawn_reloader(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let _ = every;
        todo!("h-tls")
    }

    /// The identity this process's own certificate names (`None`: it names none).
    pub fn own_identity(&self) -> Option<Principal> {
        todo!("h-tls")
    }

    /// The current server-side configuration (ALPN h2).
    pub fn server_config(&self, auth: ClientAuth) -> Arc<rustls::ServerConfig> {
        let _ = auth;
        todo!("h-tls")
    }

    /// The current client-side configuration (ALPN h2, this process's certificate as the
    /// client certificate).
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        todo!("h-tls")
    }

    /// How many times the material was reloaded (for tests and logs).
    pub fn generation(&self) -> u64 {
        todo!("h-tls")
    }
}

/// What a server learns about a TLS connection's peer: in each request's extensions (tonic's
/// `Connected::ConnectInfo`), read by the authorization layer.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    /// The peer's address.
    pub remote: Option<SocketAddr>,
    /// The identity its certificate names: `None` without a client certificate,
    /// `Some(Principal::Anonymous)` for a verified certificate that names nobody.
    pub principal: Option<Principal>,
}

/// Reads the identity a DER certificate names in its URI SANs ([`Principal::Anonymous`] if none).
pub fn principal_of(cert_der: &[u8]) -> Principal {
    let _ = cert_der;
    todo!("h-tls")
}

/// A TLS connection accepted by [`incoming`]: implements tokio's `AsyncRead`/`AsyncWrite` and
/// tonic's `Connected` with `ConnectInfo = PeerInfo`.
pub struct ServerConn {
    #[allow(dead_code)]
    inner: (),
}

/// The TLS connections accepted on `listener`, for `serve_with_incoming`: handshakes run
/// concurrently (one slow client cannot hold the accept loop), each bounded by
/// `handshake_timeout`; a failed handshake is logged (debug) and dropped, never ends the stream.
pub fn incoming(
    listener: tokio::net::TcpListener,
    tls: Tls,
    auth: ClientAuth,
    handshake_timeout: Duration,
) -> impl tokio_stream::Stream<Item = Result<ServerConn, std::io::Error>> + Send + 'static {
    let _ = (listener, tls, auth, handshake_timeout);
    tokio_stream::empty()
}

/// A lazily connected channel to `endpoint` (an `http://host:port` or `https://host:port`
/// endpoint; its settings, such as timeouts, are kept): over TLS with the current
/// [`Tls::client_config`] when `tls` is given (the host is the name verified in the server's
/// certificate), plaintext otherwise.
pub fn channel(endpoint: tonic::transport::Endpoint, tls: Option<&Tls>) -> tonic::transport::Channel {
    let _ = tls;
    endpoint.connect_lazy()
}
