//! Authorization of every call to a federation server, one tower layer on both listeners.
//!
//! ```text
//!  request ─▶ caller: the TLS client certificate's identity (PeerInfo) │ anonymous │ insecure
//!          ─▶ policy::rule(path) on this listener? no ─▶ PERMISSION_DENIED ("this address is a
//!             federation server ...")
//!          ─▶ policy::decide ─▶ Unauthenticated / Deny ─▶ refused
//!          ─▶ extensions += Principal, Decision ─▶ handler (team scope: Submit, Cancel)
//! ```
//!
//! Bearer tokens are region-local (signed by a region's key): a federation server accepts
//! certificates only. Team checks need the decoded request, so the handlers make them from the
//! [`Decision::AllowIfTeam`] the layer leaves in the request's extensions.

use std::pin::Pin;
use std::task::{Context, Poll};
use suanli_security::policy::{self, Decision, Listener};
use suanli_security::principal::Principal;
use suanli_security::tls::PeerInfo;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http;

/// The layer, before it is given a listener.
#[derive(Clone, Copy, Debug)]
pub struct AccessLayer {
    insecure: bool,
}

impl AccessLayer {
    /// A layer; `insecure` allows everything (a plaintext development server).
    pub fn new(insecure: bool) -> Self {
        AccessLayer { insecure }
    }

    /// The layer for one listener (`Federation` or `FederationPeer`).
    pub fn for_listener(self, listener: Listener) -> ListenerLayer {
        ListenerLayer { insecure: self.insecure, listener }
    }
}

/// The tower layer of one listener.
#[derive(Clone, Copy, Debug)]
pub struct ListenerLayer {
    insecure: bool,
    listener: Listener,
}

impl<S> tower::Layer<S> for ListenerLayer {
    type Service = AccessService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AccessService { inner, insecure: self.insecure, listener: self.listener }
    }
}

/// The layer's service.
#[derive(Clone, Debug)]
pub struct AccessService<S> {
    inner: S,
    insecure: bool,
    listener: Listener,
}

/// What the layer leaves in a request's extensions for its handler.
#[derive(Clone, Debug)]
pub struct Caller {
    /// Who calls.
    pub principal: Principal,
    /// The policy's decision (a handler checks [`Decision::AllowIfTeam`]).
    pub decision: Decision,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>;

/// Whether `rule` is served on `listener` (raft's transport rules apply on the federation's
/// peer listener as on a region's).
fn served_on(rule: &policy::Rule, listener: Listener) -> bool {
    if rule.method.starts_with("/grpc.health.v1.Health/") {
        return true;
    }
    match listener {
        Listener::FederationPeer => {
            rule.listener == Listener::FederationPeer
                || (rule.listener == Listener::Peer && rule.method.starts_with("/suanli.v1.RaftTransport/"))
        }
        l => rule.listener == l,
    }
}

/// The denial for a method this listener does not serve, saying what this address is.
pub fn not_here(path: &str, listener: Listener) -> Status {
    let method = path.trim_start_matches('/');
    match listener {
        Listener::FederationPeer => Status::permission_denied(format!(
            "this address is a federation server's peer listener (servers only: raft, FederationPeer); {method} is not served here"
        )),
        _ => Status::permission_denied(format!(
            "this address is a federation server (suanli federation serve); {method} is served by a region's servers"
        )),
    }
}

impl<S> tower::Service<http::Request<Body>> for AccessService<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let path = req.uri().path().to_owned();
        let who = if self.insecure {
            Principal::Insecure
        } else {
            req.extensions().get::<PeerInfo>().and_then(|p| p.principal.clone()).unwrap_or(Principal::Anonymous)
        };
        let decided = match policy::rule(&path).filter(|r| served_on(r, self.listener)) {
            None => Err(not_here(&path, self.listener)),
            Some(rule) => match policy::decide(rule, &who) {
                Decision::Unauthenticated => Err(Status::unauthenticated(format!(
                    "{path} needs a client certificate signed by the federation's CA (bearer tokens are region-local: a federation server does not take them)"
                ))),
                Decision::Deny(why) => Err(Status::permission_denied(why)),
                d => {
                    if rule.mutating {
                        tracing::info!(method = %path, caller = %who, "federation call");
                    }
                    Ok(d)
                }
            },
        };
        match decided {
            Err(s) => {
                tracing::info!(method = %path, caller = %who, error = %s.message(), "refused");
                Box::pin(async move { Ok(s.into_http()) })
            }
            Ok(decision) => {
                req.extensions_mut().insert(Caller { principal: who, decision });
                Box::pin(async move { inner.call(req).await })
            }
        }
    }
}
