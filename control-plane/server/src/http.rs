//! The server's HTTP listener (`http_listen`): `/metrics` (docs/metrics.md) and the dashboard
//! (docs/dashboard.md), on one axum router served by [`suanli_security::http::serve`] (TLS
//! with the server's certificate, a client certificate optional, ALPN h2 and http/1.1;
//! plaintext under `--insecure`).
//!
//! ```text
//!  http_listen ─▶ router(ctx) = metrics::routes  (/metrics)
//!                             + dashboard::routes (/, /assets/*, /api/*)
//!  each handler: caller(ctx, headers, extensions) ─▶ Principal (token, else certificate, else anonymous)
//! ```
//!
//! Authorization is the gRPC listeners': the same token check ([`crate::access::Access`]),
//! and for what the dashboard reads, the same policy rule of the gRPC method it reads through.

use crate::access::Access;
use crate::core::Core;
use axum::Router;
use axum::extract::ConnectInfo;
use axum::http::{Extensions, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use suanli_security::Principal;
use suanli_security::tls::PeerInfo;

/// What every HTTP handler reads: the server and its authorization.
#[derive(Clone)]
pub(crate) struct HttpCtx {
    /// The server.
    pub core: Arc<Core>,
    /// The gRPC listeners' authorization (token key, revocations, insecure mode).
    pub access: Access,
    /// The client listener's services (the dashboard's `/api/` gateway calls them in process).
    pub api: crate::api::Api,
}

/// The router of the HTTP listener.
pub(crate) fn router(ctx: HttpCtx) -> Router {
    Router::new().merge(crate::metrics::routes(ctx.clone())).merge(crate::dashboard::routes(ctx))
}

/// Who sent an HTTP request: a bearer token (`Authorization: Bearer ...`), else the TLS
/// client certificate, else anonymous; `Principal::Insecure` on an insecure server. A bad
/// token is 401 with the reason.
#[allow(clippy::result_large_err)] // the refusal is the answer
pub(crate) fn caller(ctx: &HttpCtx, headers: &HeaderMap, extensions: &Extensions) -> Result<Principal, Response> {
    let peer = extensions.get::<ConnectInfo<PeerInfo>>().map(|p| &p.0);
    ctx.access
        .principal(headers, peer)
        .map_err(|s| (StatusCode::UNAUTHORIZED, format!("{}\n", s.message())).into_response())
}

/// [`caller`], refusing anonymous callers (401): what `/metrics` requires. Any verified
/// identity may read metrics (a Prometheus with a viewer certificate or token).
#[allow(clippy::result_large_err)] // the refusal is the answer
pub(crate) fn known_caller(ctx: &HttpCtx, headers: &HeaderMap, extensions: &Extensions) -> Result<Principal, Response> {
    match caller(ctx, headers, extensions)? {
        Principal::Anonymous => Err((
            StatusCode::UNAUTHORIZED,
            "anonymous: present a client certificate of the cluster's CA or `Authorization: Bearer <token>`\n",
        )
            .into_response()),
        p => Ok(p),
    }
}
