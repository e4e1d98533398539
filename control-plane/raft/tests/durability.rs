//! A single node: writes survive a restart, snapshots bound the log, oversize writes are
//! refused before they reach the log.

mod common;

use common::*;
use suanli_raft::{WriteError, linearizable_read, write};
use suanli_state::{Command, CommandError, Response, StateConfig, UpdateConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_survive_a_restart_and_snapshots_purge_the_log() -> anyhow::Result<()> {
    let settings =
        suanli_raft::RaftSettings { snapshot_after_entries: 20, keep_entries_after_snapshot: 0, ..settings() };
    let mut n = TestNode::start(1, &settings).await?;
    n.raft.initialize(members(&[&n])).await?;
    n.raft.wait(WAIT).current_leader(1, "single node leads").await?;

    write(&n.raft, &n.state, queue_cmd()).await?;
    write(&n.raft, &n.state, node_cmd()).await?;
    for i in 0..40 {
        let (r, _) = write(&n.raft, &n.state, submit_cmd(i)).await?;
        assert!(matches!(r, Response::JobSubmitted { created: true, .. }), "{r:?}");
    }
    // A retried submission after "a timeout" is answered with the first job.
    let (r, _) = write(&n.raft, &n.state, submit_cmd(7)).await?;
    assert!(matches!(r, Response::JobSubmitted { created: false, .. }), "{r:?}");

    // The log was snapshotted and purged behind the snapshot.
    let m = n.raft.wait(WAIT).metrics(|m| m.snapshot.is_some() && m.purged.is_some(), "snapshot and purge").await?;
    assert!(m.purged.map_or(0, |p| p.index) >= 20, "purged up to {:?}", m.purged);

    let before = linearizable_read(&n.raft, &n.state, |s| (s.state_hash(), s.jobs().len())).await?;
    assert_eq!(before.1, 40);
    let dir = {
        n.stop().await?;
        n.state.closed().await;
        let TestNode { dir, .. } = n;
        dir
    };

    // Restart on the same directory: snapshot + the log after it give the same state.
    let n = TestNode::start_in(1, dir, &settings).await?;
    n.raft.wait(WAIT).current_leader(1, "leads again after restart").await?;
    let after = linearizable_read(&n.raft, &n.state, |s| (s.state_hash(), s.jobs().len())).await?;
    assert_eq!(after, before, "state after restart equals state before");
    let (r, _) = write(&n.raft, &n.state, submit_cmd(40)).await?;
    assert!(matches!(r, Response::JobSubmitted { created: true, .. }), "{r:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_commands_are_refused_before_the_log() -> anyhow::Result<()> {
    let n = TestNode::start(1, &settings()).await?;
    n.raft.initialize(members(&[&n])).await?;
    n.raft.wait(WAIT).current_leader(1, "leader").await?;
    let cfg = StateConfig { max_command_bytes: 1000, ..StateConfig::default() };
    write(&n.raft, &n.state, Command::UpdateConfig(Box::new(UpdateConfig { config: cfg }))).await?;
    write(&n.raft, &n.state, queue_cmd()).await?;
    let last = n.state.applied_index();
    let big = {
        let mut c = submit_cmd(1);
        if let Command::SubmitJob(s) = &mut c {
            s.spec.name = "x".repeat(1000);
        }
        c
    };
    match write(&n.raft, &n.state, big).await {
        Err(WriteError::Refused(CommandError::TooLarge { limit: 1000, .. })) => {}
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(n.state.applied_index(), last, "nothing reached the log");
    // A committed but refused command leaves the state unchanged and says why.
    let hash = n.state.read(|s| s.state_hash());
    let (r, _) = write(
        &n.raft,
        &n.state,
        Command::CancelJob(suanli_state::CancelJob { job: suanli_model::JobId(9), reason: String::new(), now: 1 }),
    )
    .await?;
    assert!(matches!(r, Response::Rejected(CommandError::UnknownJob { job: 9 })), "{r:?}");
    assert_eq!(n.state.read(|s| s.state_hash()), hash);
    Ok(())
}
