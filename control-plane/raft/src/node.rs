//! What a group's membership records about each server: where its peers reach it and where
//! its clients do. Two addresses, because a server has two listeners (docs/control-plane.md,
//! "Listeners"): raft and forwarded writes travel only on the peer listener; clients and
//! agents only ever learn the client address.

use serde::{Deserialize, Serialize};

/// One member of a raft group, as openraft stores it in the membership.
///
/// Its JSON is `{"addr": "...", "api_addr": "..."}`; a membership written before the two
/// listeners (openraft's `ServerNode`, `{"addr": "..."}`) reads back with an empty `api_addr`,
/// and [`ServerNode::client_addr`] then answers `addr`, which served both then.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ServerNode {
    /// The peer listener (`host:port`): raft RPCs, forwarded writes and read indexes.
    pub addr: String,
    /// The client listener (`host:port`): leader hints given to clients and agents.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub api_addr: String,
}

impl ServerNode {
    /// A member reached by peers at `addr` and by clients at `api_addr`.
    pub fn new(addr: impl Into<String>, api_addr: impl Into<String>) -> Self {
        Self { addr: addr.into(), api_addr: api_addr.into() }
    }

    /// Where clients reach this member.
    pub fn client_addr(&self) -> &str {
        if self.api_addr.is_empty() { &self.addr } else { &self.api_addr }
    }
}

impl std::fmt::Display for ServerNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{{peer: {}, client: {}}}", self.addr, self.client_addr())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_membership_of_an_earlier_build_reads_back() {
        let old: ServerNode = serde_json::from_str(r#"{"addr":"10.0.0.1:7400"}"#).expect("ServerNode's JSON");
        assert_eq!(old.client_addr(), "10.0.0.1:7400");
        let new = ServerNode::new("10.0.0.1:7401", "10.0.0.1:7400");
        let text = serde_json::to_string(&new).expect("encodes");
        assert_eq!(serde_json::from_str::<ServerNode>(&text).expect("decodes"), new);
        assert_eq!(new.client_addr(), "10.0.0.1:7400");
    }
}
