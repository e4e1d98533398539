//! The web dashboard (docs/dashboard.md): static files embedded in the binary, and a read-only
//! JSON gateway under `/api/` onto the very gRPC methods the CLI calls.
//!
//! ```text
//!  GET /                 index.html (CSP: self only)
//!  GET /assets/app.js    app.js, style.css
//!  GET /api/<Service>/<Method>?query
//!      ─▶ allow-list of read methods (anything else: 404)
//!      ─▶ prost request built from the query (a bad value: 400 naming the field)
//!      ─▶ gRPC-framed http request: the caller's Authorization header + PeerInfo (certificate)
//!      ─▶ access layer (Listener::Client) ─▶ the tonic services of the client listener
//!      ─▶ grpc-status ─▶ HTTP status (401, 403, 404, 400, 503, ...), body {"code","message"}
//!         or the response message as JSON (the CLI's `--output json` shape)
//! ```
//!
//! The call goes through the same [`crate::access::AccessLayer`] as a gRPC call on the client
//! listener: the same token check, rate limit and policy rule of the method, so the dashboard
//! can show nothing its caller could not read with `suanli ... --output json`.

use crate::api::Api;
use crate::http::HttpCtx;
use axum::Router;
use axum::extract::{ConnectInfo, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use std::collections::HashMap;
use suanli_proto::v1 as pb;
use suanli_proto::v1::cluster_server::ClusterServer;
use suanli_proto::v1::jobs_server::JobsServer;
use suanli_proto::v1::nodes_server::NodesServer;
use suanli_proto::v1::pools_server::PoolsServer;
use suanli_proto::v1::queues_server::QueuesServer;
use suanli_security::policy::Listener;
use suanli_security::tls::PeerInfo;
use tonic::{Code, Status};
use tower::ServiceExt as _;

const INDEX_HTML: &str = include_str!("../dashboard/index.html");
const APP_JS: &str = include_str!("../dashboard/app.js");
const STYLE_CSS: &str = include_str!("../dashboard/style.css");

/// The Content-Security-Policy of every dashboard answer: scripts, styles and fetches from
/// this origin only; no inline script, no frames, no plugins, no form posts.
pub(crate) const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
     connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Most bytes of one gRPC answer the gateway reads (a page of the largest list).
const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

/// The tonic services of the gateway behind the client listener's access layer.
type Grpc = crate::access::AccessService<tonic::service::Routes>;

#[derive(Clone)]
struct Dash {
    grpc: Grpc,
}

/// The read services the gateway reaches, behind `access.layer(Listener::Client)`: the same
/// tonic services (on the same [`Api`]) as the client listener.
fn grpc(ctx: &HttpCtx, api: Api) -> Grpc {
    let routes = tonic::service::Routes::new(JobsServer::new(api.clone()))
        .add_service(QueuesServer::new(api.clone()))
        .add_service(PoolsServer::new(api.clone()))
        .add_service(NodesServer::new(api.clone()))
        .add_service(ClusterServer::new(api))
        .add_service(suanli_proto::v1::cost_server::CostServer::new(crate::cost_api::CostApi(ctx.core.clone())))
        .prepare();
    tower::Layer::layer(&ctx.access.layer(Listener::Client), routes)
}

/// The routes this module serves.
pub(crate) fn routes(ctx: HttpCtx) -> Router {
    let dash = Dash { grpc: grpc(&ctx, ctx.api.clone()) };
    Router::new()
        .route("/", get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }))
        .route("/index.html", get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }))
        .route("/assets/app.js", get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }))
        .route("/assets/style.css", get(|| async { asset("text/css; charset=utf-8", STYLE_CSS) }))
        .route("/api/{service}/{method}", get(api).post(api))
        .fallback(not_found)
        .with_state(dash)
}

/// The headers every dashboard answer carries.
fn hardened(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    hardened(([(header::CONTENT_TYPE, content_type)], body).into_response())
}

async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "NOT_FOUND", "no such page or API method")
}

/// A JSON error answer: `{"code": ..., "message": ...}`.
fn error(status: StatusCode, code: &str, message: &str) -> Response {
    let body = serde_json::json!({ "code": code, "message": message }).to_string();
    hardened((status, [(header::CONTENT_TYPE, "application/json")], body).into_response())
}

/// The HTTP status a gRPC status reads as.
fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::FailedPrecondition => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn status_answer(s: &Status) -> Response {
    let code = suanli_client::code_name(s.code());
    error(http_status(s.code()), code, s.message())
}

/// The query's parameters, read by name; a bad value is an error naming it.
struct Params(HashMap<String, String>);

impl Params {
    fn str(&self, name: &str) -> String {
        self.0.get(name).cloned().unwrap_or_default()
    }
    fn u64(&self, name: &str) -> Result<u64, String> {
        match self.0.get(name).map(String::as_str) {
            None | Some("") => Ok(0),
            Some(v) => v.parse().map_err(|_| format!("{name}: {v:?} is not an integer 0..2^64")),
        }
    }
    fn u32(&self, name: &str) -> Result<u32, String> {
        let v = self.u64(name)?;
        u32::try_from(v).map_err(|_| format!("{name}: {v} is above {}", u32::MAX))
    }
    fn bool(&self, name: &str) -> Result<bool, String> {
        match self.0.get(name).map(String::as_str) {
            None | Some("" | "false" | "0") => Ok(false),
            Some("true" | "1") => Ok(true),
            Some(v) => Err(format!("{name}: {v:?} is not true or false")),
        }
    }
    /// A comma-separated list.
    fn list(&self, name: &str) -> Vec<String> {
        self.str(name).split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect()
    }
}

/// `GET|POST /api/<Service>/<Method>?...`: one read method of the allow-list, called in
/// process through the client listener's access layer. Query parameters are the request
/// message's fields by their .proto names (lists comma-separated); a POST's body is ignored.
async fn api(
    State(dash): State<Dash>,
    Path((service, method)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
    req: Request,
) -> Response {
    let p = Params(query);
    let peer = req.extensions().get::<ConnectInfo<PeerInfo>>().map(|c| c.0.clone());
    let call = Call { grpc: dash.grpc, headers: req.headers().clone(), peer };
    match read(&call, &service, &method, &p).await {
        Ok(r) => r,
        Err(bad) => error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", &bad),
    }
}

/// The allow-list: each read method, its request built from the query (a bad parameter: its
/// name and what is wrong).
async fn read(call: &Call, service: &str, method: &str, p: &Params) -> Result<Response, String> {
    Ok(match (service, method) {
        ("Cluster", "Members") => call.unary::<_, pb::MembersResponse>(service, method, pb::MembersRequest {}).await,
        ("Cluster", "Leader") => call.unary::<_, pb::LeaderResponse>(service, method, pb::LeaderRequest {}).await,
        ("Nodes", "List") => {
            let req = pb::ListNodesRequest {
                pool: p.str("pool"),
                stale: p.bool("stale")?,
                limit: p.u32("limit")?,
                after: p.str("after"),
            };
            call.unary::<_, pb::ListNodesResponse>(service, method, req).await
        }
        ("Nodes", "Get") => {
            let req = pb::GetNodeRequest { id: p.str("id"), stale: p.bool("stale")? };
            call.unary::<_, pb::NodeInfo>(service, method, req).await
        }
        ("Pools", "List") => {
            let req = pb::ListPoolsRequest { stale: p.bool("stale")?, limit: p.u32("limit")?, after: p.str("after") };
            call.unary::<_, pb::ListPoolsResponse>(service, method, req).await
        }
        ("Queues", "List") => {
            let req = pb::ListQueuesRequest { stale: p.bool("stale")?, limit: p.u32("limit")?, after: p.str("after") };
            call.unary::<_, pb::ListQueuesResponse>(service, method, req).await
        }
        ("Queues", "Get") => {
            let req = pb::GetQueueRequest { id: p.str("id"), stale: p.bool("stale")? };
            call.unary::<_, pb::QueueInfo>(service, method, req).await
        }
        ("Jobs", "List") => {
            let req = pb::ListJobsRequest {
                queue: p.str("queue"),
                states: p.list("states"),
                limit: p.u32("limit")?,
                after_id: p.u64("after_id")?,
                stale: p.bool("stale")?,
            };
            call.unary::<_, pb::ListJobsResponse>(service, method, req).await
        }
        ("Jobs", "Get") => {
            let req = pb::GetJobRequest { job_id: p.u64("job_id")?, stale: p.bool("stale")? };
            call.unary::<_, pb::JobInfo>(service, method, req).await
        }
        ("Cost", "Report") => {
            let req = pb::CostReportRequest { by: p.str("by"), since: p.u64("since")?, until: p.u64("until")? };
            call.unary::<_, pb::CostReportResponse>(service, method, req).await
        }
        ("Cost", "GetPrices") => call.unary::<_, pb::GetPricesResponse>(service, method, pb::GetPricesRequest {}).await,
        _ => error(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            &format!("{service}.{method}: not a read method the dashboard serves (docs/dashboard.md lists them)"),
        ),
    })
}

/// One caller's request, to be replayed as gRPC calls.
struct Call {
    grpc: Grpc,
    headers: HeaderMap,
    peer: Option<PeerInfo>,
}

impl Call {
    /// Calls `/suanli.v1.<service>/<method>` with `req`, as a gRPC client on the client
    /// listener would (its Authorization header, its certificate's identity), and answers
    /// the response message as JSON, or the status as an HTTP error.
    async fn unary<Req, Resp>(&self, service: &str, method: &str, req: Req) -> Response
    where
        Req: prost::Message,
        Resp: prost::Message + Default + serde::Serialize,
    {
        match self.call::<Req, Resp>(service, method, req).await {
            Ok(m) => match serde_json::to_string(&m) {
                Ok(body) => hardened(([(header::CONTENT_TYPE, "application/json")], body).into_response()),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", &format!("encoding the answer: {e}")),
            },
            Err(s) => status_answer(&s),
        }
    }

    async fn call<Req, Resp>(&self, service: &str, method: &str, req: Req) -> Result<Resp, Status>
    where
        Req: prost::Message,
        Resp: prost::Message + Default,
    {
        let len = u32::try_from(req.encoded_len()).map_err(|_| Status::invalid_argument("request: too large"))?;
        let mut buf = BytesMut::with_capacity(5 + req.encoded_len());
        buf.put_u8(0);
        buf.put_u32(len);
        req.encode(&mut buf).map_err(|e| Status::internal(format!("encoding the request: {e}")))?;
        let mut http_req = tonic::codegen::http::Request::builder()
            .method("POST")
            .uri(format!("/suanli.v1.{service}/{method}"))
            .header(header::CONTENT_TYPE, "application/grpc")
            .header(header::TE, "trailers")
            .body(tonic::body::Body::new(http_body_util::Full::new(buf.freeze())))
            .map_err(|e| Status::internal(format!("building the request: {e}")))?;
        if let Some(v) = self.headers.get(header::AUTHORIZATION) {
            http_req.headers_mut().insert(header::AUTHORIZATION, v.clone());
        }
        if let Some(peer) = &self.peer {
            http_req.extensions_mut().insert(peer.clone());
        }
        let resp = match self.grpc.clone().oneshot(http_req).await {
            Ok(r) => r,
            Err(never) => match never {},
        };
        if let Some(s) = Status::from_header_map(resp.headers())
            && s.code() != Code::Ok
        {
            return Err(s);
        }
        let body = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| Status::internal(format!("reading the answer: {e}")))?;
        if let Some(t) = body.trailers()
            && let Some(s) = Status::from_header_map(t)
            && s.code() != Code::Ok
        {
            return Err(s);
        }
        let bytes: Bytes = body.to_bytes();
        let msg = bytes.get(5..).ok_or_else(|| Status::internal("the answer holds no message"))?;
        Resp::decode(msg).map_err(|e| Status::internal(format!("decoding the answer: {e}")))
    }
}
