//! The web dashboard (docs/dashboard.md). Placeholder of the contract commit.

use crate::http::HttpCtx;
use axum::Router;

/// The routes this module serves.
pub(crate) fn routes(ctx: HttpCtx) -> Router {
    Router::new().with_state(ctx)
}
