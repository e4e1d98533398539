//! Membership changes shared by every raft group (a region's servers, the federation): add a
//! server as a learner, wait for it to catch up, then make it a voter; remove one. Both groups'
//! `AddServer` / `RemoveServer` calls run these, so the safety rules live in one place:
//!
//! ```text
//!   add:    check id/addresses ─▶ add_learner (the current voters commit it alone)
//!             ─▶ wait until it holds the leader's last index (bounded) ─┬─ caught up ─▶ AddVoterIds
//!                                                                       └─ not ─▶ RemoveNodes, UNAVAILABLE
//!   remove: RemoveVoters (if a voter) ─▶ RemoveNodes
//! ```
//!
//! openraft allows one membership change at a time; a change that meets another in progress
//! waits for it (up to the caller's timeout) rather than failing.

use crate::{ServerNode, StoreConfig};
use openraft::error::{ChangeMembershipError, ClientWriteError, RaftError};
use openraft::impls::OneshotResponder;
use openraft::{ChangeMembers, Raft};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use tonic::Status;

/// Runs one membership change, waiting (up to `timeout`) while an earlier change is still being
/// committed: openraft allows one change at a time, and that is transient.
pub async fn change_membership<C: StoreConfig<Responder = OneshotResponder<C>>>(
    raft: &Raft<C>,
    change: ChangeMembers<u64, ServerNode>,
    timeout: Duration,
) -> Result<(), Status> {
    let deadline = Instant::now() + timeout;
    loop {
        match raft.change_membership(change.clone(), false).await {
            Ok(_) => return Ok(()),
            Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(ChangeMembershipError::InProgress(_))))
                if Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(membership_error(e)),
        }
    }
}

fn membership_error(e: impl std::fmt::Display) -> Status {
    Status::failed_precondition(format!("membership change: {e}"))
}

/// A `host:port` address field, bounded: the address trimmed, or INVALID_ARGUMENT naming `field`.
pub fn check_addr(field: &str, a: &str) -> Result<String, Status> {
    let a = a.trim();
    let ok = a.len() <= 253 + 6
        && a.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0))
        && a.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']' | '_'));
    if !ok {
        let mut end = a.len().min(64);
        while !a.is_char_boundary(end) {
            end -= 1;
        }
        let more = if end < a.len() { format!("…({} bytes)", a.len()) } else { String::new() };
        return Err(Status::invalid_argument(format!("{field}: {:?}{more} is not host:port", &a[..end])));
    }
    Ok(a.to_owned())
}

/// Adds a server without ever leaving the group unable to commit: first as a learner (a change
/// the current voters commit alone), then waits (up to `timeout` less 500 ms) until it has
/// caught up, and only then makes it a voter (unless `learner_only`). A learner that never
/// catches up (unreachable, wrong address, not started) is removed again, with an error saying
/// so; until then it holds no vote, so it blocks nothing. `remove_cmd` is the command that
/// removes a server by hand (named in that error). A retry of a completed add is a no-op; an id
/// or address already used by another member is ALREADY_EXISTS.
pub async fn add_server<C: StoreConfig<Responder = OneshotResponder<C>>>(
    raft: &Raft<C>,
    id: u64,
    node: ServerNode,
    learner_only: bool,
    timeout: Duration,
    remove_cmd: &str,
) -> Result<(), Status> {
    let membership = raft.metrics().borrow().membership_config.membership().clone();
    let voters: BTreeSet<u64> = membership.voter_ids().collect();
    let known = membership.get_node(&id).cloned();
    match &known {
        Some(n) if *n != node => {
            return Err(Status::already_exists(format!(
                "id: server {id} is already a member at {n}; remove it first, or give a new server a new id"
            )));
        }
        Some(_) if voters.contains(&id) || learner_only => return Ok(()), // a retry
        _ => {}
    }
    for (other, n) in membership.nodes().filter(|(other, _)| **other != id) {
        if n.addr == node.addr || n.client_addr() == node.client_addr() {
            return Err(Status::already_exists(format!(
                "addr: {node} is already used by server {other} ({n}); remove server {other} first, or give this server its own addresses"
            )));
        }
    }
    if known.is_none() {
        let deadline = Instant::now() + timeout;
        loop {
            match raft.add_learner(id, node.clone(), false).await {
                Ok(_) => break,
                Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(
                    ChangeMembershipError::InProgress(_),
                ))) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(e) => return Err(membership_error(e)),
            }
        }
    }
    // Caught up: the learner holds every entry the leader had when it was asked.
    let target = raft.metrics().borrow().last_log_index.unwrap_or(0);
    let catch_up = timeout.saturating_sub(Duration::from_millis(500)).max(Duration::from_millis(100));
    let mut rx = raft.metrics();
    let caught = matches!(
        tokio::time::timeout(
            catch_up,
            rx.wait_for(|m| {
                m.replication.as_ref().and_then(|r| r.get(&id).cloned().flatten()).is_some_and(|l| l.index >= target)
            }),
        )
        .await,
        Ok(Ok(_))
    );
    if !caught {
        let rm: BTreeSet<u64> = [id].into();
        let undone = change_membership(raft, ChangeMembers::RemoveNodes(rm), timeout).await;
        let what = match undone {
            Ok(()) => "it was removed again".to_owned(),
            Err(e) => format!("removing it again failed too ({}); `{remove_cmd} {id}` removes it", e.message()),
        };
        return Err(Status::unavailable(format!(
            "server {id} did not catch up within {} ms at peer address {} (is it running and reachable there?); {what}",
            catch_up.as_millis(),
            node.addr
        )));
    }
    if !learner_only {
        let add: BTreeSet<u64> = [id].into();
        change_membership(raft, ChangeMembers::AddVoterIds(add), timeout).await?;
    }
    Ok(())
}

/// Removes server `id`: first its vote (if it has one), then the server. NOT_FOUND for an
/// unknown id.
pub async fn remove_server<C: StoreConfig<Responder = OneshotResponder<C>>>(
    raft: &Raft<C>,
    id: u64,
    timeout: Duration,
) -> Result<(), Status> {
    let membership = raft.metrics().borrow().membership_config.membership().clone();
    if membership.get_node(&id).is_none() {
        return Err(Status::not_found(format!("id: unknown server {id}")));
    }
    if membership.voter_ids().any(|v| v == id) {
        let rm: BTreeSet<u64> = [id].into();
        change_membership(raft, ChangeMembers::RemoveVoters(rm), timeout).await?;
    }
    let rm: BTreeSet<u64> = [id].into();
    change_membership(raft, ChangeMembers::RemoveNodes(rm), timeout).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_host_and_port() {
        assert_eq!(check_addr("addr", " 127.0.0.1:7400 ").expect("ok"), "127.0.0.1:7400");
        assert_eq!(check_addr("addr", "[::1]:7400").expect("ok"), "[::1]:7400");
        for bad in ["", "host", ":7400", "h:0", "h:99999", "h:1 x", "h;rm:1"] {
            let e = check_addr("peer_addr", bad).expect_err(bad);
            assert!(e.message().starts_with("peer_addr: "), "{}", e.message());
        }
        let long = "h".repeat(100_000);
        assert!(check_addr("addr", &long).expect_err("long").message().len() < 120);
    }
}
