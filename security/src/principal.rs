//! Who is calling: a user (by client certificate or bearer token), a node's agent, or a server.
//!
//! A certificate names its holder in a URI subject alternative name:
//!
//! | holder | URI SAN |
//! | --- | --- |
//! | user | `suanli://user/<name>?role=<admin\|operator\|member\|viewer>[&team=<team>]` |
//! | node (agent) | `suanli://node/<node id>` |
//! | server | `suanli://server/<name>` |
//!
//! A certificate without such a SAN identifies nobody ([`Principal::Anonymous`]).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The URI scheme and authority prefix of every suanli identity SAN.
pub const URI_PREFIX: &str = "suanli://";

/// Longest name in an identity (user, node, server, team), in bytes.
pub const MAX_IDENTITY_NAME: usize = 253;

/// A user's role. Each role's rights are the access matrix ([`crate::policy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Everything, including tokens, membership, configuration, backups and the audit log.
    Admin,
    /// Nodes and pools: cordon, drain, uncordon; job migration; reads.
    Operator,
    /// Its team's queues and jobs (submit, cancel, migrate, read its jobs' logs); reads.
    Member,
    /// Reads only (no logs).
    Viewer,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 4] = [Role::Admin, Role::Operator, Role::Member, Role::Viewer];

    /// Its name as written in certificates, tokens and docs.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Operator => "operator",
            Role::Member => "member",
            Role::Viewer => "viewer",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Role, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("unknown role {s:?}: one of admin, operator, member, viewer"))
    }
}

/// How a user proved who it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Credential {
    /// A client certificate signed by the cluster's CA.
    Certificate,
    /// A bearer token; its id (what `suanli token revoke` takes).
    Token {
        /// The token's id.
        id: String,
    },
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Principal {
    /// No credential (or a certificate naming nobody): health checks only.
    Anonymous,
    /// A person or a program acting for a team.
    User {
        /// Its name.
        name: String,
        /// Its role.
        role: Role,
        /// Its team: required for members, optional otherwise.
        team: Option<String>,
        /// How it proved it.
        credential: Credential,
    },
    /// The agent of one node: it may report for that node only.
    Node {
        /// The node's id.
        name: String,
    },
    /// A control-plane server: raft, forwarding, joining.
    Server {
        /// Its certificate's name.
        name: String,
    },
    /// A caller of a server started with `--insecure` (no TLS, no identities): allowed
    /// everything, as the warning at every start says.
    Insecure,
}

impl Principal {
    /// Reads an identity URI SAN (see the module docs); `None` for a URI that is not one (a
    /// certificate may carry other URIs) or that names an invalid role, team or name.
    pub fn from_uri(uri: &str) -> Option<Principal> {
        let rest = uri.strip_prefix(URI_PREFIX)?;
        let (kind, rest) = rest.split_once('/')?;
        let (name, query) = match rest.split_once('?') {
            Some((n, q)) => (n, Some(q)),
            None => (rest, None),
        };
        if !valid_name(name) {
            return None;
        }
        match kind {
            "node" if query.is_none() => Some(Principal::Node { name: name.to_owned() }),
            "server" if query.is_none() => Some(Principal::Server { name: name.to_owned() }),
            "user" => {
                let mut role = None;
                let mut team = None;
                for pair in query?.split('&') {
                    match pair.split_once('=')? {
                        ("role", r) if role.is_none() => role = Some(r.parse::<Role>().ok()?),
                        ("team", t) if team.is_none() && valid_name(t) => team = Some(t.to_owned()),
                        _ => return None,
                    }
                }
                let role = role?;
                if role == Role::Member && team.is_none() {
                    return None;
                }
                Some(Principal::User { name: name.to_owned(), role, team, credential: Credential::Certificate })
            }
            _ => None,
        }
    }

    /// The URI SAN that names this principal in a certificate (`None` for anonymous and
    /// insecure callers, which have none).
    pub fn to_uri(&self) -> Option<String> {
        match self {
            Principal::User { name, role, team, .. } => Some(match team {
                Some(t) => format!("{URI_PREFIX}user/{name}?role={role}&team={t}"),
                None => format!("{URI_PREFIX}user/{name}?role={role}"),
            }),
            Principal::Node { name } => Some(format!("{URI_PREFIX}node/{name}")),
            Principal::Server { name } => Some(format!("{URI_PREFIX}server/{name}")),
            Principal::Anonymous | Principal::Insecure => None,
        }
    }

    /// The user's role (`None` for anything but a user).
    pub fn role(&self) -> Option<Role> {
        match self {
            Principal::User { role, .. } => Some(*role),
            _ => None,
        }
    }

    /// The user's team, if any.
    pub fn team(&self) -> Option<&str> {
        match self {
            Principal::User { team, .. } => team.as_deref(),
            _ => None,
        }
    }
}

/// One line naming the caller in logs and the audit log: `user:alice(member,nlp)`,
/// `token:<id>:alice(admin)`, `node:n1`, `server:s1`, `anonymous`, `insecure`.
impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Principal::Anonymous => f.write_str("anonymous"),
            Principal::Insecure => f.write_str("insecure"),
            Principal::Node { name } => write!(f, "node:{name}"),
            Principal::Server { name } => write!(f, "server:{name}"),
            Principal::User { name, role, team, credential } => {
                match credential {
                    Credential::Certificate => write!(f, "user:{name}")?,
                    Credential::Token { id } => write!(f, "token:{id}:{name}")?,
                }
                match team {
                    Some(t) => write!(f, "({role},{t})"),
                    None => write!(f, "({role})"),
                }
            }
        }
    }
}

/// A name usable in an identity: 1 to [`MAX_IDENTITY_NAME`] bytes of ASCII letters, digits,
/// `.`, `_` and `-`.
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_IDENTITY_NAME
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_uris_round_trip_and_bad_ones_name_nobody() {
        let ps = [
            Principal::User {
                name: "alice".into(),
                role: Role::Member,
                team: Some("nlp".into()),
                credential: Credential::Certificate,
            },
            Principal::User { name: "root".into(), role: Role::Admin, team: None, credential: Credential::Certificate },
            Principal::Node { name: "n1".into() },
            Principal::Server { name: "s-1.example".into() },
        ];
        for p in ps {
            let uri = p.to_uri().expect("has a uri");
            assert_eq!(Principal::from_uri(&uri), Some(p), "{uri}");
        }
        for bad in [
            "suanli://user/alice?role=member",
            "suanli://user/alice?role=god",
            "suanli://user/alice",
            "suanli://user/al ice?role=admin",
            "suanli://user/alice?role=admin&role=viewer",
            "suanli://user/alice?role=admin&x=y",
            "suanli://node/",
            "suanli://node/n1?x=1",
            "suanli://cat/n1",
            "https://node/n1",
            "spiffe://suanli/node/n1",
        ] {
            assert_eq!(Principal::from_uri(bad), None, "{bad}");
        }
    }

    #[test]
    fn display_names_the_caller_and_how() {
        let p = Principal::User {
            name: "alice".into(),
            role: Role::Member,
            team: Some("nlp".into()),
            credential: Credential::Token { id: "t1".into() },
        };
        assert_eq!(p.to_string(), "token:t1:alice(member,nlp)");
        assert_eq!(Principal::Node { name: "n1".into() }.to_string(), "node:n1");
    }
}
