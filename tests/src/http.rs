//! One HTTP/2 request over TLS to a process's HTTP listener (`/metrics`, the dashboard), with
//! the CA only or with a client identity, and an optional bearer token.

use http_body_util::BodyExt as _;
use std::path::PathBuf;
use std::time::Duration;
use suanli_security::tls::Tls;
use tower::ServiceExt as _;

/// A client of one HTTP listener.
pub struct Http {
    ch: tonic::transport::Channel,
}

/// An answer.
#[derive(Debug)]
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// `content-type`.
    pub content_type: String,
    /// `content-security-policy`.
    pub csp: String,
    /// The body as text.
    pub body: String,
}

impl Http {
    /// To `https://addr`, trusting `ca`, no client certificate.
    pub fn new(addr: &str, ca: PathBuf) -> Http {
        Http::with(addr, &Tls::load_ca_only(ca).expect("the CA loads"))
    }

    /// To `https://addr` with `tls` (its CA, and its identity when it has one).
    pub fn with(addr: &str, tls: &Tls) -> Http {
        let ep = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
            .expect("an address")
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(10));
        Http { ch: suanli_security::tls::channel(ep, Some(tls)) }
    }

    /// `GET path`, with `Authorization: Bearer token` when given.
    pub async fn get(&self, path: &str, token: Option<&str>) -> Answer {
        let mut req = tonic::codegen::http::Request::builder().method("GET").uri(path);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let req = req.body(tonic::body::Body::empty()).expect("a request");
        let resp = self.ch.clone().oneshot(req).await.expect("an answer");
        let header =
            |n: &str| resp.headers().get(n).and_then(|v| v.to_str().ok()).map(str::to_owned).unwrap_or_default();
        let (status, content_type, csp) =
            (resp.status().as_u16(), header("content-type"), header("content-security-policy"));
        let body = resp.into_body().collect().await.expect("a body").to_bytes();
        Answer { status, content_type, csp, body: String::from_utf8_lossy(&body).into_owned() }
    }
}
