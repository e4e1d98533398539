//! Apply's re-check of placements the engine must never make: a MIG partition next to its used
//! parent (or the reverse, or both in one placement), and nodes the job's node constraints
//! exclude. Each is refused with its own reason, and the state keeps its invariants.

mod common;

use common::*;
use suanli_model::{Device, DeviceKind, DeviceRequest, DeviceShare, JobId, Node, NodeId, Placement, Plan};
use suanli_state::{ApplyPlan, Command, PlanOutcome, RefusalReason, Response, State};

/// A node with `gpu0` (MIG-enabled, partitions `gpu0-mig0`, `gpu0-mig1`) and a plain `gpu1`.
fn mig_node(id: &str) -> Node {
    let mut n = node(id, 0);
    n.devices.push(Device::simple("gpu0", DeviceKind::Gpu, "A100"));
    for k in 0..2 {
        let mut d = Device::simple(format!("gpu0-mig{k}"), DeviceKind::Gpu, "A100-3g.40gb");
        d.partition_of = Some("gpu0".into());
        n.devices.push(d);
    }
    n.devices.push(Device::simple("gpu1", DeviceKind::Gpu, "A100"));
    n
}

fn placement(job: u64, node: &str, devices: &[(&str, u32)]) -> Placement {
    Placement {
        job: JobId(job),
        group: 0,
        replica: 0,
        node: NodeId::from(node),
        cpu_milli: 1000,
        memory_mib: 1024,
        devices: devices.iter().map(|(d, m)| DeviceShare { device: (*d).into(), milli: *m, memory_mib: 0 }).collect(),
        borrowed: false,
    }
}

fn apply(s: &mut State, p: Placement) -> PlanOutcome {
    let plan = Plan { placements: vec![p], ..Plan::default() };
    match apply_ok(s, Command::ApplyPlan(ApplyPlan { plan, now: 2 })) {
        Response::PlanApplied(o) => o,
        other => panic!("plan not applied: {other:?}"),
    }
}

fn state(nodes: &[Node]) -> State {
    let mut s = State::default();
    apply_ok(&mut s, upsert_queue(queue("q", 64)));
    for n in nodes {
        apply_ok(&mut s, register(n.clone(), 1));
    }
    s
}

fn refusal(o: &PlanOutcome) -> &RefusalReason {
    assert!(o.placed.is_empty(), "{o:?}");
    &o.refused_jobs.first().expect("refused").1
}

#[test]
fn apply_refuses_a_mig_partition_and_its_parent_at_once() {
    let mut s = state(&[mig_node("n0")]);
    let mut share = spec("q", 1, 1, 0);
    share.groups[0].resources.devices =
        Some(DeviceRequest { kind: DeviceKind::Gpu, count: 1, milli: 500, memory_mib: 0 });
    for rid in ["a", "b", "c", "d"] {
        apply_ok(&mut s, submit(rid, share.clone(), 1));
    }
    // A share of the parent runs: a slice of it is refused, naming the parent.
    assert_eq!(apply(&mut s, placement(1, "n0", &[("gpu0", 500)])).placed.len(), 1);
    let o = apply(&mut s, placement(2, "n0", &[("gpu0-mig1", 500)]));
    assert_eq!(
        refusal(&o),
        &RefusalReason::MigConflict { device: "gpu0-mig1".into(), node: NodeId::from("n0"), other: "gpu0".into() }
    );
    assert!(refusal(&o).to_string().contains("shares its physical GPU with gpu0"), "{o:?}");
    // The other GPU is fine.
    assert_eq!(apply(&mut s, placement(2, "n0", &[("gpu1", 500)])).placed.len(), 1);

    // A slice runs: the parent is refused, whole or shared.
    let mut t = state(&[mig_node("n0")]);
    for rid in ["a", "b"] {
        apply_ok(&mut t, submit(rid, share.clone(), 1));
    }
    assert_eq!(apply(&mut t, placement(1, "n0", &[("gpu0-mig0", 500)])).placed.len(), 1);
    let o = apply(&mut t, placement(2, "n0", &[("gpu0", 500)]));
    assert_eq!(refusal(&o).kind(), "mig_conflict");

    // One placement asking for a parent and its own slice.
    let mut u = state(&[mig_node("n0")]);
    apply_ok(&mut u, submit("a", spec("q", 1, 2, 0), 1));
    let o = apply(&mut u, placement(1, "n0", &[("gpu0", 1000), ("gpu0-mig0", 1000)]));
    assert_eq!(refusal(&o).kind(), "mig_conflict");
    // Two slices of one GPU are two devices: fine.
    let o = apply(&mut u, placement(1, "n0", &[("gpu0-mig0", 1000), ("gpu0-mig1", 1000)]));
    assert_eq!(o.placed.len(), 1, "{o:?}");
}

#[test]
fn apply_refuses_nodes_outside_the_node_constraints() {
    let mut s = state(&[node("n0", 2), node("n1", 2)]);
    let mut pinned = spec("q", 1, 1, 0);
    pinned.constraints.nodes = vec![NodeId::from("n1")];
    let mut avoiding = spec("q", 1, 1, 0);
    avoiding.constraints.avoid_nodes = vec![NodeId::from("n0")];
    apply_ok(&mut s, submit("a", pinned, 1));
    apply_ok(&mut s, submit("b", avoiding, 1));
    let o = apply(&mut s, placement(1, "n0", &[("gpu0", 1000)]));
    assert_eq!(refusal(&o), &RefusalReason::NodeNotAllowed { node: NodeId::from("n0") });
    let o = apply(&mut s, placement(2, "n0", &[("gpu0", 1000)]));
    assert_eq!(refusal(&o), &RefusalReason::NodeAvoided { node: NodeId::from("n0") });
    assert!(s.job(JobId(2)).is_some_and(|j| j.reason.contains("must avoid")), "the refusal is the job's reason");
    // The engine, given the same view, places both on n1.
    let o = schedule_once(&mut s, 3);
    assert_eq!(o.placed.len(), 2, "{o:?}");
    let view = s.cluster_view(4);
    assert!(view.running.iter().all(|a| a.node.as_str() == "n1"), "{:?}", view.running);
}
