//! suanli's security: who is calling ([`Principal`]), what each caller may do (the access
//! matrix in [`policy`], the one table every listener checks), bearer tokens ([`token`]), and
//! the rustls configuration every link uses ([`tls`]: mutual TLS, reloaded without a restart).
//!
//! ```text
//!  client cert (URI SAN suanli://user/alice?role=member&team=nlp) ─┐
//!  bearer token (sl1.<claims>.<hmac>, key in the replicated state) ─┼─▶ Principal ─▶ policy::decide(method)
//!  node cert (suanli://node/n1), server cert (suanli://server/s1) ──┘                 ▲
//!  tls::Tls: CA + own cert/key from files, reloaded on change or SIGHUP ─────────────┘ (PeerInfo per connection)
//! ```
//!
//! rustls runs on the ring provider, passed explicitly: aws-lc is in the graph through the S3
//! client, so no process-wide default provider is assumed.

pub mod certs;
pub mod http;
pub mod policy;
pub mod principal;
pub mod tls;
pub mod token;

pub use principal::{Principal, Role};
