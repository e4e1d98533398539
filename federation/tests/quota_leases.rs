//! Quota leases (docs/federation.md, "Global quotas and quota leases"): regions are leased
//! their fair share of a team's worldwide quota by their wants; a smaller lease does not free
//! the larger one until the region reports the new one or the old one ends; a region that stops
//! syncing keeps its lease counted until its end + the margin; dispatch counts the leases; and,
//! over random sequences of syncs with regions that use what their lease allows and sometimes
//! miss an answer, what the regions may use plus the federated jobs never exceeds the quota.

use proptest::prelude::*;
use std::collections::BTreeMap;
use suanli_federation::dispatch::{Decision, dispatch, view_of};
use suanli_federation::quota::{QuotaIndex, held_by_quota, region_reserved, reserved};
use suanli_federation::{
    CapacityEntry, FedCommand, FedConfig, FedResponse, FedState, QuotaLease, RegionSync, SyncAnswer, TeamUsage,
};
use suanli_model::job::{Constraints, DeviceRequest, JobKind, TaskGroup, TaskResources};
use suanli_model::{DeviceKind, JobSpec, QueueId};

const LEASE_MS: u64 = 15_000;
const MARGIN_MS: u64 = 2_000;
const DRIFT_MS: u64 = 500;

fn init(limit_milli: u64) -> FedState {
    let mut s = FedState::default();
    let cfg = FedConfig {
        lease_ms: LEASE_MS,
        sync_interval_ms: 3_000,
        max_clock_drift_ms: DRIFT_MS,
        redispatch_margin_ms: MARGIN_MS,
        region_unhealthy_after_ms: 9_000,
        ..FedConfig::default()
    };
    assert_eq!(s.apply(FedCommand::Init { config: cfg }), FedResponse::Done);
    let q = FedCommand::SetQuota { team: "team-a".into(), device_model: "H100".into(), limit_milli };
    assert_eq!(s.apply(q), FedResponse::Done);
    s
}

fn region(name: &str, used: u64, wanted: u64, enforcing: Option<&QuotaLease>) -> RegionSync {
    let pool = format!("{name}-gpu");
    RegionSync {
        region: name.into(),
        endpoints: vec![format!("https://{name}:7000")],
        pools: vec![pool.clone()],
        capacity: vec![CapacityEntry {
            pool,
            device_kind: "gpu".into(),
            device_model: "H100".into(),
            total_milli: 64_000,
            free_milli: 32_000,
            max_node_free_milli: 8_000,
            free_cpu_milli: 256_000,
            free_memory_mib: 1 << 20,
            price_micros_per_device_hour: 0,
        }],
        usage: vec![TeamUsage {
            team: "team-a".into(),
            device_model: "H100".into(),
            used_milli: used,
            device_milli_s: 0,
            wanted_milli: wanted,
            min_pending_milli: if wanted > used { 1000 } else { 0 },
        }],
        quota_leases: enforcing.cloned().into_iter().collect(),
        ..RegionSync::default()
    }
}

fn sync(s: &mut FedState, r: RegionSync, now_ms: u64) -> QuotaLease {
    match s.apply(FedCommand::Sync { sync: Box::new(r), now_ms }) {
        FedResponse::Synced(a) => {
            s.invariants().expect("invariants");
            let SyncAnswer { quota_leases, .. } = *a;
            assert_eq!(quota_leases.len(), 1, "one lease per quota");
            quota_leases.into_iter().next().expect("a lease")
        }
        other => panic!("not synced: {other:?}"),
    }
}

fn taken(s: &FedState, now_ms: u64) -> u64 {
    let held = held_by_quota(s).get(&("team-a".to_owned(), "H100".to_owned())).copied().unwrap_or(0);
    reserved(s, held, "team-a", "H100", now_ms)
}

fn gpu_job(gpus: u32) -> JobSpec {
    JobSpec {
        name: "train".into(),
        queue: QueueId::from("team-a"),
        kind: JobKind::Training,
        priority: 0,
        preemptible: true,
        gang: true,
        groups: vec![TaskGroup {
            name: "worker".into(),
            replicas: 1,
            min_replicas: None,
            resources: TaskResources {
                cpu_milli: 1000,
                memory_mib: 1024,
                devices: Some(DeviceRequest { kind: DeviceKind::Gpu, count: gpus, milli: 1000, memory_mib: 0 }),
            },
            task: None,
        }],
        constraints: Constraints::default(),
        runtime_estimate_s: None,
        checkpoint: None,
        service: None,
    }
}

#[test]
fn wants_are_shared_fairly_and_a_smaller_lease_frees_only_once_reported() {
    let mut s = init(4_000);
    let mut now = 10_000;
    // East wants 3 GPUs (1 in use), west 2: fair shares of 4 are 2 and 2.
    let east = sync(&mut s, region("east", 1_000, 3_000, None), now);
    assert_eq!(east.limit_milli, 3_000, "west has not asked yet: east gets its want");
    let west = sync(&mut s, region("west", 0, 2_000, None), now);
    assert_eq!(west.limit_milli, 1_000, "east's lease of 3 is counted until it reports a smaller one");
    now += 3_000;
    let east = sync(&mut s, region("east", 1_000, 3_000, Some(&east)), now);
    assert_eq!(east.limit_milli, 2_000, "the fair share");
    assert_eq!(taken(&s, now), 4_000, "east's earlier 3 still counted with west's 1");
    let west = sync(&mut s, region("west", 0, 2_000, Some(&west)), now);
    assert_eq!(west.limit_milli, 1_000, "east has not yet reported enforcing 2");
    now += 3_000;
    let east = sync(&mut s, region("east", 1_000, 3_000, Some(&east)), now);
    assert_eq!(east.limit_milli, 2_000);
    let west = sync(&mut s, region("west", 0, 2_000, Some(&west)), now);
    assert_eq!(west.limit_milli, 2_000, "east reported enforcing 2: west gets its fair share");
    assert_eq!(taken(&s, now), 4_000);

    // West stops syncing. Its lease stays counted until its end + the margin; then only its
    // last reported use is.
    let ends = west.until_ms;
    now = ends + MARGIN_MS - 1;
    let east2 = sync(&mut s, region("east", 2_000, 4_000, Some(&east)), now);
    assert_eq!(east2.limit_milli, 2_000, "west's lease may still be enforced");
    now = ends + MARGIN_MS;
    let east3 = sync(&mut s, region("east", 2_000, 4_000, Some(&east2)), now);
    assert_eq!(east3.limit_milli, 4_000, "west's lease ended: east gets everything left");
    let w = s.regions.get("west").expect("west");
    assert_eq!(region_reserved(w, "team-a", "H100", now, MARGIN_MS), 0);
}

#[test]
fn two_regions_waiting_for_the_last_gpu_never_split_it() {
    // One H100 worldwide, held by south; east and west each wait with a 1-GPU job.
    let mut s = init(1_000);
    let mut now = 10_000;
    let south = sync(&mut s, region("south", 1_000, 1_000, None), now);
    let mut east = sync(&mut s, region("east", 0, 1_000, None), now);
    let mut west = sync(&mut s, region("west", 0, 1_000, None), now);
    assert_eq!((east.limit_milli, west.limit_milli), (0, 0));
    // South's job ends; it reports no use and no want. Then everyone syncs for a while: never
    // half a GPU each (which would start nothing), and soon one of them holds the whole GPU.
    let mut south = sync(&mut s, region("south", 0, 0, Some(&south)), now);
    let mut whole = false;
    for _ in 0..6 {
        now += 1_000;
        south = sync(&mut s, region("south", 0, 0, Some(&south)), now);
        east = sync(&mut s, region("east", 0, 1_000, Some(&east)), now);
        west = sync(&mut s, region("west", 0, 1_000, Some(&west)), now);
        for l in [&east, &west] {
            assert!(l.limit_milli == 0 || l.limit_milli == 1_000, "a useless share: {l:?}");
        }
        assert!(east.limit_milli + west.limit_milli <= 1_000);
        whole |= east.limit_milli == 1_000 || west.limit_milli == 1_000;
    }
    assert!(whole, "one region was leased the GPU: east {east:?} west {west:?}");
}

#[test]
fn dispatch_counts_the_leases_and_a_pending_federated_job_shrinks_them() {
    let mut s = init(4_000);
    let now = 10_000;
    let east = sync(&mut s, region("east", 0, 3_000, None), now);
    assert_eq!(east.limit_milli, 3_000);
    let submit = FedCommand::Submit {
        client_request_id: "r1".into(),
        spec: Box::new(gpu_job(2)),
        team: "team-a".into(),
        submitted_by: "user alice".into(),
        data_labels: BTreeMap::new(),
        now_ms: now,
        trace: None,
    };
    assert!(matches!(s.apply(submit), FedResponse::Submitted { .. }));
    let decisions = dispatch(&view_of(&s, now), 1);
    match &decisions[..] {
        [Decision::Hold { reason, .. }] => assert!(reason.contains("quota 1 left"), "{reason}"),
        other => panic!("expected a hold: {other:?}"),
    }
    // East's next sync: the federation's pending job claims its fair share (2 of 4), so east
    // is leased 2; once east reports enforcing it, the job fits.
    let east = sync(&mut s, region("east", 0, 3_000, Some(&east)), now + 3_000);
    assert_eq!(east.limit_milli, 2_000);
    let still = dispatch(&view_of(&s, now + 3_000), 1);
    assert!(matches!(&still[..], [Decision::Hold { .. }]), "east's earlier 3 still counted: {still:?}");
    sync(&mut s, region("east", 0, 3_000, Some(&east)), now + 6_000);
    let placed = dispatch(&view_of(&s, now + 6_000), 1);
    assert!(matches!(&placed[..], [Decision::Place { region, .. }] if region == "east"), "{placed:?}");
}

#[test]
fn a_removed_quota_leases_nothing_and_bad_leases_are_refused() {
    let mut s = init(4_000);
    let east = sync(&mut s, region("east", 0, 1_000, None), 10_000);
    assert_eq!(east.limit_milli, 1_000);
    assert_eq!(
        s.apply(FedCommand::SetQuota { team: "team-a".into(), device_model: "H100".into(), limit_milli: 0 }),
        FedResponse::Done
    );
    match s.apply(FedCommand::Sync { sync: Box::new(region("east", 0, 1_000, Some(&east))), now_ms: 13_000 }) {
        FedResponse::Synced(a) => assert!(a.quota_leases.is_empty(), "{:?}", a.quota_leases),
        other => panic!("{other:?}"),
    }
    // More reported leases than quotas may exist is refused, naming the field and the limit.
    let mut r = region("east", 0, 0, None);
    let small = FedConfig { max_quotas: 1, ..s.config() };
    assert_eq!(s.apply(FedCommand::SetConfig { config: small }), FedResponse::Done);
    r.quota_leases = vec![east.clone(), east];
    match s.apply(FedCommand::Sync { sync: Box::new(r), now_ms: 14_000 }) {
        FedResponse::Rejected { field, message } => {
            assert_eq!(field, "sync.quota_leases");
            assert!(message.contains("max_quotas"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

/// A region as the property test runs it: what it uses and the lease it enforces (the last
/// answer it received, unless the answer was lost).
#[derive(Debug, Clone, Default)]
struct Sim {
    used: u64,
    enforcing: Option<QuotaLease>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn the_regions_never_use_more_than_the_quota(
        limit in 1u64..16,
        steps in prop::collection::vec((0usize..3, 0u64..6_000, 0u64..20, 0u64..20, 0u8..4), 1..120),
    ) {
        let limit = limit * 1000;
        let names = ["east", "west", "south"];
        let mut s = init(limit);
        let mut regions = vec![Sim::default(); 3];
        let mut now = 10_000u64;
        for (i, advance, use_pick, want_pick, lose) in steps {
            now += advance;
            let r = &mut regions[i];
            // The region uses what its lease allows while the lease lasts by its clock (the
            // worst case: the federation's clock is `drift` behind), and can only give back
            // otherwise.
            let live = r.enforcing.as_ref().is_some_and(|l| now + DRIFT_MS < l.until_ms);
            let cap = if live { r.enforcing.as_ref().map_or(0, |l| l.limit_milli).max(r.used) } else { r.used };
            r.used = (use_pick * 1000).min(cap);
            let wanted = r.used + want_pick * 500;
            let lease = sync(&mut s, region(names[i], r.used, wanted, r.enforcing.as_ref()), now);
            if lose != 0 {
                r.enforcing = Some(lease);
            }
            // Every region's real use, and what it may still grow to under a live lease, fits.
            let mut at_most = 0u64;
            for r in &regions {
                let live = r.enforcing.as_ref().is_some_and(|l| now + DRIFT_MS < l.until_ms);
                let grow = if live { r.enforcing.as_ref().map_or(0, |l| l.limit_milli) } else { 0 };
                at_most += r.used.max(grow);
            }
            prop_assert!(at_most <= limit, "at most {} may be used of {}", at_most, limit);
            // The index dispatch and syncs read answers as the plain scans do.
            prop_assert_eq!(QuotaIndex::of(&s).reserved("team-a", "H100", now), taken(&s, now));
        }
    }
}
