//! `/metrics`: Prometheus text (docs/metrics.md). Placeholder of the contract commit; the
//! metrics families are built on it.

use crate::http::{HttpCtx, known_caller};
use axum::Router;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

/// The routes this module serves.
pub(crate) fn routes(ctx: HttpCtx) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(ctx)
}

async fn metrics(State(ctx): State<HttpCtx>, req: Request) -> Response {
    if let Err(r) = known_caller(&ctx, req.headers(), req.extensions()) {
        return r;
    }
    ([("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], "# EOF\n").into_response()
}
