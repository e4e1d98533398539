//! The named scenarios (documented in chaos/README.md).

use crate::cluster::FakeClocks;
use crate::nemesis::{Kind, Role};

/// A scenario: a cluster shape and the faults its nemesis draws from.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Name (`--scenario`).
    pub name: &'static str,
    /// One line on what it exercises.
    pub about: &'static str,
    /// Servers (3 or 5).
    pub servers: usize,
    /// The faults drawn from.
    pub kinds: &'static [Kind],
    /// Hold range of one fault (ms).
    pub hold_ms: (u64, u64),
    /// In the short suite.
    pub short: bool,
    /// The hostile client ([`crate::hostile`]) runs alongside the workload, and invariant 8
    /// (stays writable) is checked.
    pub hostile: bool,
    /// Servers run under libfaketime (the clock faults need it).
    pub clocks: Option<FakeClocks>,
    /// Checkpointing trainer jobs submitted before the fault phase ([`crate::trainers`]); with
    /// any, the trainer invariants (no job runs twice at once, steps never go back beyond the
    /// last committed checkpoint) are checked.
    pub trainers: usize,
}

/// Every scenario.
pub const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "leader-kill",
        about: "SIGKILL the leader, restart it; again and again",
        servers: 3,
        kinds: &[Kind::KillServer(Role::Leader)],
        hold_ms: (500, 2_500),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "follower-kill-pause",
        about: "SIGKILL a follower or SIGSTOP any server (a GC-like pause), then restore it",
        servers: 3,
        kinds: &[Kind::KillServer(Role::Follower), Kind::PauseServer(Role::Follower), Kind::PauseServer(Role::Leader)],
        hold_ms: (500, 3_000),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "partition",
        about: "a random minority cut from the majority, or the leader isolated",
        servers: 3,
        kinds: &[Kind::PartitionMinority, Kind::IsolateLeader],
        hold_ms: (1_000, 4_000),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "leader-isolated",
        about: "the leader cut from the other servers while half the clients still reach only it",
        servers: 3,
        kinds: &[Kind::IsolateLeader],
        hold_ms: (3_000, 6_000),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "bridge",
        about: "five servers: two sides joined by one bridge server, or the leader in a minority of two",
        servers: 5,
        kinds: &[Kind::Bridge, Kind::LeaderMinority, Kind::PartitionMinority],
        hold_ms: (1_500, 4_000),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "agents",
        about: "agents cut off past the heartbeat TTL (node down, tasks fenced), killed, or paused",
        servers: 3,
        kinds: &[Kind::PartitionAgent, Kind::KillAgent, Kind::PauseAgent],
        hold_ms: (1_000, 5_000),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "plugin-faults",
        about: "the fake device plugin segfaults (the supervisor restarts it) or reports a device unhealthy",
        servers: 3,
        kinds: &[Kind::PluginCrash, Kind::DeviceUnhealthy],
        hold_ms: (1_000, 3_000),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "membership",
        about: "a follower removed, wiped and added back (catching up from a snapshot), and follower kills",
        servers: 3,
        kinds: &[Kind::Membership, Kind::KillServer(Role::Follower)],
        hold_ms: (500, 2_000),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "disk",
        about: "slow fsync on the leader; a failed fsync that stops a server (it restarts with a healthy disk)",
        servers: 3,
        kinds: &[Kind::SlowDisk(Role::Leader), Kind::DiskError(Role::Follower), Kind::DiskError(Role::Leader)],
        hold_ms: (1_000, 3_000),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "flaky-net",
        about: "every server link delayed and resetting connections",
        servers: 3,
        kinds: &[Kind::FlakyNet],
        hold_ms: (2_000, 5_000),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "power-loss",
        about: "every server SIGKILLed at the same instant, then all restarted",
        servers: 3,
        kinds: &[Kind::PowerLoss],
        hold_ms: (300, 1_500),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "rolling-restart",
        about: "a rolling restart with SIGTERM (SIGKILL after 15 s), followers first, the leader last",
        servers: 3,
        kinds: &[Kind::RollingRestart],
        hold_ms: (500, 1_500),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "hostile-client",
        about: "a hostile client (poison proposals, bogus membership changes, oversized and malformed requests, watch floods) during leader kills, pauses and partitions",
        servers: 3,
        kinds: &[Kind::KillServer(Role::Leader), Kind::PauseServer(Role::Follower), Kind::PartitionMinority],
        hold_ms: (500, 2_500),
        short: true,
        hostile: true,
        clocks: None,
        trainers: 0,
    },
    Scenario {
        name: "clock-skew",
        about: "a server's wall clock stepped an hour ahead or behind (the leader's, or a follower's), then back",
        servers: 3,
        kinds: &[Kind::ClockSkew(Role::Leader), Kind::ClockSkew(Role::Follower)],
        hold_ms: (2_000, 5_000),
        short: true,
        hostile: false,
        clocks: Some(FakeClocks::Wall),
        trainers: 0,
    },
    Scenario {
        name: "clock-rate",
        about: "a server's clocks running twice as fast; the leader's while an agent is paused past the TTL",
        servers: 3,
        kinds: &[Kind::FastLeaderPausedAgent, Kind::ClockRate(Role::Follower)],
        hold_ms: (3_000, 5_000),
        short: true,
        hostile: false,
        clocks: Some(FakeClocks::All),
        trainers: 0,
    },
    Scenario {
        name: "migrate",
        about: "checkpointing trainers while agents are killed or cut off, servers partitioned and nodes drained",
        servers: 3,
        // Drains twice as often as the rest: they are what moves the trainers with checkpoints.
        kinds: &[Kind::KillAgent, Kind::PartitionAgent, Kind::PartitionMinority, Kind::DrainNode, Kind::DrainNode],
        hold_ms: (1_000, 4_000),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 3,
    },
    Scenario {
        name: "mixed",
        about: "five servers and every fault above, one at a time (the soak's default)",
        servers: 5,
        kinds: &[
            Kind::KillServer(Role::Leader),
            Kind::KillServer(Role::Follower),
            Kind::PauseServer(Role::Leader),
            Kind::IsolateLeader,
            Kind::PartitionMinority,
            Kind::Bridge,
            Kind::PartitionAgent,
            Kind::KillAgent,
            Kind::PluginCrash,
            Kind::DeviceUnhealthy,
            Kind::Membership,
            Kind::SlowDisk(Role::Follower),
            Kind::DiskError(Role::Follower),
            Kind::FlakyNet,
            Kind::PowerLoss,
            Kind::RollingRestart,
        ],
        hold_ms: (1_000, 3_000),
        short: true,
        hostile: false,
        clocks: None,
        trainers: 0,
    },
];

/// The scenario called `name`.
pub fn find(name: &str) -> Option<&'static Scenario> {
    SCENARIOS.iter().find(|s| s.name == name)
}
