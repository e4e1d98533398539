//! Properties of the pure dispatch function: deterministic; within one pass never over a
//! region's free capacity nor a quota; never an unhealthy or disallowed region; every hold
//! reason names each region; a job that fits somewhere is placed when nothing competes.

use proptest::prelude::*;
use std::collections::BTreeMap;
use suanli_federation::CapacityEntry;
use suanli_federation::dispatch::{
    Decision, DispatchView, PendingJob, QuotaView, RegionView, dispatch, synthetic_view,
};

const MODELS: [&str; 2] = ["H100", "A100"];

/// A region drawn: healthy, capacity entries (model, free, per-node slack, price), backlog.
type RegionDraw = (bool, Vec<(usize, u64, u64, u64)>, u32);
/// A job drawn: devices per task, tasks, cpu, model, allowed region, priority, label.
type JobDraw = (u64, u64, u64, Option<usize>, Option<usize>, i32, u8);

fn region() -> impl Strategy<Value = RegionDraw> {
    (any::<bool>(), prop::collection::vec((0..2usize, 0..40u64, 0..10u64, 1..5u64), 0..3), 0..5u32)
}

fn job() -> impl Strategy<Value = JobDraw> {
    (1..5u64, 1..3u64, 0..3u64, prop::option::of(0..2usize), prop::option::of(0..4usize), -2..3i32, 0..2u8)
}

fn build(regions: Vec<RegionDraw>, jobs: Vec<JobDraw>, quota: Option<u64>) -> DispatchView {
    let mut view = DispatchView { now_ms: 1, ..DispatchView::default() };
    for (i, (healthy, caps, backlog)) in regions.into_iter().enumerate() {
        let capacity = caps
            .into_iter()
            .enumerate()
            .map(|(k, (m, free, node, price))| CapacityEntry {
                pool: format!("p{i}-{k}"),
                device_kind: "gpu".into(),
                device_model: MODELS[m].into(),
                total_milli: 64_000,
                free_milli: free * 1000,
                max_node_free_milli: node.min(free) * 1000,
                free_cpu_milli: 64_000,
                free_memory_mib: 1 << 20,
                price_micros_per_device_hour: price * 1_000_000,
            })
            .collect();
        view.regions.push(RegionView {
            name: format!("r{i}"),
            healthy,
            capacity,
            labels: BTreeMap::from([("data".to_owned(), format!("d{}", i % 2))]),
            backlog,
        });
    }
    if let Some(q) = quota {
        view.quotas.push(QuotaView {
            team: "t0".into(),
            device_model: "H100".into(),
            limit_milli: q * 1000,
            used_milli: 0,
        });
    }
    for (n, (count, replicas, prio_age, model, region, priority, team)) in jobs.into_iter().enumerate() {
        view.pending.push(PendingJob {
            id: format!("g-{}", n + 1),
            team: format!("t{team}"),
            device_kind: "gpu".into(),
            device_models: model.map(|m| vec![MODELS[m].to_owned()]).unwrap_or_default(),
            demand_milli: count * replicas * 1000,
            max_task_milli: count * 1000,
            cpu_milli: 1000,
            memory_mib: 1024,
            regions: region.map(|r| vec![format!("r{r}")]).unwrap_or_default(),
            data_labels: BTreeMap::new(),
            bound_model: None,
            priority,
            submitted_at_ms: prio_age,
        });
    }
    view
}

fn check_pass(view: &DispatchView, decisions: &[Decision]) -> Result<(), TestCaseError> {
    prop_assert_eq!(decisions.len(), view.pending.len());
    let mut free: BTreeMap<(String, String), u64> = BTreeMap::new();
    for r in &view.regions {
        for e in &r.capacity {
            *free.entry((r.name.clone(), e.device_model.clone())).or_default() += e.free_milli;
        }
    }
    let mut quota: BTreeMap<(String, String), u64> = view
        .quotas
        .iter()
        .map(|q| ((q.team.clone(), q.device_model.clone()), q.limit_milli.saturating_sub(q.used_milli)))
        .collect();
    for d in decisions {
        match d {
            Decision::Place { job, region, device_model, .. } => {
                let j = view.pending.iter().find(|p| &p.id == job).expect("a pending job");
                let r = view.regions.iter().find(|r| &r.name == region).expect("a known region");
                prop_assert!(r.healthy, "placed {} in unhealthy {}", job, region);
                prop_assert!(j.regions.is_empty() || j.regions.contains(region), "{} not allowed in {}", job, region);
                let model = device_model.clone().expect("a device model");
                prop_assert!(j.device_models.is_empty() || j.device_models.contains(&model));
                let f = free.entry((region.clone(), model.clone())).or_default();
                prop_assert!(*f >= j.demand_milli, "{} over {}'s free {}", job, region, model);
                *f -= j.demand_milli;
                if let Some(q) = quota.get_mut(&(j.team.clone(), model)) {
                    prop_assert!(*q >= j.demand_milli, "{} over its quota", job);
                    *q -= j.demand_milli;
                }
            }
            Decision::Hold { reason, .. } => {
                for r in &view.regions {
                    prop_assert!(reason.contains(&r.name), "hold reason {:?} omits {}", reason, r.name);
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn dispatch_is_deterministic_and_within_capacity_and_quota(
        regions in prop::collection::vec(region(), 0..5),
        jobs in prop::collection::vec(job(), 0..12),
        quota in prop::option::of(0..20u64),
        seed in any::<u64>(),
    ) {
        let view = build(regions, jobs, quota);
        let a = dispatch(&view, seed);
        prop_assert_eq!(&a, &dispatch(&view, seed));
        check_pass(&view, &a)?;
    }

    #[test]
    fn a_lone_job_that_fits_somewhere_is_placed(
        regions in prop::collection::vec(region(), 1..5),
        j in job(),
    ) {
        let view = build(regions, vec![j], None);
        let p = &view.pending[0];
        let fits = view.regions.iter().any(|r| {
            r.healthy
                && (p.regions.is_empty() || p.regions.contains(&r.name))
                && MODELS.iter().any(|m| {
                    let entries = r.capacity.iter().filter(|e| e.device_model == *m);
                    let (free, node) = entries.fold((0u64, 0u64), |(f, n), e| (f + e.free_milli, n.max(e.max_node_free_milli)));
                    (p.device_models.is_empty() || p.device_models.iter().any(|x| x == m))
                        && free >= p.demand_milli
                        && node >= p.max_task_milli
                })
        });
        let d = dispatch(&view, 0);
        prop_assert_eq!(matches!(d[0], Decision::Place { .. }), fits, "{:?}", d);
    }
}

#[test]
fn synthetic_view_is_deterministic_and_dispatchable() {
    let a = synthetic_view(10, 200, 42);
    assert_eq!(a, synthetic_view(10, 200, 42));
    assert_eq!((a.regions.len(), a.pending.len()), (10, 200));
    let d = dispatch(&a, 1);
    assert_eq!(d.len(), 200);
    assert!(d.iter().any(|d| matches!(d, Decision::Place { .. })));
}

#[test]
fn hold_reason_names_every_region_with_free_count_and_quota() {
    let mut view =
        build(vec![(true, vec![(0, 12, 8, 1)], 0), (true, vec![(0, 40, 8, 1)], 0), (false, vec![], 0)], vec![], None);
    view.regions[0].name = "us-east".into();
    view.regions[1].name = "eu-west".into();
    view.regions[2].name = "ap-south".into();
    view.quotas.push(QuotaView { team: "t0".into(), device_model: "H100".into(), limit_milli: 32_000, used_milli: 0 });
    view.pending.push(PendingJob {
        id: "g-1".into(),
        team: "t0".into(),
        device_kind: "gpu".into(),
        device_models: vec!["H100".into()],
        demand_milli: 64_000,
        max_task_milli: 8_000,
        ..PendingJob::default()
    });
    match &dispatch(&view, 0)[..] {
        [Decision::Hold { reason, .. }] => assert_eq!(
            reason,
            "no region has 64 free H100: ap-south unhealthy, eu-west 40 (quota 32 left), us-east 12 (quota 32 left)"
        ),
        other => panic!("{other:?}"),
    }
}
