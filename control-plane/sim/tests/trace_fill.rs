//! Replays the public Alibaba GPU trace (2023) with the published fill procedure and compares
//! with the published results of "Beware of Fragmentation" (ATC'23), seeds 42-51.
//!
//! The trace is public data kept outside the repository: the folder comes from
//! `SUANLI_TRACES`. Without it the test prints a note and passes, except under CI (`CI` set),
//! where a missing trace is a failure: CI must exercise this.

use std::path::PathBuf;
use suanli_sim::fill::{FillOptions, fill, rehearse_pods};
use suanli_sim::report::summarize;
use suanli_sim::trace;

/// Published mean allocation at 130% arrived (FGD, BestFit), from the trace folder's README.
const PUBLISHED: [(&str, f64, f64); 4] =
    [("cpu250", 93.41, 91.45), ("gpushare60", 91.40, 89.36), ("multigpu50", 97.18, 95.74), ("gpuspec20", 94.84, 93.30)];

fn trace_dir() -> Option<PathBuf> {
    match std::env::var_os("SUANLI_TRACES").filter(|v| !v.is_empty()) {
        Some(d) => Some(PathBuf::from(d)),
        None => {
            assert!(std::env::var_os("CI").is_none(), "CI must set SUANLI_TRACES to the Alibaba trace folder");
            eprintln!("note: SUANLI_TRACES is not set; skipping the published-results comparison");
            None
        }
    }
}

fn mean_at_130(dir: &std::path::Path, variant: &str, policy: &str) -> f64 {
    let nodes = trace::read_alibaba_nodes(&dir.join("openb_node_list_gpu_node.csv")).expect("node list");
    let pods = trace::read_pods(&dir.join(format!("openb_pod_list_{variant}.csv"))).expect("pod list");
    // A rehearsal does not depend on the seed: made once for the pod list.
    let base = FillOptions { policy: policy.into(), ..Default::default() };
    let rehearsed = rehearse_pods(&nodes, &pods, &base).expect("rehearsal");
    let runs: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (42..=51u64)
            .collect::<Vec<_>>()
            .chunks(5)
            .map(|seeds| {
                let (nodes, pods, base, rehearsed) = (&nodes, &pods, &base, &rehearsed);
                let seeds = seeds.to_vec();
                s.spawn(move || {
                    seeds
                        .into_iter()
                        .map(|seed| {
                            let opts = FillOptions { seed, rehearsed: rehearsed.clone(), ..base.clone() };
                            fill(nodes, pods, &opts).expect("fill")
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("worker")).collect()
    });
    summarize(policy, &runs).alloc_at_130
}

#[test]
fn default_policy_reaches_published_fgd_and_bestfit_is_faithful() {
    let Some(dir) = trace_dir() else { return };
    let mut report = String::new();
    for (variant, fgd_pub, bestfit_pub) in PUBLISHED {
        let ours = mean_at_130(&dir, variant, "suanli");
        let bestfit = mean_at_130(&dir, variant, "bestfit");
        let fgd = mean_at_130(&dir, variant, "fgd");
        report.push_str(&format!(
            "{variant:<11} suanli {ours:6.2} (published FGD {fgd_pub:6.2}, {:+.2})  fgd {fgd:6.2} ({:+.2})  bestfit {bestfit:6.2} (published {bestfit_pub:6.2}, {:+.2})\n",
            ours - fgd_pub,
            fgd - fgd_pub,
            bestfit - bestfit_pub
        ));
        assert!(
            (bestfit - bestfit_pub).abs() <= 1.5,
            "{variant}: bestfit {bestfit:.2} vs published {bestfit_pub:.2}\n{report}"
        );
        assert!((fgd - fgd_pub).abs() <= 1.5, "{variant}: fgd {fgd:.2} vs published {fgd_pub:.2}\n{report}");
        // "Reaches": within the seed-to-seed noise of the published mean (its standard
        // deviation over these seeds is 0.1-0.3 points), or above it.
        assert!(ours >= fgd_pub - 0.1, "{variant}: suanli {ours:.2} below published FGD {fgd_pub:.2}\n{report}");
        // And at or above our own FGD on the same arrivals (issue 24: the default never trails
        // FGD on a development trace). Compared to the hundredth that reports print.
        assert!(
            (ours * 100.0).round() >= (fgd * 100.0).round(),
            "{variant}: suanli {ours:.4} below fgd {fgd:.4} on the same seeds\n{report}"
        );
    }
    eprintln!("{report}");
}
