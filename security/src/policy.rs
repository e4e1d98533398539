//! The access matrix: for every RPC, who may call it. One table, read by the one layer that
//! checks every call (the server's client and peer listeners, the agent's log service) and
//! printed in docs/security.md (a test keeps the two equal).
//!
//! Rights by role (a user has one role; a member belongs to one team):
//!
//! | caller | may |
//! | --- | --- |
//! | admin | everything a user may: tokens, membership, configuration, backups, the audit log, queues |
//! | operator | reads; nodes (cordon, drain, uncordon); job migration |
//! | member | reads; submit to, cancel and migrate jobs of its team's queues, update its services; its team's jobs' logs |
//! | viewer | reads (no logs) |
//! | node (agent) | the `Agent` service, for its own node only |
//! | server | the peer listener (raft, `Internal`) |
//! | anonymous | health checks |
//!
//! "Reads" are the list, get, watch and status calls. An unknown method is denied.

use crate::principal::{Principal, Role};

/// Which listener serves a method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// A server's client listener (the public API and agents).
    Client,
    /// A server's peer listener (raft, `Internal`): servers only.
    Peer,
    /// An agent's log service.
    AgentLogs,
    /// A federation server's client listener (`Federation`; docs/federation.md).
    Federation,
    /// A federation server's peer listener (its raft group, `FederationPeer`): servers only.
    FederationPeer,
}

/// Who may call a method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allow {
    /// Anyone, with or without a credential.
    Anyone,
    /// Users of these roles.
    Roles(&'static [Role]),
    /// A node's agent.
    Node,
    /// A server.
    Server,
}

/// What else is checked once the caller's kind and role are allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Nothing.
    None,
    /// A member only where the object (the job, the queue a job is submitted to, the job a
    /// task's logs belong to) is its team's; other roles listed are not restricted.
    Team,
    /// The node the request is about (its node id, or the node of the allocation it reports
    /// on) is the caller's own.
    OwnNode,
}

/// One method's entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// The gRPC path, `/package.Service/Method`.
    pub method: &'static str,
    /// The listener that serves it.
    pub listener: Listener,
    /// Who may call it.
    pub allow: Allow,
    /// The further check.
    pub scope: Scope,
    /// Whether a call changes something (it is then written to the audit log, allowed or not).
    pub mutating: bool,
}

const READERS: &[Role] = &[Role::Admin, Role::Operator, Role::Member, Role::Viewer];
const ADMIN: &[Role] = &[Role::Admin];
const OPERATORS: &[Role] = &[Role::Admin, Role::Operator];
const TEAM: &[Role] = &[Role::Admin, Role::Member];
const TEAM_AND_OPERATORS: &[Role] = &[Role::Admin, Role::Operator, Role::Member];

const fn r(method: &'static str, listener: Listener, allow: Allow, scope: Scope, mutating: bool) -> Rule {
    Rule { method, listener, allow, scope, mutating }
}

use Allow::{Anyone, Node, Roles, Server};
use Listener::{AgentLogs, Client, Federation, FederationPeer, Peer};

/// Every method of every listener. Health and reflection are matched by service prefix
/// ([`rule`]).
pub static RULES: &[Rule] = &[
    // Jobs
    r("/suanli.v1.Jobs/Submit", Client, Roles(TEAM), Scope::Team, true),
    r("/suanli.v1.Jobs/SubmitMany", Client, Roles(TEAM), Scope::Team, true),
    r("/suanli.v1.Jobs/Get", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Jobs/List", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Jobs/Cancel", Client, Roles(TEAM), Scope::Team, true),
    r("/suanli.v1.Jobs/Watch", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Jobs/Migrate", Client, Roles(TEAM_AND_OPERATORS), Scope::Team, true),
    r("/suanli.v1.Jobs/UpdateService", Client, Roles(TEAM), Scope::Team, true),
    // Queues
    r("/suanli.v1.Queues/Upsert", Client, Roles(ADMIN), Scope::None, true),
    r("/suanli.v1.Queues/Delete", Client, Roles(ADMIN), Scope::None, true),
    r("/suanli.v1.Queues/Get", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Queues/List", Client, Roles(READERS), Scope::None, false),
    // Pools, nodes
    r("/suanli.v1.Pools/List", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Nodes/List", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Nodes/Get", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Nodes/SetMode", Client, Roles(OPERATORS), Scope::None, true),
    r("/suanli.v1.Nodes/ClearQuarantine", Client, Roles(OPERATORS), Scope::None, true),
    // Cluster
    r("/suanli.v1.Cluster/Members", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Cluster/Leader", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Cluster/AddServer", Client, Roles(ADMIN), Scope::None, true),
    r("/suanli.v1.Cluster/RemoveServer", Client, Roles(ADMIN), Scope::None, true),
    r("/suanli.v1.Cluster/Snapshot", Client, Roles(ADMIN), Scope::None, true),
    r("/suanli.v1.Cluster/Version", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Cluster/SkipEntry", Client, Roles(ADMIN), Scope::None, true),
    r("/suanli.v1.Cluster/Digest", Client, Roles(READERS), Scope::None, false),
    // A backup holds everything, the token key included.
    r("/suanli.v1.Cluster/Backup", Client, Roles(ADMIN), Scope::None, true),
    r("/suanli.v1.Cluster/GetConfig", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Cluster/SetConfig", Client, Roles(ADMIN), Scope::None, true),
    // Access
    r("/suanli.v1.Access/WhoAmI", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Access/CreateToken", Client, Roles(ADMIN), Scope::None, true),
    r("/suanli.v1.Access/RevokeToken", Client, Roles(ADMIN), Scope::None, true),
    r("/suanli.v1.Access/ListTokens", Client, Roles(ADMIN), Scope::None, false),
    r("/suanli.v1.Access/Audit", Client, Roles(ADMIN), Scope::None, false),
    // Cost (docs/cost.md): every reader sees every team's cost.
    r("/suanli.v1.Cost/SetPrices", Client, Roles(ADMIN), Scope::None, true),
    r("/suanli.v1.Cost/GetPrices", Client, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Cost/Report", Client, Roles(READERS), Scope::None, false),
    // Agents
    r("/suanli.v1.Agent/Register", Client, Node, Scope::OwnNode, false),
    r("/suanli.v1.Agent/Heartbeat", Client, Node, Scope::OwnNode, false),
    r("/suanli.v1.Agent/WatchAllocations", Client, Node, Scope::OwnNode, false),
    r("/suanli.v1.Agent/ReportStatus", Client, Node, Scope::OwnNode, false),
    r("/suanli.v1.Agent/ReportCheckpoint", Client, Node, Scope::OwnNode, false),
    // Peers
    r("/suanli.v1.RaftTransport/AppendEntries", Peer, Server, Scope::None, false),
    r("/suanli.v1.RaftTransport/Vote", Peer, Server, Scope::None, false),
    r("/suanli.v1.RaftTransport/InstallSnapshot", Peer, Server, Scope::None, false),
    r("/suanli.v1.Internal/Propose", Peer, Server, Scope::None, false),
    r("/suanli.v1.Internal/ReadIndex", Peer, Server, Scope::None, false),
    r("/suanli.v1.Internal/Inspect", Peer, Server, Scope::None, false),
    r("/suanli.v1.Internal/Campaign", Peer, Server, Scope::None, false),
    r("/suanli.v1.Internal/Clock", Peer, Server, Scope::None, false),
    // An agent's log service
    r("/suanli.v1.AgentLogs/Logs", AgentLogs, Roles(TEAM_AND_OPERATORS), Scope::Team, false),
    // A federation server's client listener. Submit and Cancel: a member for its own team (the
    // request's team, or the job's); a region server forwarding a `--global` submit may call
    // them too (servers may call any method) and names the user it acts for.
    r("/suanli.v1.Federation/Submit", Federation, Roles(TEAM), Scope::Team, true),
    r("/suanli.v1.Federation/Cancel", Federation, Roles(TEAM), Scope::Team, true),
    r("/suanli.v1.Federation/Sync", Federation, Server, Scope::None, true),
    r("/suanli.v1.Federation/Status", Federation, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Federation/Regions", Federation, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Federation/Jobs", Federation, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Federation/GetJob", Federation, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Federation/SetQuota", Federation, Roles(ADMIN), Scope::None, true),
    r("/suanli.v1.Federation/Cost", Federation, Roles(READERS), Scope::None, false),
    r("/suanli.v1.Federation/AddServer", Federation, Roles(ADMIN), Scope::None, true),
    r("/suanli.v1.Federation/RemoveServer", Federation, Roles(ADMIN), Scope::None, true),
    // A federation server's peer listener (its raft group uses RaftTransport, whose rules
    // above apply there as on a region's peer listener).
    r("/suanli.v1.FederationPeer/Propose", FederationPeer, Server, Scope::None, false),
];

/// Health checks, on every listener: anyone.
const HEALTH: Rule = r("/grpc.health.v1.Health/", Client, Anyone, Scope::None, false);
/// Server reflection (the API's schema), on the client listener: any user.
const REFLECTION: Rule = r("/grpc.reflection.", Client, Roles(READERS), Scope::None, false);

/// The rule for a gRPC path; `None` for an unknown method (denied).
pub fn rule(path: &str) -> Option<&'static Rule> {
    if path.starts_with(HEALTH.method) {
        return Some(&HEALTH);
    }
    if path.starts_with(REFLECTION.method) {
        return Some(&REFLECTION);
    }
    RULES.iter().find(|r| r.method == path)
}

/// What the layer does with a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Go on.
    Allow,
    /// Go on if the object the call is about belongs to this team (the caller is a member).
    AllowIfTeam(String),
    /// Go on if the call is about this node (the caller is its agent).
    AllowIfNode(String),
    /// No credential: `UNAUTHENTICATED`.
    Unauthenticated,
    /// `PERMISSION_DENIED`, with why.
    Deny(String),
}

/// Decides a call to `rule` by `who` (object checks, [`Decision::AllowIfTeam`] and
/// [`Decision::AllowIfNode`], are the caller's to make).
pub fn decide(rule: &Rule, who: &Principal) -> Decision {
    if matches!(who, Principal::Insecure) || rule.allow == Allow::Anyone {
        return Decision::Allow;
    }
    let m = rule.method;
    match (who, rule.allow) {
        (Principal::Anonymous, _) => Decision::Unauthenticated,
        // A server may call anything: it forwards calls its own listener already authorized
        // (an agent's heartbeat, a membership change reaching a follower), joins, and checks
        // its peers' membership on their client listeners; and it can propose to the raft log
        // in any case.
        (Principal::Server { .. }, _) => Decision::Allow,
        (Principal::Node { name }, Allow::Node) => match rule.scope {
            Scope::OwnNode => Decision::AllowIfNode(name.clone()),
            _ => Decision::Allow,
        },
        (Principal::User { role, team, .. }, Allow::Roles(roles)) if roles.contains(role) => match (rule.scope, role) {
            (Scope::Team, Role::Member) => match team {
                Some(t) => Decision::AllowIfTeam(t.clone()),
                None => Decision::Deny(format!("{who} has no team; {m} needs one")),
            },
            _ => Decision::Allow,
        },
        (_, Allow::Roles(roles)) => Decision::Deny(format!(
            "{who} may not call {m} (allowed: {})",
            roles.iter().map(|r| r.as_str()).collect::<Vec<_>>().join(", ")
        )),
        (_, Allow::Node) => Decision::Deny(format!("{who} may not call {m} (agents only)")),
        (_, Allow::Server) => Decision::Deny(format!("{who} may not call {m} (servers only)")),
        (_, Allow::Anyone) => Decision::Allow,
    }
}

/// The matrix as the markdown table docs/security.md holds: one row per method, one column per
/// caller kind.
pub fn markdown_table() -> String {
    let cols = ["admin", "operator", "member", "viewer", "node", "server", "anonymous"];
    let mut out = format!("| method | {} |\n|---|{}\n", cols.join(" | "), "---|".repeat(cols.len()));
    let mut rows: Vec<Rule> = RULES.to_vec();
    rows.push(HEALTH);
    rows.push(REFLECTION);
    for rule in rows {
        let cell = |who: &Principal| match decide(&rule, who) {
            Decision::Allow => "yes",
            Decision::AllowIfTeam(_) => "own team",
            Decision::AllowIfNode(_) => "own node",
            Decision::Unauthenticated | Decision::Deny(_) => "-",
        };
        let user = |role| Principal::User {
            name: "u".into(),
            role,
            team: Some("t".into()),
            credential: crate::principal::Credential::Certificate,
        };
        let cells = [
            cell(&user(Role::Admin)),
            cell(&user(Role::Operator)),
            cell(&user(Role::Member)),
            cell(&user(Role::Viewer)),
            cell(&Principal::Node { name: "n".into() }),
            cell(&Principal::Server { name: "s".into() }),
            cell(&Principal::Anonymous),
        ];
        let name = match rule.method {
            m if m == HEALTH.method => "`/grpc.health.v1.Health/*`".to_owned(),
            m if m == REFLECTION.method => "`/grpc.reflection.*`".to_owned(),
            m => format!("`{m}`"),
        };
        let star = if rule.mutating { " (audited)" } else { "" };
        out.push_str(&format!("| {name}{star} | {} |\n", cells.join(" | ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::principal::Credential;

    fn user(role: Role, team: Option<&str>) -> Principal {
        Principal::User { name: "u".into(), role, team: team.map(Into::into), credential: Credential::Certificate }
    }

    #[test]
    fn methods_are_unique_and_unknown_ones_have_no_rule() {
        let mut seen = std::collections::BTreeSet::new();
        for r in RULES {
            assert!(seen.insert(r.method), "{} twice", r.method);
        }
        assert!(rule("/suanli.v1.Jobs/Nope").is_none());
        assert_eq!(rule("/grpc.health.v1.Health/Check").map(|r| r.allow), Some(Allow::Anyone));
    }

    /// docs/security.md holds the matrix between these markers.
    const BEGIN: &str = "<!-- access-matrix:begin (policy::markdown_table; a test keeps it equal) -->\n";
    const END: &str = "<!-- access-matrix:end -->";

    #[test]
    fn docs_hold_the_matrix_as_the_code_decides_it() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/security.md");
        let doc = std::fs::read_to_string(path).expect("docs/security.md is readable");
        let start = doc.find(BEGIN).expect("docs/security.md has the begin marker") + BEGIN.len();
        let len = doc[start..].find(END).expect("docs/security.md has the end marker");
        let want = markdown_table();
        assert!(
            doc[start..start + len] == want,
            "docs/security.md's access matrix differs from the code; paste this between the markers:\n{want}"
        );
    }

    #[test]
    fn members_are_scoped_to_their_team_and_agents_to_their_node() {
        let submit = rule("/suanli.v1.Jobs/Submit").expect("rule");
        assert_eq!(decide(submit, &user(Role::Member, Some("nlp"))), Decision::AllowIfTeam("nlp".into()));
        assert_eq!(decide(submit, &user(Role::Admin, None)), Decision::Allow);
        assert!(matches!(decide(submit, &user(Role::Viewer, None)), Decision::Deny(_)));
        assert!(matches!(decide(submit, &Principal::Node { name: "n1".into() }), Decision::Deny(_)));
        assert_eq!(decide(submit, &Principal::Anonymous), Decision::Unauthenticated);
        let hb = rule("/suanli.v1.Agent/Heartbeat").expect("rule");
        assert_eq!(decide(hb, &Principal::Node { name: "n1".into() }), Decision::AllowIfNode("n1".into()));
        assert!(matches!(decide(hb, &user(Role::Admin, None)), Decision::Deny(_)));
        let vote = rule("/suanli.v1.RaftTransport/Vote").expect("rule");
        assert!(matches!(decide(vote, &user(Role::Admin, None)), Decision::Deny(_)));
        assert_eq!(decide(vote, &Principal::Server { name: "s".into() }), Decision::Allow);
        assert_eq!(decide(vote, &Principal::Insecure), Decision::Allow);
    }
}
