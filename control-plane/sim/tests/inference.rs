//! `suanli sim replay` with inference services (issue 22, test 5): a diurnal request rate
//! reported by the replicas and autoscaled by the real autoscaler, batch work beside it, and
//! the same run on a static partition of the same devices. A small synthetic cluster with
//! exact claims, bad services files, and (with `SUANLI_TRACES`) batch from the Alibaba trace.

use anyhow::Result;
use suanli_model::Node;
use suanli_sim::replay::{
    ReplayError, ReplayOptions, ReplayReport, default_queue, parse_services_str, replay, static_partition,
};
use suanli_sim::trace::{TracePod, parse_alibaba_nodes_str, parse_native_pods_str};

const POD_HEADER: &str =
    "name,arrival_s,duration_s,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,queue,priority,replicas\n";
const DAY: u64 = 86_400;

fn nodes(n: usize, gpus: u32) -> Result<Vec<Node>> {
    let mut s = String::from("sn,cpu_milli,memory_mib,gpu,model\n");
    for i in 0..n {
        s.push_str(&format!("n{i},64000,262144,{gpus},V100M32\n"));
    }
    Ok(parse_alibaba_nodes_str("nodes.csv", &s)?)
}

/// One-GPU batch jobs of an hour, one every four minutes for two days: 15 GPUs wanted on
/// average, more than the cluster has beside the service's peak.
fn batch() -> Result<Vec<TracePod>> {
    let mut rows = String::from(POD_HEADER);
    for i in 0..(2 * DAY / 240) {
        rows.push_str(&format!("b{i},{},3600,4000,16384,1,1000,,default,0,1\n", i * 240));
    }
    Ok(parse_native_pods_str("pods.csv", &rows)?)
}

/// A chat service: 100 requests/s per replica, aimed at 70; 35 requests/s at night, 630 at
/// 14:00 (9 replicas), ready 60 s after it starts.
const CHAT: &str = "name,gpu_milli,min_replicas,max_replicas,capacity_rps,target_pct,trough_rps,peak_rps,peak_hour,startup_s,period_s\n\
                    chat,1000,1,10,100,70,35,630,14,60,15\n";

fn opts(static_partition: bool) -> Result<ReplayOptions> {
    Ok(ReplayOptions {
        services: parse_services_str("services.csv", CHAT)?,
        static_partition,
        until_s: Some(2 * DAY),
        ..ReplayOptions::default()
    })
}

fn run(static_partition: bool) -> Result<ReplayReport> {
    Ok(replay(&nodes(4, 4)?, &batch()?, &[default_queue()], &opts(static_partition)?)?)
}

#[test]
fn shared_devices_scale_inference_out_by_preempting_batch_and_give_them_back() -> Result<()> {
    let shared = run(false)?;
    let fixed = run(true)?;
    println!("{}\n{}", shared.table(), fixed.table());
    let (s, f) = (shared.inference.as_ref().expect("shared"), fixed.inference.as_ref().expect("static"));
    let (sc, fc) = (&s.services[0], &f.services[0]);
    // The autoscaler follows the day twice: out to 9 replicas at the peak, in to 1 at night.
    for (mode, c) in [("shared", sc), ("static", fc)] {
        assert!(c.ready_min == 1 && c.ready_max >= 9, "{mode}: {c:?}");
        assert!(c.scale_ups >= 2 && c.scale_downs >= 2, "{mode}: {c:?}");
        assert!(c.scale_out_s.count >= 2, "{mode}: {c:?}");
    }
    // Shared: the service takes its peak replicas from batch by preemption...
    assert!(shared.preemptions > 0, "shared: no batch job was preempted");
    assert_eq!(fixed.preemptions, 0, "static: nothing to preempt on the inference partition");
    assert_eq!(f.partition_gpu_milli, 12_000, "static: 3 nodes of 4 GPUs hold 10 replicas");
    assert_eq!(s.partition_gpu_milli, 0);
    // ...which costs scale-out time: a scale-up waits for a pass to preempt, the victims to
    // stop and another pass to place it (the static partition has idle devices ready). On a
    // rising load the autoscaler adds a replica every period, and a scale-out counts from
    // the first scale-up not yet served until every replica wanted is ready.
    assert!(fc.scale_out_s.p99 <= 120, "static scale-out p99 {}s", fc.scale_out_s.p99);
    assert!(sc.scale_out_s.p99 <= 600, "shared scale-out p99 {}s", sc.scale_out_s.p99);
    assert!(sc.scale_out_s.p99 > fc.scale_out_s.p99);
    // Both keep the SLO but for a scale-out's startup.
    for (mode, i) in [("shared", s), ("static", f)] {
        assert!(i.slo_violation_pct < 5.0 && i.unserved_pct < 1.0, "{mode}: {i:?}");
    }
    // Static batch has one node of 4 GPUs; shared batch runs on what the service leaves at
    // night, so it does far more work.
    let hours = (shared.end_s - shared.start_s) as f64 / 3600.0;
    assert!(f.batch_gpu_hours <= 4.0 * hours + 1e-6, "static batch {} GPU-h", f.batch_gpu_hours);
    assert!(s.batch_gpu_hours > 8.0 * hours, "shared batch {} GPU-h in {hours} h", s.batch_gpu_hours);
    assert!(
        s.batch_goodput_gpu_hours > 2.0 * f.batch_goodput_gpu_hours,
        "goodput shared {} static {}",
        s.batch_goodput_gpu_hours,
        f.batch_goodput_gpu_hours
    );
    assert!(s.batch_completed > f.batch_completed);
    assert!(shared.gpu_util_mean_pct > fixed.gpu_util_mean_pct + 10.0);
    // The same seed replays the same run.
    assert_eq!(run(false)?, shared);
    Ok(())
}

#[test]
fn services_files_and_options_are_checked() -> Result<()> {
    let err = |text: &str| parse_services_str("s.csv", text).expect_err(text).to_string();
    assert_eq!(
        err("name,capacity,max_replicas\n"),
        "s.csv: line 1: unknown column \"capacity\"; valid columns: name,queue,priority,gpu_milli,gpu_model,cpu_milli,memory_mib,min_replicas,max_replicas,capacity_rps,target_pct,trough_rps,peak_rps,peak_hour,startup_s,period_s,scale_down_window_s"
    );
    assert!(err("name,max_replicas,capacity_rps\na,2,10\n").contains("missing column \"peak_rps\""));
    let e = err("name,max_replicas,capacity_rps,peak_rps,trough_rps\na,2,10,5,50\n");
    assert_eq!(e, "s.csv: line 2: field \"peak_rps\": 5 must be between 50 and 1000000000");
    let e = err("name,max_replicas,capacity_rps,peak_rps,min_replicas\na,2,10,5,3\n");
    assert_eq!(e, "s.csv: line 2: field \"max_replicas\": 2 must be between 3 and 10000");
    let e = err("name,max_replicas,capacity_rps,peak_rps,gpu_milli\na,2,10,5,1500\n");
    assert!(e.starts_with("s.csv: line 2: field \"gpu_milli\": 1500: a replica takes a share"), "{e}");
    let e = err("name,max_replicas,capacity_rps,peak_rps\na,2,10,5\na,2,10,5\n");
    assert_eq!(e, "s.csv: line 3: field \"name\": duplicate service \"a\" (first defined on line 2)");
    assert!(err("name,max_replicas,capacity_rps,peak_rps\n").contains("no services defined"));
    // A replay with services must say when it ends; a static partition must fit.
    let o = ReplayOptions { until_s: None, ..opts(false)? };
    let e = replay(&nodes(4, 4)?, &batch()?, &[default_queue()], &o).expect_err("no end");
    assert!(matches!(e, ReplayError::Param { field: "until_s", .. }), "{e}");
    let e = static_partition(&nodes(2, 4)?, &opts(true)?.services).expect_err("too small");
    assert_eq!(
        e.to_string(),
        "services: a static partition needs 10 GPU(s) for the services at their most replicas; the nodes have 8"
    );
    Ok(())
}

/// The Alibaba trace's batch (gpushare60, arrivals compressed 32 times, a day of its busiest
/// stretch on every 100th node) beside two diurnal services, shared and static.
#[test]
fn alibaba_batch_beside_diurnal_inference_shared_and_static() -> Result<()> {
    let Some(dir) = std::env::var_os("SUANLI_TRACES").filter(|v| !v.is_empty()) else {
        println!("skipped: set SUANLI_TRACES to the alibaba-gpu-v2023 trace folder to replay it");
        return Ok(());
    };
    let dir = std::path::PathBuf::from(dir);
    let n: Vec<Node> = suanli_sim::trace::read_alibaba_nodes(&dir.join("openb_node_list_gpu_node.csv"))?
        .into_iter()
        .step_by(100)
        .collect();
    let mut p = suanli_sim::trace::read_pods(&dir.join("openb_pod_list_gpushare60.csv"))?;
    suanli_sim::trace::compress_arrivals(&mut p, 32);
    let from = 297_000;
    let until = from + DAY / 2;
    p.retain(|x| x.arrival_s >= from && x.arrival_s <= until);
    let services = parse_services_str(
        "services.csv",
        "name,gpu_milli,min_replicas,max_replicas,capacity_rps,trough_rps,peak_rps,peak_hour,startup_s,period_s\n\
         chat,1000,1,8,40,20,200,14,90,30\n\
         embed,500,1,8,200,100,1000,11,30,30\n",
    )?;
    let mut reports = Vec::new();
    for static_partition in [false, true] {
        let o =
            ReplayOptions { services: services.clone(), static_partition, until_s: Some(until), ..Default::default() };
        let started = std::time::Instant::now();
        let r = replay(&n, &p, &[default_queue()], &o)?;
        println!("{:.2}s:\n{}", started.elapsed().as_secs_f64(), r.table());
        assert_eq!(r.completed + r.running_at_end + r.never_started + r.requeued_at_end, r.jobs);
        reports.push(r);
    }
    let (shared, fixed) = (&reports[0], &reports[1]);
    let (s, f) = (shared.inference.as_ref().expect("shared"), fixed.inference.as_ref().expect("static"));
    assert!(s.scale_out_s.count > 0 && f.scale_out_s.count > 0);
    assert_eq!(fixed.preemptions, 0);
    assert!(s.batch_goodput_gpu_hours > f.batch_goodput_gpu_hours, "{s:?}\n{f:?}");
    assert!(shared.gpu_util_mean_pct > fixed.gpu_util_mean_pct);
    Ok(())
}
