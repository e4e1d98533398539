//! Topology-aware gang placement, measured as `suanli sim replay` reports it (issue 24): on
//! the synthetic cluster (racks of 4 nodes, blocks of 32) with a gang-heavy stream, the share
//! of gang replica pairs that cross network blocks, aware against blind, in the same run; and
//! the GPU allocation the awareness costs.

use anyhow::Result;
use suanli_scheduler::engine::SchedulerConfig;
use suanli_sim::replay::{ReplayOptions, default_queue, replay};
use suanli_sim::synth;

#[test]
fn gangs_cross_fewer_blocks_when_placement_knows_the_network() -> Result<()> {
    let nodes = synth::nodes(128);
    // Gang-heavy: every gang of the synthetic stream, and a third of the rest.
    let pods: Vec<_> = synth::trace_pods(2000, 11, 20, true)
        .into_iter()
        .enumerate()
        .filter(|(i, p)| p.replicas > 1 || i % 3 == 0)
        .map(|(_, p)| p)
        .collect();
    let gangs = pods.iter().filter(|p| p.replicas > 1).count();
    assert!(gangs * 3 > pods.len(), "{gangs} gangs of {}", pods.len());
    let run = |aware: bool| {
        let opts = ReplayOptions {
            config: SchedulerConfig { topology_aware: aware, ..SchedulerConfig::default() },
            ..ReplayOptions::default()
        };
        replay(&nodes, &pods, &[default_queue()], &opts)
    };
    let (aware, blind) = (run(true)?, run(false)?);
    eprintln!(
        "gang pairs across blocks: aware {:.1}% of {}, blind {:.1}% of {}; GPU allocation mean: aware {:.2}%, blind {:.2}%",
        aware.gang_pairs_cross_block_pct,
        aware.gang_pairs,
        blind.gang_pairs_cross_block_pct,
        blind.gang_pairs,
        aware.gpu_util_mean_pct,
        blind.gpu_util_mean_pct
    );
    assert!(aware.gang_pairs > 500 && blind.gang_pairs > 500);
    assert!(
        aware.gang_pairs_cross_block_pct * 1.4 < blind.gang_pairs_cross_block_pct,
        "aware {:.1}% vs blind {:.1}%",
        aware.gang_pairs_cross_block_pct,
        blind.gang_pairs_cross_block_pct
    );
    assert!(
        aware.gpu_util_mean_pct >= blind.gpu_util_mean_pct - 0.2,
        "allocation: aware {:.2}% vs blind {:.2}%",
        aware.gpu_util_mean_pct,
        blind.gpu_util_mean_pct
    );
    Ok(())
}
