//! Serving an axum [`Router`] on a process's HTTP listener (`/metrics`, the dashboard): over
//! TLS with the process's certificate (a client certificate optional, ALPN `h2` and
//! `http/1.1`), or plaintext under `--insecure`.
//!
//! ```text
//!  TcpListener ─▶ [tls::incoming (OptionalHttp)] ─▶ HttpListener ─▶ axum::serve
//!      every request's extensions: ConnectInfo<PeerInfo> (the certificate's principal, if any)
//! ```
//!
//! Who the caller is comes from [`caller`]: a bearer token (checked by the caller of this
//! module, which holds the key) wins over the certificate; neither is anonymous.

use crate::Principal;
use crate::tls::{self, ClientAuth, PeerInfo, ServerConn, Tls};
use axum::Router;
use axum::extract::ConnectInfo;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::StreamExt as _;

/// Serves `router` on `listener` until `shutdown` completes, then lets open requests finish.
/// With `tls`, connections are TLS ([`ClientAuth::OptionalHttp`], each handshake bounded by
/// `handshake_timeout`); without, plaintext.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Tls>,
    handshake_timeout: Duration,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = match tls {
        Some(tls) => {
            let local = listener.local_addr()?;
            let incoming = tls::incoming(listener, tls, ClientAuth::OptionalHttp, handshake_timeout);
            HttpListener::Tls { incoming: Box::pin(incoming), local }
        }
        None => HttpListener::Plain(listener),
    };
    axum::serve(listener, router.into_make_service_with_connect_info::<PeerInfo>())
        .with_graceful_shutdown(shutdown)
        .await
}

type Incoming = Pin<Box<dyn tokio_stream::Stream<Item = Result<ServerConn, std::io::Error>> + Send>>;

/// A plaintext or TLS listener for axum, whose address type is [`PeerInfo`].
enum HttpListener {
    Plain(TcpListener),
    Tls { incoming: Incoming, local: std::net::SocketAddr },
}

/// A plaintext or TLS connection.
pub enum HttpConn {
    /// `--insecure`.
    Plain(TcpStream),
    /// TLS.
    Tls(Box<ServerConn>),
}

impl axum::serve::Listener for HttpListener {
    type Io = HttpConn;
    type Addr = PeerInfo;

    async fn accept(&mut self) -> (HttpConn, PeerInfo) {
        match self {
            HttpListener::Plain(l) => loop {
                match TcpListener::accept(l).await {
                    Ok((s, remote)) => {
                        let _ = s.set_nodelay(true);
                        return (HttpConn::Plain(s), PeerInfo { remote: Some(remote), principal: None });
                    }
                    // Out of descriptors and the like: back off instead of spinning.
                    Err(e) => {
                        tracing::warn!(error = %e, "http: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            },
            HttpListener::Tls { incoming, .. } => loop {
                match incoming.next().await {
                    Some(Ok(c)) => {
                        let peer = c.peer().clone();
                        return (HttpConn::Tls(Box::new(c)), peer);
                    }
                    Some(Err(e)) => tracing::debug!(error = %e, "http: a connection failed"),
                    // The accept loop ended (it never does while the listener is held): wait
                    // for the shutdown that ends the server.
                    None => std::future::pending::<()>().await,
                }
            },
        }
    }

    fn local_addr(&self) -> std::io::Result<PeerInfo> {
        let local = match self {
            HttpListener::Plain(l) => l.local_addr()?,
            HttpListener::Tls { local, .. } => *local,
        };
        Ok(PeerInfo { remote: Some(local), principal: None })
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, HttpListener>> for PeerInfo {
    fn connect_info(stream: axum::serve::IncomingStream<'_, HttpListener>) -> Self {
        stream.remote_addr().clone()
    }
}

impl AsyncRead for HttpConn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            HttpConn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            HttpConn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for HttpConn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            HttpConn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            HttpConn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            HttpConn::Plain(s) => Pin::new(s).poll_flush(cx),
            HttpConn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            HttpConn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            HttpConn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Who sent an HTTP request, before any token is checked: the bearer token it carries (its
/// text, for the caller to verify), and the principal its client certificate names.
#[derive(Debug, Clone, Default)]
pub struct HttpCaller {
    /// `Authorization: Bearer <token>`, when present (not yet verified).
    pub bearer: Option<String>,
    /// The principal the TLS client certificate names (`None`: no certificate, or plaintext).
    pub certificate: Option<Principal>,
}

/// Reads [`HttpCaller`] from a request's headers and connection. A malformed `Authorization`
/// header is an error naming it.
pub fn caller(headers: &axum::http::HeaderMap, peer: Option<&ConnectInfo<PeerInfo>>) -> Result<HttpCaller, String> {
    let bearer = match headers.get(axum::http::header::AUTHORIZATION) {
        Some(v) => Some(crate::token::bearer(v.as_bytes())?.to_owned()),
        None => None,
    };
    Ok(HttpCaller { bearer, certificate: peer.and_then(|p| p.0.principal.clone()) })
}
