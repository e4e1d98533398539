//! The federation's state machine: every refusal with its message, leases renewed and refused,
//! expiry at exactly `lease_until + margin`, checkpoints carried into the next assignment,
//! quota races, snapshots, and the invariants after every command of a random sequence.

use std::collections::BTreeMap;
use suanli_federation::dispatch::{Decision, dispatch, view_of};
use suanli_federation::{
    CapacityEntry, CheckpointRef, FedCommand, FedConfig, FedJobState, FedResponse, FedState, HeldJob, RegionSync,
    SyncAnswer, TeamUsage,
};
use suanli_model::job::{CheckpointPolicy, Constraints, DeviceRequest, JobKind, TaskGroup, TaskResources};
use suanli_model::{DeviceKind, JobSpec, QueueId};

fn cfg() -> FedConfig {
    FedConfig {
        lease_ms: 15_000,
        sync_interval_ms: 3_000,
        max_clock_drift_ms: 500,
        redispatch_margin_ms: 2_000,
        region_unhealthy_after_ms: 9_000,
        ..FedConfig::default()
    }
}

fn spec(gpus: u32, replicas: u32) -> JobSpec {
    JobSpec {
        name: "train".into(),
        queue: QueueId::from("team-a"),
        kind: JobKind::Training,
        priority: 0,
        preemptible: true,
        gang: true,
        groups: vec![TaskGroup {
            name: "worker".into(),
            replicas,
            min_replicas: None,
            resources: TaskResources {
                cpu_milli: 1000,
                memory_mib: 1024,
                devices: (gpus > 0).then_some(DeviceRequest {
                    kind: DeviceKind::Gpu,
                    count: gpus,
                    milli: 1000,
                    memory_mib: 0,
                }),
            },
            task: None,
        }],
        constraints: Constraints::default(),
        runtime_estimate_s: None,
        checkpoint: None,
        service: None,
    }
}

fn submit(id: &str, spec: JobSpec, now: u64) -> FedCommand {
    FedCommand::Submit {
        client_request_id: id.into(),
        spec: Box::new(spec),
        team: "team-a".into(),
        submitted_by: "user alice".into(),
        data_labels: BTreeMap::new(),
        now_ms: now,
        trace: None,
    }
}

fn region_sync(name: &str, pool: &str, free_gpus: u64) -> RegionSync {
    RegionSync {
        region: name.into(),
        endpoints: vec![format!("https://{name}:7000")],
        labels: BTreeMap::new(),
        pools: vec![pool.into()],
        capacity: vec![CapacityEntry {
            pool: pool.into(),
            device_kind: "gpu".into(),
            device_model: "H100".into(),
            total_milli: 64_000,
            free_milli: free_gpus * 1000,
            max_node_free_milli: (free_gpus * 1000).min(8000),
            free_cpu_milli: 256_000,
            free_memory_mib: 1 << 20,
            price_micros_per_device_hour: 2_000_000,
        }],
        backlog: 0,
        usage: Vec::new(),
        held: Vec::new(),
        sent_at_ms: 0,
        cost: None,
        quota_leases: Vec::new(),
    }
}

fn held(id: &str, epoch: u64, status: &str) -> HeldJob {
    HeldJob { global_id: id.into(), epoch, status: status.into(), ..HeldJob::default() }
}

fn init() -> FedState {
    let mut s = FedState::default();
    assert_eq!(s.apply(FedCommand::Init { config: cfg() }), FedResponse::Done);
    s
}

fn apply_ok(s: &mut FedState, cmd: FedCommand) -> FedResponse {
    let r = s.apply(cmd);
    assert!(!matches!(r, FedResponse::Rejected { .. }), "unexpected refusal: {r:?}");
    s.invariants().expect("invariants");
    r
}

fn sync(s: &mut FedState, sync: RegionSync, now: u64) -> SyncAnswer {
    match apply_ok(s, FedCommand::Sync { sync: Box::new(sync), now_ms: now }) {
        FedResponse::Synced(a) => *a,
        other => panic!("not synced: {other:?}"),
    }
}

fn rejected(s: &mut FedState, cmd: FedCommand) -> (String, String) {
    let before = s.clone();
    match s.apply(cmd) {
        FedResponse::Rejected { field, message } => {
            assert_eq!(*s, before, "a refusal changed the state");
            (field, message)
        }
        other => panic!("not refused: {other:?}"),
    }
}

/// Jobs with their region (placed) or with why (refused).
type Outcome = (Vec<(String, String)>, Vec<(String, String)>);

fn run_dispatch(s: &mut FedState, now: u64) -> Outcome {
    let decisions = dispatch(&view_of(s, now), 7);
    match apply_ok(s, FedCommand::Dispatch { decisions, now_ms: now }) {
        FedResponse::Dispatched { placed, refused } => (placed, refused),
        other => panic!("{other:?}"),
    }
}

#[test]
fn config_validation_names_the_field_and_limit() {
    let mut c = cfg();
    c.sync_interval_ms = 5_001;
    assert_eq!(
        c.validate().expect_err("sync"),
        "sync_interval_ms: 5001, a region must renew at least three times per lease; must be at most lease_ms / 3 = 5000"
    );
    let mut c = cfg();
    c.redispatch_margin_ms = 999;
    assert!(c.validate().expect_err("margin").starts_with("redispatch_margin_ms: 999,"));
    let mut c = cfg();
    c.region_unhealthy_after_ms = 5_999;
    assert!(c.validate().expect_err("unhealthy").starts_with("region_unhealthy_after_ms: 5999,"));
    let mut c = cfg();
    c.max_quotas = 0;
    assert!(c.validate().expect_err("zero").starts_with("max_quotas: 0,"));
    assert!(FedConfig::default().validate().is_ok());

    let mut s = init();
    let mut bad = cfg();
    bad.redispatch_margin_ms = 10;
    let (field, _) = rejected(&mut s, FedCommand::SetConfig { config: bad.clone() });
    assert_eq!(field, "config.redispatch_margin_ms");
    // Init: the first one wins.
    let mut other = cfg();
    other.lease_ms = 30_000;
    assert_eq!(s.apply(FedCommand::Init { config: other }), FedResponse::Done);
    assert_eq!(s.config().lease_ms, 15_000);
}

#[test]
fn submit_refusals_and_idempotence() {
    let mut s = init();
    assert_eq!(
        apply_ok(&mut s, submit("r1", spec(8, 2), 10)),
        FedResponse::Submitted { id: "g-1".into(), created: true }
    );
    assert_eq!(
        apply_ok(&mut s, submit("r1", spec(8, 2), 11)),
        FedResponse::Submitted { id: "g-1".into(), created: false }
    );
    assert_eq!(s.job("g-1").map(|j| j.demand_milli), Some(16_000));
    assert_eq!(
        apply_ok(&mut s, submit("r2", spec(1, 1), 12)),
        FedResponse::Submitted { id: "g-2".into(), created: true }
    );

    let mut bad = spec(1, 1);
    bad.groups[0].replicas = 0;
    assert_eq!(rejected(&mut s, submit("r3", bad, 13)).0, "spec.groups[0].replicas");

    let mut two_kinds = spec(1, 1);
    let mut g = two_kinds.groups[0].clone();
    g.name = "npu".into();
    g.resources.devices = Some(DeviceRequest { kind: DeviceKind::Npu, count: 1, milli: 1000, memory_mib: 0 });
    two_kinds.groups.push(g);
    let (field, message) = rejected(&mut s, submit("r4", two_kinds, 13));
    assert_eq!(field, "spec.groups[1].resources.devices.kind");
    assert!(message.contains("one device kind"), "{message}");

    let mut long_grace = spec(1, 1);
    long_grace.checkpoint =
        Some(CheckpointPolicy { interval_s: 60, grace_s: 8, restore_s: 0, signal: Default::default() });
    let (field, message) = rejected(&mut s, submit("r5", long_grace.clone(), 13));
    assert_eq!(field, "spec.checkpoint.grace_s");
    assert!(message.contains("must be under lease_ms 15000"), "{message}");
    // 500 + 7000 + 1000 + 6000 = 14500 < 15000: fits.
    long_grace.checkpoint =
        Some(CheckpointPolicy { interval_s: 60, grace_s: 7, restore_s: 0, signal: Default::default() });
    apply_ok(&mut s, submit("r5", long_grace, 13));

    let mut no_team = submit("r6", spec(1, 1), 14);
    if let FedCommand::Submit { team, .. } = &mut no_team {
        team.clear();
    }
    assert_eq!(rejected(&mut s, no_team).0, "team");

    let mut small = cfg();
    small.max_jobs = 3;
    apply_ok(&mut s, FedCommand::SetConfig { config: small });
    let (field, message) = rejected(&mut s, submit("r7", spec(1, 1), 15));
    assert_eq!(field, "jobs");
    assert!(message.contains("max_jobs 3"), "{message}");
}

#[test]
fn quota_and_cancel() {
    let mut s = init();
    let mut small = cfg();
    small.max_quotas = 1;
    apply_ok(&mut s, FedCommand::SetConfig { config: small });
    apply_ok(&mut s, FedCommand::SetQuota { team: "team-a".into(), device_model: "H100".into(), limit_milli: 8000 });
    let (field, message) = rejected(
        &mut s,
        FedCommand::SetQuota { team: "team-b".into(), device_model: "H100".into(), limit_milli: 8000 },
    );
    assert_eq!(field, "quotas");
    assert!(message.contains("max_quotas 1"), "{message}");
    apply_ok(&mut s, FedCommand::SetQuota { team: "team-a".into(), device_model: "H100".into(), limit_milli: 0 });
    assert!(s.quotas.is_empty());

    apply_ok(&mut s, submit("r1", spec(1, 1), 10));
    let before = s.clone();
    match s.apply(FedCommand::Cancel { id: "g-9".into(), now_ms: 11 }) {
        FedResponse::NotFound { field, message } => {
            assert_eq!(field, "id");
            assert!(message.contains("g-9"), "{message}");
        }
        other => panic!("an unknown job's cancel: {other:?}"),
    }
    assert_eq!(s, before, "a refused cancel changed the state");
    apply_ok(&mut s, FedCommand::Cancel { id: "g-1".into(), now_ms: 11 });
    assert_eq!(s.job("g-1").map(|j| j.state), Some(FedJobState::Cancelled));
}

#[test]
fn sync_refusals_name_the_pool_and_limit() {
    let mut s = init();
    sync(&mut s, region_sync("us-east", "pool-a", 8), 1_000);
    let (field, message) =
        rejected(&mut s, FedCommand::Sync { sync: Box::new(region_sync("eu-west", "pool-a", 8)), now_ms: 1_001 });
    assert_eq!(field, "sync.pools[0]");
    assert_eq!(message, "pool pool-a is owned by region us-east, not eu-west");

    let mut stray = region_sync("eu-west", "pool-b", 8);
    stray.capacity[0].pool = "pool-c".into();
    let (field, message) = rejected(&mut s, FedCommand::Sync { sync: Box::new(stray), now_ms: 1_002 });
    assert_eq!(field, "sync.capacity[0].pool");
    assert_eq!(message, "region eu-west does not own pool pool-c");

    let mut small = cfg();
    small.max_capacity_entries = 1;
    small.max_regions = 1;
    apply_ok(&mut s, FedCommand::SetConfig { config: small });
    let mut many = region_sync("us-east", "pool-a", 8);
    many.capacity.push(many.capacity[0].clone());
    let (field, message) = rejected(&mut s, FedCommand::Sync { sync: Box::new(many), now_ms: 1_003 });
    assert_eq!(field, "sync.capacity");
    assert!(message.contains("max_capacity_entries"), "{message}");
    let (field, message) =
        rejected(&mut s, FedCommand::Sync { sync: Box::new(region_sync("eu-west", "pool-b", 8)), now_ms: 1_004 });
    assert_eq!(field, "sync.region");
    assert!(message.contains("max_regions 1"), "{message}");

    let mut bad_status = region_sync("us-east", "pool-a", 8);
    bad_status.held.push(held("g-1", 1, "sleeping"));
    assert_eq!(
        rejected(&mut s, FedCommand::Sync { sync: Box::new(bad_status), now_ms: 1_005 }).0,
        "sync.held[0].status"
    );
}

#[test]
fn dispatch_renew_refuse_expire_and_restore() {
    let mut s = init();
    sync(&mut s, region_sync("us-east", "pool-a", 16), 1_000);
    sync(&mut s, region_sync("eu-west", "pool-b", 4), 1_000);
    let mut sp = spec(8, 1);
    sp.checkpoint = Some(CheckpointPolicy { interval_s: 60, grace_s: 2, restore_s: 0, signal: Default::default() });
    apply_ok(&mut s, submit("r1", sp, 1_000));
    let (placed, refused) = run_dispatch(&mut s, 2_000);
    assert_eq!(placed, vec![("g-1".to_owned(), "us-east".to_owned())]);
    assert!(refused.is_empty());
    let j = s.job("g-1").expect("job");
    assert_eq!((j.state, j.epoch, j.lease_until_ms), (FedJobState::Assigned, 1, 17_000));

    // The region's next sync gets the assignment; eu-west gets nothing.
    let a = sync(&mut s, region_sync("us-east", "pool-a", 16), 3_000);
    assert_eq!(a.assignments.len(), 1);
    assert_eq!((a.assignments[0].global_id.as_str(), a.assignments[0].epoch), ("g-1", 1));
    assert!(sync(&mut s, region_sync("eu-west", "pool-b", 4), 3_000).assignments.is_empty());

    // Running with a checkpoint: renewed, no assignment repeated.
    let mut report = region_sync("us-east", "pool-a", 8);
    let mut h = held("g-1", 1, "running");
    h.checkpoint = Some(CheckpointRef { uri: "s3://ck/100".into(), step: 100, ..CheckpointRef::default() });
    report.held.push(h);
    let a = sync(&mut s, report.clone(), 6_000);
    assert!(a.assignments.is_empty());
    assert_eq!(a.leases.len(), 1);
    assert_eq!(a.leases[0].until_ms, 21_000);
    assert_eq!(s.job("g-1").map(|j| j.state), Some(FedJobState::Running));

    // An older checkpoint does not replace a newer one.
    report.held[0].checkpoint = Some(CheckpointRef { uri: "s3://ck/50".into(), step: 50, ..CheckpointRef::default() });
    sync(&mut s, report.clone(), 7_000);
    assert_eq!(s.job("g-1").and_then(|j| j.checkpoint.as_ref()).map(|c| c.step), Some(100));

    // eu-west claims it: refused, not held by it.
    let mut claim = region_sync("eu-west", "pool-b", 4);
    claim.held.push(held("g-1", 1, "running"));
    let a = sync(&mut s, claim, 7_000);
    assert_eq!(a.refused[0].reason, "g-1 is not held by eu-west: us-east holds it");
    let mut unknown = region_sync("eu-west", "pool-b", 4);
    unknown.held.push(held("g-9", 1, "running"));
    assert!(sync(&mut s, unknown, 7_000).refused[0].reason.contains("g-9"));

    // Lease until 22_000 (renewed at 7_000). Expire exactly at 24_000, not 1 ms before.
    assert_eq!(s.job("g-1").map(|j| j.lease_until_ms), Some(22_000));
    match apply_ok(&mut s, FedCommand::Expire { now_ms: 23_999 }) {
        FedResponse::Expired { jobs } => assert!(jobs.is_empty()),
        other => panic!("{other:?}"),
    }
    // A renewal after the lease ended is refused.
    let a = sync(&mut s, report.clone(), 22_000);
    assert_eq!(a.refused[0].reason, "lease of g-1 ended at 22000");
    match apply_ok(&mut s, FedCommand::Expire { now_ms: 24_000 }) {
        FedResponse::Expired { jobs } => assert_eq!(jobs, vec!["g-1".to_owned()]),
        other => panic!("{other:?}"),
    }
    let j = s.job("g-1").expect("job");
    assert_eq!(j.state, FedJobState::Pending);
    assert_eq!(j.reason, "lease of us-east expired at 22000; re-dispatching from checkpoint step 100");
    assert_eq!(j.history[0].end, "lease_expired");

    // us-east is now unhealthy (last sync 22_000 + 9_000 < 31_001): goes to eu-west at epoch 2.
    sync(&mut s, region_sync("eu-west", "pool-b", 16), 31_000);
    let (placed, _) = run_dispatch(&mut s, 31_001);
    assert_eq!(placed, vec![("g-1".to_owned(), "eu-west".to_owned())]);
    let a = sync(&mut s, region_sync("eu-west", "pool-b", 16), 32_000);
    assert_eq!(a.assignments[0].epoch, 2);
    assert_eq!(a.assignments[0].restore.as_ref().map(|c| c.step), Some(100));

    // The old holder's stale report is refused with what is true.
    let a = sync(&mut s, report, 32_001);
    assert_eq!(a.refused[0].reason, "stale epoch 1: g-1 runs at epoch 2 in eu-west");

    // Cancel while held: the region is told; it reports cancelled; the job ends.
    apply_ok(&mut s, FedCommand::Cancel { id: "g-1".into(), now_ms: 33_000 });
    let a = sync(&mut s, region_sync("eu-west", "pool-b", 16), 33_001);
    assert_eq!(a.cancel, vec!["g-1".to_owned()]);
    let mut done = region_sync("eu-west", "pool-b", 16);
    done.held.push(held("g-1", 2, "cancelled"));
    sync(&mut s, done, 34_000);
    let j = s.job("g-1").expect("job");
    assert_eq!(j.state, FedJobState::Cancelled);
    assert_eq!(j.history[1].end, "cancelled");
}

#[test]
fn two_jobs_racing_for_one_quota_only_one_placed() {
    let mut s = init();
    sync(&mut s, region_sync("us-east", "pool-a", 32), 1_000);
    apply_ok(&mut s, FedCommand::SetQuota { team: "team-a".into(), device_model: "H100".into(), limit_milli: 8_000 });
    apply_ok(&mut s, submit("r1", spec(8, 1), 1_000));
    apply_ok(&mut s, submit("r2", spec(8, 1), 1_001));
    // Both decided on the same stale view, as two leaders' passes would be.
    let view = view_of(&s, 2_000);
    let mut decisions = Vec::new();
    for id in ["g-1", "g-2"] {
        let mut v = view.clone();
        v.pending.retain(|p| p.id == id);
        decisions.extend(dispatch(&v, 1));
    }
    assert!(decisions.iter().all(|d| matches!(d, Decision::Place { .. })));
    match apply_ok(&mut s, FedCommand::Dispatch { decisions, now_ms: 2_000 }) {
        FedResponse::Dispatched { placed, refused } => {
            assert_eq!(placed.len(), 1);
            assert_eq!(refused.len(), 1);
            assert!(refused[0].1.contains("quota"), "{}", refused[0].1);
        }
        other => panic!("{other:?}"),
    }
    // And dispatch itself holds the second job, naming the quota.
    let decisions = dispatch(&view_of(&s, 2_001), 1);
    match &decisions[..] {
        [Decision::Hold { reason, .. }] => {
            assert_eq!(reason, "no region has 8 free gpu: us-east 24 H100 (quota 0 left)")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn snapshot_round_trip() {
    let mut s = init();
    sync(&mut s, region_sync("us-east", "pool-a", 32), 1_000);
    apply_ok(&mut s, submit("r1", spec(8, 1), 1_000));
    run_dispatch(&mut s, 2_000);
    let bytes = s.snapshot().expect("snapshot");
    assert_eq!(FedState::restore(&bytes).expect("restore"), s);
}

/// A tiny deterministic generator for the random sequence.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n.max(1)
    }
}

#[test]
fn invariants_hold_after_every_command_of_a_random_sequence() {
    for seed in 0..20u64 {
        let mut rng = Rng(seed);
        let mut s = init();
        let mut small = cfg();
        small.max_ended_jobs = 3;
        small.max_history = 2;
        s.apply(FedCommand::SetConfig { config: small });
        let regions = ["us-east", "eu-west", "ap-south"];
        let mut now = 1_000u64;
        for step in 0..300 {
            now += rng.below(4_000);
            let cmd = match rng.below(6) {
                0 => submit(&format!("r{}", rng.below(40)), spec(rng.below(5) as u32, 1 + rng.below(2) as u32), now),
                1 => FedCommand::Cancel { id: format!("g-{}", 1 + rng.below(40)), now_ms: now },
                2 => FedCommand::SetQuota {
                    team: "team-a".into(),
                    device_model: "H100".into(),
                    limit_milli: 1000 * rng.below(20),
                },
                3 => {
                    let i = rng.below(3) as usize;
                    let mut r = region_sync(regions[i], &format!("pool-{i}"), rng.below(20));
                    r.usage.push(TeamUsage {
                        team: "team-a".into(),
                        device_model: "H100".into(),
                        used_milli: 1000 * rng.below(3),
                        device_milli_s: 10,
                        wanted_milli: 1000 * rng.below(4),
                        min_pending_milli: 1000,
                    });
                    for (n, j) in &s.jobs {
                        if rng.below(2) == 0 {
                            let status = ["assigned", "running", "succeeded", "failed", "lost"][rng.below(5) as usize];
                            let epoch = j.epoch.saturating_sub(rng.below(2));
                            r.held.push(held(&format!("g-{n}"), epoch, status));
                        }
                    }
                    FedCommand::Sync { sync: Box::new(r), now_ms: now }
                }
                4 => FedCommand::Dispatch { decisions: dispatch(&view_of(&s, now), seed), now_ms: now },
                _ => FedCommand::Expire { now_ms: now },
            };
            let kind = cmd.kind();
            s.apply(cmd);
            if let Err(e) = s.invariants() {
                panic!("seed {seed} step {step} ({kind}): {e}");
            }
            let ended = s.jobs.values().filter(|j| j.state.is_terminal()).count();
            assert!(ended <= 3, "seed {seed} step {step}: {ended} ended jobs kept");
        }
    }
}

/// Each region's cost totals are kept from its latest sync that carried them; `Federation.Cost`
/// sums them by team (exactly, in base units, conserving capacity) or lists them by region, and
/// refuses to add amounts in different currencies.
#[test]
fn cost_totals_roll_up_by_team_and_region() {
    use suanli_federation::service::cost_report;
    use suanli_federation::{Base, RegionCost};
    let mut s = init();
    let cost = |currency: &str, teams: &[(&str, [i128; 5])]| RegionCost {
        currency: currency.into(),
        until: 100,
        capacity: Base(teams.iter().flat_map(|(_, a)| a.iter()).sum()),
        teams: teams.iter().map(|(t, a)| ((*t).to_owned(), a.map(Base))).collect(),
    };
    let mut eu = region_sync("eu-west", "eu-gpu", 8);
    eu.cost = Some(cost("USD", &[("vision", [700, 200, 0, 50, 0]), ("(idle)", [0, 0, 0, 0, 1_000])]));
    sync(&mut s, eu.clone(), 1_000);
    let mut us = region_sync("us-east", "us-gpu", 8);
    us.cost =
        Some(cost("USD", &[("vision", [300, 0, 100, 0, 0]), ("nlp", [5, 0, 0, 0, 0]), ("(idle)", [0, 0, 0, 0, 7])]));
    sync(&mut s, us.clone(), 1_000);

    let r = cost_report(&s, "team").expect("by team");
    let row = |k: &str| r.rows.iter().find(|x| x.key == k).unwrap_or_else(|| panic!("{k} in {r:#?}")).clone();
    let vision = row("vision").base.expect("base");
    assert_eq!((vision.useful.as_str(), vision.lost_preemption.as_str()), ("1000", "200"));
    assert_eq!((vision.lost_failure.as_str(), vision.running.as_str(), vision.total.as_str()), ("100", "50", "1350"));
    assert_eq!(row("(idle)").base.expect("base").idle, "1007");
    assert_eq!(r.capacity_base, "2362");
    assert!(r.conserved, "{r:#?}");
    assert_eq!(r.currency, "USD");
    let r = cost_report(&s, "region").expect("by region");
    let keys: Vec<&str> = r.rows.iter().map(|x| x.key.as_str()).collect();
    assert_eq!(keys, ["eu-west", "us-east"]);
    assert_eq!(r.rows[0].base.as_ref().expect("base").total, "1950");

    // A sync without totals keeps the last ones; one with new totals replaces them.
    let mut bare = eu.clone();
    bare.cost = None;
    sync(&mut s, bare, 2_000);
    assert_eq!(cost_report(&s, "team").expect("by team").capacity_base, "2362");
    // Another currency: no sum by team, the regions listed instead.
    us.cost = Some(cost("EUR", &[("vision", [1, 0, 0, 0, 0])]));
    sync(&mut s, us, 3_000);
    let e = cost_report(&s, "team").expect_err("mixed currencies");
    assert!(e.message().contains("eu-west: USD") && e.message().contains("us-east: EUR"), "{e:?}");
    assert!(cost_report(&s, "region").is_ok());
    assert!(cost_report(&s, "color").expect_err("bad by").message().contains("team or region"));

    // Too many rows, or an empty team name: refused with the field, nothing changed.
    let mut many = region_sync("eu-west", "eu-gpu", 8);
    let rows: Vec<(String, [Base; 5])> =
        (0..=cfg().max_held_per_sync).map(|i| (format!("t{i}"), [1, 0, 0, 0, 0].map(Base))).collect();
    many.cost =
        Some(RegionCost { currency: "USD".into(), until: 1, capacity: Base(0), teams: rows.into_iter().collect() });
    let (field, _) = rejected(&mut s, FedCommand::Sync { sync: Box::new(many), now_ms: 4_000 });
    assert_eq!(field, "sync.cost.teams");

    // The command, as the log carries it (internally tagged JSON), decodes back: amounts are
    // strings there (no 128-bit integers in serde's buffered content).
    let mut big = region_sync("eu-west", "eu-gpu", 8);
    big.cost = Some(cost("USD", &[("vision", [i128::MAX / 4, 0, 0, 0, 1])]));
    let cmd = FedCommand::Sync { sync: Box::new(big), now_ms: 5_000 };
    let json = serde_json::to_vec(&cmd).expect("encodes");
    let back: FedCommand = serde_json::from_slice(&json).expect("decodes");
    assert_eq!(back, cmd);
}
