//! The federation end to end (issue 20, docs/federation.md): real `suanli federation serve`
//! voters, real region servers (`--region --federation`) and fake-GPU agents, TLS on.
//!
//! - `dev_regions_start_and_stop`: `suanli dev --regions 3` brings up 3 regions × 3 servers,
//!   3 voters and an agent per region; the CLI sees every region healthy; SIGTERM ends it.
//! - `global_jobs_land_where_capacity_is_and_quotas_hold_worldwide`: placement by capacity, a
//!   team's worldwide quota against two regions submitting at once, a job that fits nowhere.
//! - `local_work_stays_within_the_teams_worldwide_quota`: two regions lease shares of a team's
//!   worldwide quota of one H100; of two region-local jobs submitted at once in both, one runs and
//!   the other waits naming the quota lease; once the first ends, the lease moves and the second runs.
//! - `a_lost_federation_voter_is_replaced_through_the_cli`: a voter's process and data are lost;
//!   `suanli federation remove-server` and `add-server` (sent to a follower: the CLI follows
//!   the leader hint) replace it with a fresh server that catches up; dispatch goes on.
//! - `a_federation_that_lost_its_majority_is_recovered_from_one_data_dir`: every voter stops;
//!   `suanli federation recover` writes a new one-voter data dir from one of them, and
//!   `federation serve` on it answers with the old jobs and quotas.
//! - `a_stopped_region_fences_its_job_and_another_region_resumes_it`: the region holding a
//!   checkpointed job is frozen (SIGSTOP); its agent stops the task before the lease ends; the
//!   job runs in another region after lease end + margin, restored from its checkpoint, and the
//!   agents' journals show no overlap.
//! - `bad_input_is_refused_with_its_reason_and_nothing_is_lost`: a region claiming a pool it
//!   does not own, a stale epoch, a renewal for a job another region holds, a region server
//!   given as `--federation`, a federation address used for region calls.
//!
//! Run: `cargo build --workspace && cargo test -p suanli-tests --test federation`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use suanli_proto::v1 as pb;
use suanli_tests::federation::{FedHarness, cli_regions, gpu_sleeper, healthy_names, in_state, three_regions};
use suanli_tests::{Trainer, all_jobs, bin, target_dir};

const PLACED: &[&str] = &["assigned", "running"];

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

#[tokio::test(flavor = "multi_thread")]
async fn dev_regions_start_and_stop() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("dev");
    let log_path = tmp.path().join("dev.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new(bin())
        .args(["dev", "--regions", "3", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .arg("--plugin-dir")
        .arg(target_dir())
        .env("SUANLI_LOG", "warn")
        .env_remove("SUANLI_DEV_DIR")
        .env_remove("SUANLI_FEDERATION")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    let fed_file = data.join("federation");
    let deadline = Instant::now() + Duration::from_secs(150);
    let mut last = String::new();
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            panic!(
                "suanli dev --regions 3 exited ({st}) before it was up:\n{}",
                std::fs::read_to_string(&log_path).unwrap()
            );
        }
        if let Ok(fed) = std::fs::read_to_string(&fed_file) {
            let fed = fed.trim().to_owned();
            assert_eq!(fed.split(',').count(), 3, "three voters in {}: {fed}", fed_file.display());
            match cli_regions(&fed, &data.join("tls")) {
                Ok(v) => {
                    let mut healthy = healthy_names(&v);
                    healthy.sort();
                    let said = std::fs::read_to_string(&log_path).unwrap_or_default().contains("Ctrl-C stops it");
                    if healthy == ["ap-south", "eu-west", "us-east"] && said {
                        let regions = v.get("regions").unwrap_or(&v).as_array().cloned().unwrap_or_default();
                        for r in &regions {
                            let eps = r.get("endpoints").and_then(|e| e.as_array()).map_or(0, Vec::len);
                            assert_eq!(eps, 3, "three servers in region {r}");
                        }
                        break;
                    }
                    last = v.to_string();
                }
                Err(e) => last = e,
            }
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!(
                "the dev regions not healthy within 150 s; last: {last}\n{}",
                std::fs::read_to_string(&log_path).unwrap()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let out = std::fs::read_to_string(&log_path).unwrap();
    assert!(out.contains("federation:") && out.contains("us-east:"), "it says how to reach everything:\n{out}");
    let st = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("suanli dev did not exit within 30 s of SIGTERM:\n{}", std::fs::read_to_string(&log_path).unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        status.success(),
        "suanli dev exits 0 on SIGTERM: {status}\n{}",
        std::fs::read_to_string(&log_path).unwrap()
    );
    assert!(!fed_file.exists(), "the federation file is removed with the cluster");
}

#[tokio::test(flavor = "multi_thread")]
async fn global_jobs_land_where_capacity_is_and_quotas_hold_worldwide() {
    let h = FedHarness::start(&three_regions()).await;
    let within = Duration::from_secs(30);
    // Every region prices its devices first (an attempt is priced at its start).
    for r in ["us-east", "eu-west", "ap-south"] {
        let catalog = pb::PriceCatalogInfo {
            currency: "USD".into(),
            devices: vec![
                pb::DevicePriceInfo { model: "H100".into(), per_hour: "4".into(), ..Default::default() },
                pb::DevicePriceInfo { model: "A100-80G".into(), per_hour: "2.5".into(), ..Default::default() },
            ],
            cpu_core_hour: "0.04".into(),
            memory_gib_hour: "0.005".into(),
        };
        let ch = suanli_server::local::channel(&h.region_addr(r).await).await.unwrap();
        suanli_proto::v1::cost_client::CostClient::new(ch)
            .set_prices(pb::SetPricesRequest { catalog: Some(catalog) })
            .await
            .unwrap_or_else(|e| panic!("prices in {r}: {e:?}"));
    }

    // Only eu-west has 4 free GPUs (of any model): the job goes there, whichever region took it.
    let big = h.submit_global("us-east", "team-a", "big-1", &gpu_sleeper("big4", 4, 600)).await;
    let j = h.wait_fed_job(&big, within, "the 4-GPU job placed", |j| in_state(j, PLACED)).await;
    assert_eq!(j.region, "eu-west", "{j:#?}");
    assert_eq!(j.device_model, "A100-80G", "{j:#?}");
    let eu = h.region_addr("eu-west").await;
    let deadline = Instant::now() + within;
    loop {
        let local = all_jobs(&eu, false).await.unwrap();
        if let Some(l) = local.iter().find(|l| l.global_id == big) {
            assert_eq!(l.fed_epoch, j.epoch, "{l:#?}");
            // One trace: the submitter's, kept by the federation and joined by the region job.
            assert_eq!(j.trace_id, suanli_tests::federation::TRACE_ID, "{j:#?}");
            assert_eq!(l.trace_id, suanli_tests::federation::TRACE_ID, "{l:#?}");
            break;
        }
        assert!(Instant::now() < deadline, "eu-west never adopted {big}: {local:#?}\n{}", h.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // team-q may use one H100 worldwide; it submits a one-H100 job via us-east and ap-south at once.
    h.set_quota("team-q", "H100", 1).await;
    let mut spec = gpu_sleeper("q", 1, 600);
    spec["constraints"] = serde_json::json!({"device_models": ["H100"]});
    let (east, south) = (h.region_addr("us-east").await, h.region_addr("ap-south").await);
    let (a, b) = tokio::join!(
        suanli_tests::federation::submit_global_at(&east, "team-q", "q-east", &spec),
        suanli_tests::federation::submit_global_at(&south, "team-q", "q-south", &spec),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_ne!(a, b, "two jobs");
    let deadline = Instant::now() + within;
    loop {
        let (ja, jb) = (h.fed_job(&a).await.unwrap(), h.fed_job(&b).await.unwrap());
        let placed: Vec<&pb::FedJobInfo> = [&ja, &jb].into_iter().filter(|j| in_state(j, PLACED)).collect();
        let held: Vec<&pb::FedJobInfo> =
            [&ja, &jb].into_iter().filter(|j| j.state == "pending" && j.reason.contains("quota")).collect();
        assert!(placed.len() <= 1, "the worldwide quota of one H100 holds: {ja:#?} {jb:#?}");
        if placed.len() == 1 && held.len() == 1 {
            assert!(held[0].reason.contains("H100"), "the hold names the model: {}", held[0].reason);
            break;
        }
        assert!(Instant::now() < deadline, "one placed, one held on the quota: {ja:#?} {jb:#?}\n{}", h.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // 64 GPUs fit nowhere: held, its reason naming every region.
    let huge = h.submit_global("eu-west", "team-a", "huge-1", &gpu_sleeper("huge", 64, 600)).await;
    let j = h
        .wait_fed_job(&huge, within, "the 64-GPU job held naming every region", |j| {
            j.state == "pending" && ["us-east", "eu-west", "ap-south"].iter().all(|r| j.reason.contains(r))
        })
        .await;
    assert!(j.region.is_empty() && j.epoch == 0, "never placed: {j:#?}");
    // A retry with the same request id is the same job.
    let again = h.submit_global("eu-west", "team-a", "huge-1", &gpu_sleeper("huge", 64, 600)).await;
    assert_eq!(again, huge);

    // The global cost roll-up: the regions' ledger totals reach the federation with the next
    // syncs, summed by team (team-a's 4-GPU job runs in eu-west, priced from its start).
    let deadline = Instant::now() + within;
    // Every region reports priced capacity, an idle one too (its reports run to the leader's
    // clock: the replicated clock stands still without commands).
    let by_region = loop {
        let r = h.fed().await.cost(pb::FedCostRequest { by: "region".into() }).await.unwrap().into_inner();
        if ["us-east", "eu-west", "ap-south"].iter().all(|k| r.rows.iter().any(|x| x.key == *k)) {
            break r;
        }
        assert!(Instant::now() < deadline, "the regions' cost totals at the federation: {r:#?}\n{}", h.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(by_region.conserved && by_region.currency == "USD", "{by_region:#?}");
    let deadline = Instant::now() + within;
    loop {
        let r = h.fed().await.cost(pb::FedCostRequest { by: "team".into() }).await.unwrap().into_inner();
        assert!(r.conserved, "the categories add up to capacity x time x price: {r:#?}");
        let running = |k: &str| -> i128 {
            r.rows.iter().find(|x| x.key == k).and_then(|x| x.base.as_ref()).map_or(0, |b| b.running.parse().unwrap())
        };
        if running("team-a") > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "team-a's running job is charged: {r:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The federation's /metrics: a client certificate of the CA reads it, anonymous is 401.
    let http = h.fed_http_addr();
    let pki = suanli_server::local::LocalPki::get();
    let anon = suanli_tests::http::Http::new(&http, pki.admin().ca).get("/metrics", None).await;
    assert_eq!(anon.status, 401, "{}", anon.body);
    let m = suanli_tests::http::Http::with(&http, &pki.admin_tls()).get("/metrics", None).await;
    assert_eq!(m.status, 200, "{}", m.body);
    assert!(m.content_type.starts_with("application/openmetrics-text"), "{}", m.content_type);
    let value = |series: &str| -> f64 {
        let line = m.body.lines().find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '));
        line.unwrap_or_else(|| panic!("{series} in:\n{}", m.body)).rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(value("suanli_federation_regions{health=\"healthy\"}"), 3.0);
    assert_eq!(value("suanli_federation_raft_voters"), 3.0);
    assert_eq!(value("suanli_federation_quota_limit_devices{team=\"team-q\",model=\"H100\"}"), 1.0);
    assert!(m.body.contains("# TYPE suanli_federation_quota_reserved_devices gauge"), "{}", m.body);
    let devices =
        "suanli_federation_region_devices{region=\"eu-west\",pool=\"eu-west-gpu\",model=\"A100-80G\",state=\"total\"}";
    assert_eq!(value(devices), 8.0);
    let cost = "suanli_federation_cost{region=\"eu-west\",team=\"team-a\",category=\"running\",currency=\"USD\"}";
    assert!(value(cost) > 0.0, "{}", m.body);
    assert!(
        m.body.lines().any(|l| l.starts_with("suanli_federation_jobs{") && l.contains("region=\"eu-west\"")),
        "{}",
        m.body
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn local_work_stays_within_the_teams_worldwide_quota() {
    use suanli_tests::federation::Region;
    let h = FedHarness::start(&[Region::new("us-east", 2, "H100"), Region::new("ap-south", 2, "H100")]).await;
    let within = Duration::from_secs(30);
    // Queue `default` belongs to team `default` in both regions: one H100 worldwide.
    h.set_quota("default", "H100", 1).await;
    // A quota binds a region from the first sync answer it commits: wait until each region has
    // synced twice since (the link commits an answer before its next sync).
    let leases = || async {
        let r = h.fed().await.regions(pb::FedRegionsRequest {}).await.unwrap().into_inner();
        let q = r.quotas.into_iter().find(|q| q.team == "default" && q.device_model == "H100").unwrap();
        q.leases.into_iter().map(|l| (l.region, l.until_ms)).collect::<std::collections::BTreeMap<_, _>>()
    };
    let deadline = Instant::now() + within;
    let mut first = leases().await;
    loop {
        let now = leases().await;
        if first.len() < 2 {
            first = now.clone();
        } else if now.iter().all(|(r, until)| first.get(r).is_some_and(|f| f < until)) {
            break;
        }
        assert!(Instant::now() < deadline, "both regions leased the quota: {now:?}\n{}", h.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (east, south) = (h.region_addr("us-east").await, h.region_addr("ap-south").await);
    let mut spec = gpu_sleeper("local", 1, 600);
    spec["constraints"] = serde_json::json!({"device_models": ["H100"]});
    let (a, b) = tokio::join!(
        suanli_tests::agents::submit(&east, "local-east", &spec),
        suanli_tests::agents::submit(&south, "local-south", &spec),
    );
    let state = |jobs: &[pb::JobInfo], id: u64| jobs.iter().find(|j| j.id == id).cloned().unwrap();
    let deadline = Instant::now() + within;
    let (running_at, running, waiting_at, waiting) = loop {
        let (je, js) = (all_jobs(&east, false).await.unwrap(), all_jobs(&south, false).await.unwrap());
        let (ja, jb) = (state(&je, a), state(&js, b));
        let runs = |j: &pb::JobInfo| matches!(j.state.as_str(), "placed" | "running");
        assert!(!(runs(&ja) && runs(&jb)), "one H100 worldwide, two local jobs run: {ja:#?} {jb:#?}\n{}", h.logs());
        let leased = |j: &pb::JobInfo| j.state == "pending" && j.reason.contains("quota lease");
        if runs(&ja) && leased(&jb) {
            break (east.clone(), a, south.clone(), b);
        }
        if runs(&jb) && leased(&ja) {
            break (south.clone(), b, east.clone(), a);
        }
        assert!(Instant::now() < deadline, "one runs, one waits for the lease: {ja:#?} {jb:#?}\n{}", h.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The federation lists each region's lease; they never sum past the quota.
    let regions = h.fed().await.regions(pb::FedRegionsRequest {}).await.unwrap().into_inner();
    let q = regions.quotas.iter().find(|q| q.team == "default" && q.device_model == "H100").unwrap();
    assert!(q.leases.iter().map(|l| l.limit_milli).sum::<u64>() <= 1000, "{q:#?}");
    assert!(q.leases.iter().any(|l| l.limit_milli == 1000 && l.wanted_milli == 1000), "{q:#?}");
    // The running job ends: its region's lease shrinks, the other region is leased the H100.
    suanli_proto::v1::jobs_client::JobsClient::new(suanli_server::local::channel(&running_at).await.unwrap())
        .cancel(pb::CancelJobRequest { job_id: running, reason: "done".into() })
        .await
        .unwrap();
    let deadline = Instant::now() + within;
    loop {
        let j = state(&all_jobs(&waiting_at, false).await.unwrap(), waiting);
        if matches!(j.state.as_str(), "placed" | "running") {
            break;
        }
        assert!(Instant::now() < deadline, "the waiting job runs once the lease moves: {j:#?}\n{}", h.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_federation_voter_is_replaced_through_the_cli() {
    use suanli_tests::federation::{Region, cli_federation};
    let mut h = FedHarness::start(&[Region::new("us-east", 2, "H100")]).await;
    let within = Duration::from_secs(30);
    let tls = h.cluster.federation.tls_dir().unwrap().to_owned();
    let status = |fed: &str| cli_federation(fed, &tls, &["status"]);
    let all = h.cluster.federation.addrs.join(",");
    let s = status(&all).unwrap();
    let leader = s["leader_id"].as_u64().unwrap();
    assert!(leader >= 1, "{s}");
    // Lose a follower: its process and its disk.
    let lost = (1..=3u64).find(|id| *id != leader).unwrap();
    let i = (lost - 1) as usize;
    h.cluster.federation.kill(i);
    h.cluster.federation.wipe(i).unwrap();
    // Remove it, then add a fresh server at the same addresses: asked of a follower that is
    // still up, which names the leader.
    let other = (1..=3u64).find(|id| *id != leader && *id != lost).unwrap();
    let follower = h.cluster.federation.addrs[(other - 1) as usize].clone();
    let r = cli_federation(&follower, &tls, &["remove-server", "--id", &lost.to_string()]).unwrap();
    assert_eq!(r["removed"], true, "{r}");
    let s = status(&all).unwrap();
    let ids: Vec<u64> = s["members"].as_array().unwrap().iter().map(|m| m["id"].as_u64().unwrap()).collect();
    assert!(!ids.contains(&lost), "{s}");
    // An address that is not host:port is refused, naming the field.
    let bad = cli_federation(&follower, &tls, &["add-server", "--id", "9", "--addr", "nowhere"]).unwrap_err();
    assert!(bad.contains("addr: \"nowhere\" is not host:port"), "{bad}");
    h.cluster.federation.spawn_waiting(i).unwrap();
    let (addr, peer) = (h.cluster.federation.addrs[i].clone(), h.cluster.federation.peer_addrs[i].clone());
    let r = cli_federation(
        &follower,
        &tls,
        &["add-server", "--id", &lost.to_string(), "--addr", &addr, "--peer-addr", &peer],
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", h.logs()));
    assert_eq!(r["role"], "voter", "{r}");
    // The new server holds the group's state: it answers with the leader and the region.
    let deadline = Instant::now() + within;
    loop {
        let s = status(&addr);
        let ok = s.as_ref().is_ok_and(|s| {
            s["leader_id"].as_u64().unwrap_or(0) >= 1
                && s["regions"].as_u64() == Some(1)
                && s["members"].as_array().is_some_and(|m| m.len() == 3 && m.iter().all(|m| m["voter"] == true))
        });
        if ok {
            break;
        }
        assert!(Instant::now() < deadline, "the new voter caught up: {s:?}\n{}", h.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Dispatch goes on.
    let id = h.submit_global("us-east", "team-a", "after-replace", &gpu_sleeper("after", 1, 600)).await;
    h.wait_fed_job(&id, within, "placed after the replacement", |j| in_state(j, PLACED)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_federation_that_lost_its_majority_is_recovered_from_one_data_dir() {
    use suanli_tests::federation::{Region, cli_federation};
    let mut h = FedHarness::start(&[Region::new("us-east", 2, "H100")]).await;
    let within = Duration::from_secs(30);
    h.set_quota("team-r", "H100", 2).await;
    let id = h.submit_global("us-east", "team-r", "before-loss", &gpu_sleeper("kept", 1, 600)).await;
    h.wait_fed_job(&id, within, "placed before the loss", |j| in_state(j, PLACED)).await;
    // Every voter stops (a lost majority, and more).
    for i in 0..3 {
        h.cluster.federation.kill(i);
    }
    let tls = h.cluster.federation.tls_dir().unwrap().to_owned();
    let old = h.cluster.federation.data_dir(0);
    let new = h.dir().join("recovered");
    let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let (listen, peer) = (port(), port());
    let args = ["recover", "--from-data-dir", old.to_str().unwrap(), "--data-dir", new.to_str().unwrap(), "--id", "1"];
    let mut args: Vec<&str> = args.to_vec();
    args.extend(["--listen", &listen, "--peer-listen", &peer]);
    let r = cli_federation("127.0.0.1:1", &tls, &args).unwrap();
    assert_eq!((r["jobs"].as_u64(), r["regions"].as_u64(), r["quotas"].as_u64()), (Some(1), Some(1), Some(1)), "{r}");
    // A second recover into the same (now written) dir is refused, naming it.
    let again = cli_federation("127.0.0.1:1", &tls, &args).unwrap_err();
    assert!(again.contains("is not empty"), "{again}");
    let log = std::fs::File::create(h.dir().join("recovered.log")).unwrap();
    let mut server = Command::new(bin())
        .args(["federation", "serve", "--id", "1", "--data-dir", new.to_str().unwrap(), "--listen", &listen])
        .args(["--peer-listen", &peer, "--http-listen", "off", "--tls-dir", tls.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + within;
    // It elects itself (the only voter) and answers with the old jobs.
    let jobs = loop {
        let jobs = cli_federation(&listen, &tls, &["jobs"]);
        let leads = cli_federation(&listen, &tls, &["status"]).is_ok_and(|s| s["leader_id"].as_u64() == Some(1));
        if let Ok(v) = &jobs
            && v.to_string().contains(&id)
            && leads
        {
            break v.clone();
        }
        if Instant::now() > deadline {
            let _ = server.kill();
            panic!(
                "the recovered federation answers with {id}: {jobs:?}\n{}",
                std::fs::read_to_string(h.dir().join("recovered.log")).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let quotas = cli_federation(&listen, &tls, &["quota", "list"]);
    let status = cli_federation(&listen, &tls, &["status"]);
    let _ = server.kill();
    let _ = server.wait();
    let quotas = quotas.unwrap();
    assert!(quotas.to_string().contains("team-r"), "{quotas}");
    let status = status.unwrap();
    assert_eq!(status["leader_id"].as_u64(), Some(1), "{status}");
    assert_eq!(status["members"].as_array().map(Vec::len), Some(1), "{status}");
    assert!(jobs.to_string().contains("team-r"), "{jobs}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_region_fences_its_job_and_another_region_resumes_it() {
    let h = FedHarness::start(&three_regions()).await;
    let terms = h.cluster.terms;
    let journal = h.path("trainer.jsonl");
    // grace 1 s: stop_before = drift + grace + 1 s kill grace = 2.2 s, well under the 6 s lease.
    let t = Trainer { grace_s: 1, ..Trainer::new("fenced") };
    let g = h.submit_global("us-east", "team-t", "fenced-1", &t.spec(&journal)).await;
    let j = h
        .wait_fed_job(&g, Duration::from_secs(40), "running with a checkpoint reported", |j| {
            j.state == "running" && j.checkpoint.as_ref().is_some_and(|c| c.step > 0)
        })
        .await;
    let (from, epoch) = (j.region.clone(), j.epoch);
    let ckpt_step = j.checkpoint.as_ref().map_or(0, |c| c.step);

    // Freeze every server of the holding region: it can no longer renew the lease.
    h.signal_region(&from, "STOP");
    let stopped_at = now_ms();
    // The last renewal may be in flight: the lease's end is the latest seen over a sync interval.
    let mut lease_end = j.lease_until_ms;
    let until = Instant::now() + Duration::from_millis(terms.sync_interval_ms * 2);
    while Instant::now() < until {
        if let Ok(x) = h.fed_job(&g).await
            && x.epoch == epoch
        {
            lease_end = lease_end.max(x.lease_until_ms);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(lease_end > stopped_at, "the lease was live when the region stopped: {lease_end} <= {stopped_at}");

    let moved = h
        .wait_fed_job(&g, Duration::from_secs(40), "running in another region", |j| {
            j.state == "running" && j.region != from && j.epoch > epoch
        })
        .await;
    let lines = h
        .wait_journal_restore(&journal, Duration::from_secs(30), stopped_at)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", h.logs()));
    assert!(
        lines.iter().any(|l| l.event == "restore" && l.step >= ckpt_step && l.t * 1000.0 > stopped_at as f64),
        "the new run restored from step >= {ckpt_step}: {lines:?}"
    );

    // The old region's agent stopped the task by lease end - drift (its own clock, this machine's).
    let old = h.journal(&from, &g);
    let old_stop = old
        .iter()
        .filter(|e| !e.is_start() && e.fed_epoch == epoch)
        .map(|e| e.at_ms)
        .max()
        .unwrap_or_else(|| panic!("no stop line of {g} epoch {epoch} in {from}'s journal: {old:#?}\n{}", h.logs()));
    assert!(
        old_stop <= lease_end - terms.max_clock_drift_ms,
        "stopped at {old_stop}, after lease end {lease_end} - drift {}",
        terms.max_clock_drift_ms
    );
    let new = h.journal(&moved.region, &g);
    let new_start = new
        .iter()
        .filter(|e| e.is_start() && e.fed_epoch == moved.epoch)
        .map(|e| e.at_ms)
        .min()
        .unwrap_or_else(|| panic!("no start of {g} epoch {} in {}'s journal: {new:#?}", moved.epoch, moved.region));
    assert!(
        new_start + terms.max_clock_drift_ms >= lease_end + terms.redispatch_margin_ms,
        "started at {new_start}, before lease end {lease_end} + margin {} - drift",
        terms.redispatch_margin_ms
    );
    assert!(new_start > old_stop, "no overlap: new start {new_start} after old stop {old_stop}");
    // Every start of every epoch comes after the previous epoch's last stop.
    let all = h.journals(&g);
    let mut live: Option<(u64, String)> = None;
    for (region, e) in &all {
        if e.is_start() {
            if let Some((ep, r)) = &live {
                assert!(
                    *ep == e.fed_epoch,
                    "epoch {} started in {region} while epoch {ep} ran in {r}: {all:#?}",
                    e.fed_epoch
                );
            }
            live = Some((e.fed_epoch, region.clone()));
        } else if live.as_ref().is_some_and(|(ep, _)| *ep == e.fed_epoch) {
            live = None;
        }
    }

    // Thawed, the old region is refused (stale epoch) and releases its copy; it never restarts it.
    h.signal_region(&from, "CONT");
    let from_addr = h.region_addr(&from).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let local = all_jobs(&from_addr, false).await.unwrap_or_default();
        if local.iter().any(|l| l.global_id == g && l.state == "cancelled") {
            break;
        }
        assert!(Instant::now() < deadline, "{from} did not release {g}: {local:#?}\n{}", h.logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let restarted = h.journal(&from, &g).iter().filter(|e| e.is_start() && e.at_ms > stopped_at).count();
    assert_eq!(restarted, 0, "{from} never restarts {g} after losing its lease");
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_is_refused_with_its_reason_and_nothing_is_lost() {
    let h = FedHarness::start(&three_regions()).await;
    let g = h.submit_global("us-east", "team-a", "keep-1", &gpu_sleeper("keep", 1, 600)).await;
    let j = h.wait_fed_job(&g, Duration::from_secs(30), "running", |j| j.state == "running").await;
    let (holder, epoch) = (j.region.clone(), j.epoch);
    let dir = h.cluster.regions_info().await.unwrap();
    let info = |name: &str| dir.regions.iter().find(|r| r.name == name).cloned().unwrap();
    let other = ["us-east", "eu-west", "ap-south"].into_iter().find(|r| *r != holder).unwrap();
    let as_region = |r: &pb::RegionInfo, held: Vec<pb::HeldJob>| pb::RegionSyncRequest {
        region: r.name.clone(),
        endpoints: r.endpoints.clone(),
        labels: r.labels.clone(),
        pools: r.pools.clone(),
        capacity: r.capacity.clone(),
        backlog: r.backlog,
        usage: Vec::new(),
        held,
        sent_at_ms: now_ms(),
        cost: None,
        quota_leases: Vec::new(),
    };
    let mut fed = h.fed_as_server(0).await;

    // A new region claiming another region's pool, and capacity for a pool it does not list.
    let owned = info(other).pools[0].clone();
    let claim = pb::RegionSyncRequest {
        region: "rogue".into(),
        endpoints: vec!["127.0.0.1:1".into()],
        pools: vec![owned.clone()],
        sent_at_ms: now_ms(),
        ..Default::default()
    };
    let r = fed.sync(claim).await;
    let msg = format!("{r:?}");
    assert!(r.is_err() && msg.contains(&owned) && msg.contains(other), "a pool of {other} is refused: {msg}");
    let cap = pb::RegionSyncRequest {
        region: "rogue".into(),
        endpoints: vec!["127.0.0.1:1".into()],
        pools: vec!["rogue-gpu".into()],
        capacity: vec![pb::CapacityEntry {
            pool: owned.clone(),
            device_kind: "gpu".into(),
            device_model: "H100".into(),
            total_milli: 100_000,
            free_milli: 100_000,
            max_node_free_milli: 8_000,
            ..Default::default()
        }],
        sent_at_ms: now_ms(),
        ..Default::default()
    };
    let r = fed.sync(cap).await;
    let msg = format!("{r:?}");
    assert!(r.is_err() && msg.contains(&owned) && msg.contains("capacity"), "capacity for a pool not its own: {msg}");

    // The holder reporting an epoch from the past: refused, naming the epochs; no renewal.
    let stale = pb::HeldJob { global_id: g.clone(), epoch: epoch - 1, status: "running".into(), ..Default::default() };
    let r = fed.sync(as_region(&info(&holder), vec![stale])).await.map(tonic::Response::into_inner);
    let r = r.unwrap_or_else(|e| panic!("a stale report is answered (refused in the answer): {e:?}"));
    let refusal = r.refused.iter().find(|x| x.global_id == g).unwrap_or_else(|| panic!("{g} refused: {r:#?}"));
    assert!(refusal.reason.contains("epoch"), "the refusal names the epoch: {}", refusal.reason);
    assert!(r.leases.iter().all(|l| l.global_id != g || l.epoch == epoch), "no lease for the old epoch: {r:#?}");

    // Another region renewing the holder's job: refused, naming who holds it.
    let foreign = pb::HeldJob { global_id: g.clone(), epoch, status: "running".into(), ..Default::default() };
    let r = fed.sync(as_region(&info(other), vec![foreign])).await.unwrap().into_inner();
    let refusal = r.refused.iter().find(|x| x.global_id == g).unwrap_or_else(|| panic!("{g} refused: {r:#?}"));
    assert!(
        refusal.reason.contains(&g) && refusal.reason.contains(other),
        "names the job and region: {}",
        refusal.reason
    );
    assert!(r.leases.iter().all(|l| l.global_id != g), "no lease to {other}: {r:#?}");

    // A region server given as `--federation`: its link says what that address is.
    let region_addr = h.region_addr(&holder).await;
    let wrong = suanli_server::local::ProcessCluster::start(
        &bin(),
        1,
        &["--region", "misconfigured", "--federation", &region_addr],
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !wrong.log(0).contains("this address is a region server") {
        assert!(Instant::now() < deadline, "the link names the wrong address's kind; its log:\n{}", wrong.log(0));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(wrong);

    // A federation address used for region calls: the CLI says what it is.
    let fed_addr = h.cluster.federation.addrs[0].clone();
    let out = suanli_tests::cli().args(["job", "list", "--server", &fed_addr]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("this address is a federation server"), "{}: {err}", out.status);

    // Nothing lost: the job still runs where it did at its epoch, every region is there, no rogue.
    let j = h.fed_job(&g).await.unwrap();
    assert_eq!((j.state.as_str(), j.region.as_str(), j.epoch), ("running", holder.as_str(), epoch), "{j:#?}");
    let dir = h.cluster.regions_info().await.unwrap();
    let mut names: Vec<&str> = dir.regions.iter().map(|r| r.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["ap-south", "eu-west", "us-east"], "no rogue or misconfigured region registered");
    assert!(h.fed_jobs().await.iter().any(|x| x.global_id == g));
    let local = all_jobs(&h.region_addr(&holder).await, false).await.unwrap();
    assert!(local.iter().any(|l| l.global_id == g && l.state == "running"), "{local:#?}");
}
