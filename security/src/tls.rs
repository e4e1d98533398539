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
use hyper_util::rt::TokioIo;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};
use tracing::{debug, info, warn};

/// Largest PEM file read (CA, certificate chain or key), in bytes.
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// The ALPN protocol both sides offer: gRPC runs over HTTP/2.
pub const ALPN_H2: &[u8] = b"h2";

/// How many accepted connections [`incoming`] may hold between their handshake and the server
/// taking them.
pub const ACCEPT_QUEUE: usize = 64;

/// How many handshakes [`incoming`] runs at once; a connection accepted beyond that is closed
/// at once (logged at debug).
pub const MAX_CONCURRENT_HANDSHAKES: usize = 1024;

/// The provider every configuration is built with (ring), never a process default.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

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
    /// As `Optional`, with ALPN `h2` and `http/1.1`: the HTTP listener (`/metrics`, the
    /// dashboard), which browsers and Prometheus reach over either.
    OptionalHttp,
}

/// Reloadable TLS material: cheap to clone (shared).
#[derive(Clone)]
pub struct Tls {
    inner: Arc<Inner>,
}

struct Inner {
    files: TlsFiles,
    current: RwLock<Arc<Material>>,
    generation: AtomicU64,
    /// Serializes reloads (the poller and SIGHUP, or a caller): a reload reads, builds and
    /// swaps as one step.
    reloading: std::sync::Mutex<()>,
}

/// One loaded set of files: the configurations built from them.
struct Material {
    /// SHA-256 of the three files' contents, to tell whether a reload changes anything.
    digest: [u8; 32],
    /// The files' stamps, taken before they were read (what the poller starts from).
    stamps: [Stamp; 3],
    server_required: Arc<ServerConfig>,
    server_optional: Arc<ServerConfig>,
    server_http: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    identity: Option<Principal>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("files", &self.inner.files).field("generation", &self.generation()).finish()
    }
}

/// Reads at most [`MAX_PEM_BYTES`] of `path`.
fn read_file(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let io = |source| TlsError::Io { what, path: path.to_owned(), source };
    let f = std::fs::File::open(path).map_err(io)?;
    let mut buf = Vec::new();
    f.take(MAX_PEM_BYTES + 1).read_to_end(&mut buf).map_err(io)?;
    if buf.len() as u64 > MAX_PEM_BYTES {
        return Err(TlsError::Invalid {
            what,
            path: path.to_owned(),
            message: format!("larger than {MAX_PEM_BYTES} bytes"),
        });
    }
    Ok(buf)
}

fn certs_of(what: &'static str, path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |message: String| TlsError::Invalid { what, path: path.to_owned(), message };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(bad("holds no CERTIFICATE PEM block".into()));
    }
    Ok(certs)
}

/// Serves no certificate: the server side of a CA-only [`Tls`] (every handshake fails).
#[derive(Debug)]
struct NoServerCert;

impl rustls::server::ResolvesServerCert for NoServerCert {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        None
    }
}

impl Material {
    /// A client that verifies servers against the CA and presents no certificate (its caller
    /// is identified by a bearer token): `cert` and `key` are empty paths.
    fn load_ca_only(files: &TlsFiles) -> Result<Material, TlsError> {
        let stamps = stamps(files);
        let ca_pem = read_file("ca", &files.ca)?;
        let mut h = ring::digest::Context::new(&ring::digest::SHA256);
        h.update(&ca_pem);
        let mut digest = [0u8; 32];
        digest.copy_from_slice(h.finish().as_ref());
        let invalid = |message: String| TlsError::Invalid { what: "ca", path: files.ca.clone(), message };
        let provider = provider();
        let mut roots = RootCertStore::empty();
        for ca in certs_of("ca", &files.ca, &ca_pem)? {
            roots.add(ca).map_err(|e| invalid(format!("not a usable CA certificate: {e}")))?;
        }
        let roots = Arc::new(roots);
        let server = |auth: ClientAuth| -> Result<Arc<ServerConfig>, TlsError> {
            let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone());
            let verifier = match auth {
                ClientAuth::Required => verifier,
                ClientAuth::Optional | ClientAuth::OptionalHttp => verifier.allow_unauthenticated(),
            }
            .build()
            .map_err(|e| invalid(format!("no client verifier from it: {e}")))?;
            let mut cfg = ServerConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| invalid(e.to_string()))?
                .with_client_cert_verifier(verifier)
                .with_cert_resolver(Arc::new(NoServerCert));
            cfg.alpn_protocols = vec![ALPN_H2.to_vec()];
            Ok(Arc::new(cfg))
        };
        let mut client = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid(e.to_string()))?
            .with_root_certificates(roots.clone())
            .with_no_client_auth();
        client.alpn_protocols = vec![ALPN_H2.to_vec()];
        Ok(Material {
            digest,
            stamps,
            server_required: server(ClientAuth::Required)?,
            server_optional: server(ClientAuth::Optional)?,
            server_http: http_config(&server(ClientAuth::Optional)?),
            client: Arc::new(client),
            identity: None,
        })
    }

    fn load(files: &TlsFiles) -> Result<Material, TlsError> {
        if files.cert.as_os_str().is_empty() && files.key.as_os_str().is_empty() {
            return Material::load_ca_only(files);
        }
        let stamps = stamps(files);
        let ca_pem = read_file("ca", &files.ca)?;
        let cert_pem = read_file("cert", &files.cert)?;
        let key_pem = read_file("key", &files.key)?;
        let mut h = ring::digest::Context::new(&ring::digest::SHA256);
        for part in [&ca_pem, &cert_pem, &key_pem] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part);
        }
        let mut digest = [0u8; 32];
        digest.copy_from_slice(h.finish().as_ref());

        let invalid = |what: &'static str, path: &Path, message: String| TlsError::Invalid {
            what,
            path: path.to_owned(),
            message,
        };
        let provider = provider();
        let mut roots = RootCertStore::empty();
        for ca in certs_of("ca", &files.ca, &ca_pem)? {
            roots.add(ca).map_err(|e| invalid("ca", &files.ca, format!("not a usable CA certificate: {e}")))?;
        }
        let roots = Arc::new(roots);
        let chain = certs_of("cert", &files.cert, &cert_pem)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| invalid("key", &files.key, format!("no private key (PKCS#8, PKCS#1 or SEC1 PEM): {e}")))?;
        // The key must be usable and match the certificate (a rotation caught between writing
        // the key and the certificate fails here, and the previous material stays).
        CertifiedKey::from_der(chain.clone(), key.clone_key(), &provider).map_err(|e| {
            invalid("key", &files.key, format!("does not match the certificate {}: {e}", files.cert.display()))
        })?;
        let identity = match principal_of(&chain[0]) {
            Principal::Anonymous => None,
            p => Some(p),
        };

        let server = |auth: ClientAuth| -> Result<Arc<ServerConfig>, TlsError> {
            let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone());
            let verifier = match auth {
                ClientAuth::Required => verifier,
                ClientAuth::Optional | ClientAuth::OptionalHttp => verifier.allow_unauthenticated(),
            }
            .build()
            .map_err(|e| invalid("ca", &files.ca, format!("no client verifier from it: {e}")))?;
            let mut cfg = ServerConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| invalid("cert", &files.cert, e.to_string()))?
                .with_client_cert_verifier(verifier)
                .with_single_cert(chain.clone(), key.clone_key())
                .map_err(|e| invalid("cert", &files.cert, e.to_string()))?;
            cfg.alpn_protocols = vec![ALPN_H2.to_vec()];
            Ok(Arc::new(cfg))
        };
        let server_required = server(ClientAuth::Required)?;
        let server_optional = server(ClientAuth::Optional)?;
        let mut client = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("cert", &files.cert, e.to_string()))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| invalid("cert", &files.cert, e.to_string()))?;
        client.alpn_protocols = vec![ALPN_H2.to_vec()];
        let server_http = http_config(&server_optional);
        Ok(Material { digest, stamps, server_required, server_optional, server_http, client: Arc::new(client), identity })
    }
}

impl Tls {
    /// Loads the files; an error names the file and what is wrong with it.
    pub fn load(files: TlsFiles) -> Result<Tls, TlsError> {
        let material = Material::load(&files)?;
        Ok(Tls {
            inner: Arc::new(Inner {
                files,
                current: RwLock::new(Arc::new(material)),
                generation: AtomicU64::new(0),
                reloading: std::sync::Mutex::new(()),
            }),
        })
    }

    /// TLS for a client that verifies the servers against `ca` and presents no certificate
    /// (its identity is a bearer token): its files' `cert` and `key` are empty, it names no
    /// identity, and serving with it fails every handshake. Reloaded like [`Tls::load`]'s.
    pub fn load_ca_only(ca: PathBuf) -> Result<Tls, TlsError> {
        Tls::load(TlsFiles { ca, cert: PathBuf::new(), key: PathBuf::new() })
    }

    /// The files it was loaded from.
    pub fn files(&self) -> &TlsFiles {
        &self.inner.files
    }

    fn current(&self) -> Arc<Material> {
        self.inner.current.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Re-reads the files; `Ok(true)` when anything changed (new connections use it), `Ok(false)`
    /// when nothing did. On an error the previous material stays in use.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let _one = self.inner.reloading.lock().unwrap_or_else(PoisonError::into_inner);
        let material = Material::load(&self.inner.files)?;
        if material.digest == self.current().digest {
            return Ok(false);
        }
        *self.inner.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(material);
        self.inner.generation.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    }

    /// Reloads every `every` when a file's modification time or size changed, and at once on
    /// SIGHUP; logs each reload and each failure (and keeps the previous material on failure).
    /// Must be called within a tokio runtime. The SIGHUP handler is installed before it
    /// returns (from then on SIGHUP no longer ends the process). The task ends when every clone of this `Tls` is dropped (or when it is aborted).
    pub fn spawn_reloader(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let files = self.inner.files.clone();
        let every = every.max(Duration::from_millis(10));
        // Registered before returning, so a SIGHUP sent once this returns is never the
        // default action (which ends the process).
        let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                warn!(error = %e, "tls: no SIGHUP handler; certificates reload by polling only");
                None
            }
        };
        tokio::spawn(async move {
            // From the loaded material's stamps: a change made before this runs is seen.
            let Some(mut seen) = weak.upgrade().map(|inner| Tls { inner }.current().stamps) else { return };
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                let by_signal = tokio::select! {
                    _ = tick.tick() => false,
                    Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => true,
                };
                let Some(inner) = weak.upgrade() else { return };
                let tls = Tls { inner };
                let now = stamps(&files);
                if !by_signal && now == seen {
                    continue;
                }
                seen = now;
                let why = if by_signal { "SIGHUP" } else { "files changed" };
                // Reading and parsing a few KiB: done inline, off no hot path.
                match tls.reload() {
                    Ok(true) => info!(
                        cert = %files.cert.display(),
                        generation = tls.generation(),
                        identity = ?tls.own_identity(),
                        "tls: reloaded ({why}); new connections use the new certificate"
                    ),
                    Ok(false) => debug!(cert = %files.cert.display(), "tls: {why}, contents unchanged"),
                    Err(e) => warn!(error = %e, "tls: reload failed ({why}); the previous certificate stays in use"),
                }
            }
        })
    }

    /// The identity this process's own certificate names (`None`: it names none).
    pub fn own_identity(&self) -> Option<Principal> {
        self.current().identity.clone()
    }

    /// The current server-side configuration (ALPN h2).
    pub fn server_config(&self, auth: ClientAuth) -> Arc<rustls::ServerConfig> {
        let m = self.current();
        match auth {
            ClientAuth::Required => m.server_required.clone(),
            ClientAuth::Optional => m.server_optional.clone(),
            ClientAuth::OptionalHttp => m.server_http.clone(),
        }
    }

    /// The current client-side configuration (ALPN h2, this process's certificate as the
    /// client certificate).
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        self.current().client.clone()
    }

    /// How many times the material was reloaded (for tests and logs).
    pub fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::SeqCst)
    }
}

/// What the poller compares: each file's modification time, size and inode (a rename over
/// it changes the inode).
type Stamp = Option<(std::time::SystemTime, u64, u64)>;

fn stamps(files: &TlsFiles) -> [Stamp; 3] {
    use std::os::unix::fs::MetadataExt;
    let one = |p: &Path| std::fs::metadata(p).ok().and_then(|m| Some((m.modified().ok()?, m.len(), m.ino())));
    [one(&files.ca), one(&files.cert), one(&files.key)]
}

/// `optional` (a client certificate may be given) with ALPN `h2` and `http/1.1`.
fn http_config(optional: &Arc<ServerConfig>) -> Arc<ServerConfig> {
    let mut cfg = ServerConfig::clone(optional);
    cfg.alpn_protocols = vec![ALPN_H2.to_vec(), b"http/1.1".to_vec()];
    Arc::new(cfg)
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

/// Reads the identity a DER certificate names in its URI SANs ([`Principal::Anonymous`] if none):
/// the first URI SAN that is a suanli identity.
pub fn principal_of(cert_der: &[u8]) -> Principal {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(cert_der) else {
        return Principal::Anonymous;
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Principal::Anonymous;
    };
    san.value
        .general_names
        .iter()
        .find_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(uri) => Principal::from_uri(uri),
            _ => None,
        })
        .unwrap_or(Principal::Anonymous)
}

/// A TLS connection accepted by [`incoming`]: implements tokio's `AsyncRead`/`AsyncWrite` and
/// tonic's `Connected` with `ConnectInfo = PeerInfo`.
pub struct ServerConn {
    stream: tokio_rustls::server::TlsStream<TcpStream>,
    peer: PeerInfo,
}

impl ServerConn {
    /// What is known of the peer.
    pub fn peer(&self) -> &PeerInfo {
        &self.peer
    }
}

impl std::fmt::Debug for ServerConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConn").field("peer", &self.peer).finish()
    }
}

impl AsyncRead for ServerConn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for ServerConn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for ServerConn {
    type ConnectInfo = PeerInfo;
    fn connect_info(&self) -> PeerInfo {
        self.peer.clone()
    }
}

/// The TLS connections accepted on `listener`, for `serve_with_incoming`: handshakes run
/// concurrently (one slow client cannot hold the accept loop; at most
/// [`MAX_CONCURRENT_HANDSHAKES`]), each bounded by `handshake_timeout`; a failed handshake is
/// logged (debug) and dropped, never ends the stream. Each handshake uses the configuration
/// current when the connection was accepted. The accept loop ends when the stream is dropped.
pub fn incoming(
    listener: tokio::net::TcpListener,
    tls: Tls,
    auth: ClientAuth,
    handshake_timeout: Duration,
) -> impl tokio_stream::Stream<Item = Result<ServerConn, std::io::Error>> + Send + 'static {
    let (tx, rx) = mpsc::channel::<Result<ServerConn, std::io::Error>>(ACCEPT_QUEUE);
    tokio::spawn(async move {
        let handshakes = Arc::new(Semaphore::new(MAX_CONCURRENT_HANDSHAKES));
        loop {
            let accepted = tokio::select! {
                _ = tx.closed() => return,
                r = listener.accept() => r,
            };
            let (tcp, remote) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off a little instead of
                    // spinning (there is no event that says a descriptor is free again).
                    warn!(error = %e, "tls: accept failed");
                    tokio::select! {
                        _ = tx.closed() => return,
                        _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
                    }
                }
            };
            let Ok(permit) = handshakes.clone().try_acquire_owned() else {
                debug!(%remote, "tls: {MAX_CONCURRENT_HANDSHAKES} handshakes in progress; connection closed");
                continue;
            };
            if let Err(e) = tcp.set_nodelay(true) {
                debug!(%remote, error = %e, "tls: set_nodelay failed");
            }
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config(auth));
            let tx = tx.clone();
            tokio::spawn(async move {
                let stream = match tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        debug!(%remote, error = %e, "tls: handshake failed");
                        return;
                    }
                    Err(_) => {
                        debug!(%remote, timeout = ?handshake_timeout, "tls: handshake timed out");
                        return;
                    }
                };
                drop(permit);
                let principal = stream.get_ref().1.peer_certificates().and_then(|c| c.first()).map(|c| principal_of(c));
                let conn = ServerConn { stream, peer: PeerInfo { remote: Some(remote), principal } };
                // Waits while the server is behind (bounded queue); fails once it is gone.
                let _ = tx.send(Ok(conn)).await;
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A lazily connected channel to `endpoint` (an `http://host:port` or `https://host:port`
/// endpoint; its settings, such as timeouts, are kept): over TLS with the current
/// [`Tls::client_config`] when `tls` is given (the host is the name verified in the server's
/// certificate), plaintext otherwise.
///
/// With TLS, the scheme does not matter: suanli's connector does TLS for both (tonic is built
/// without its own TLS, so it leaves `https` to the connector). The endpoint's connect timeout
/// bounds dialing and the handshake together.
pub fn channel(endpoint: tonic::transport::Endpoint, tls: Option<&Tls>) -> tonic::transport::Channel {
    let Some(tls) = tls else {
        return endpoint.connect_lazy();
    };
    let tls = tls.clone();
    let timeout = endpoint.get_connect_timeout();
    endpoint.connect_with_connector_lazy(tower::service_fn(move |uri: tonic::transport::Uri| {
        let tls = tls.clone();
        async move {
            match timeout {
                Some(t) => tokio::time::timeout(t, connect(&uri, &tls)).await.map_err(|_| {
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("connecting to {uri} (TCP and TLS handshake) took over {t:?}"),
                    )
                })?,
                None => connect(&uri, &tls).await,
            }
        }
    }))
}

/// Dials `uri`'s host and port and runs the TLS handshake with the current client
/// configuration, verifying the server's certificate names that host.
async fn connect(
    uri: &tonic::transport::Uri,
    tls: &Tls,
) -> Result<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>, std::io::Error> {
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    let host = uri.host().ok_or_else(|| bad(format!("endpoint {uri}: no host")))?;
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let port = uri.port_u16().unwrap_or(if uri.scheme_str() == Some("https") { 443 } else { 80 });
    let name = ServerName::try_from(host.to_owned())
        .map_err(|e| bad(format!("endpoint {uri}: host {host:?} is not a DNS name or IP address: {e}")))?;
    let tcp = TcpStream::connect((host, port)).await?;
    tcp.set_nodelay(true)?;
    let connector = tokio_rustls::TlsConnector::from(tls.client_config());
    let stream = connector.connect(name, tcp).await?;
    Ok(TokioIo::new(stream))
}
