//! The typical workload that fragmentation is measured against.
//!
//! Following "Beware of Fragmentation" (Weng et al., USENIX ATC'23), a node's fragmentation is
//! the free device capacity that the tasks which typically arrive could not use: for each
//! typical task shape, all free device milli when the shape cannot be placed on the node at
//! all, otherwise the free milli of the devices that have less left than the shape asks for;
//! weighted by how often the shape arrives. The typical shapes are the most popular shapes
//! covering a configurable share (95%) of recent tasks.

use crate::cluster::{DevReq, MAX_NODE_DEVICES, ModelSet, NodeView, StaticGroup};
use std::collections::BTreeMap;
use suanli_model::DeviceKind;

/// A shape as counted for the workload profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TypicalKey {
    /// CPU.
    pub cpu_milli: u64,
    /// Milli per device (0 for CPU-only).
    pub milli: u16,
    /// Device count (0 for CPU-only).
    pub count: u32,
    /// Device kind (GPU for CPU-only, unused).
    pub kind: DeviceKind,
    /// Allowed models.
    pub models: ModelSet,
}

impl TypicalKey {
    /// From a shape's parts.
    pub fn new(cpu_milli: u64, dev: Option<DevReq>, models: ModelSet) -> Self {
        match dev {
            None => Self { cpu_milli, milli: 0, count: 0, kind: DeviceKind::Gpu, models },
            Some(d) => Self { cpu_milli, milli: d.milli, count: d.count, kind: d.kind, models },
        }
    }
}

#[derive(Debug, Clone)]
struct TypGroup {
    /// (kind, count, milli) or `None` for CPU-only shapes.
    dev: Option<(DeviceKind, u32, u16)>,
    models: ModelSet,
    /// CPU requests ascending.
    cpus: Vec<u64>,
    /// prefix[i] = sum of freq of cpus[..i].
    prefix: Vec<f64>,
    total: f64,
}

/// Key of a typical group: device part (kind, count, milli) and allowed models.
type GroupKey = (Option<(DeviceKind, u32, u16)>, ModelSet);

/// The typical workload: shapes with frequencies summing to 1.
#[derive(Debug, Clone, Default)]
pub struct Profile {
    groups: Vec<TypGroup>,
    shapes: Vec<(TypicalKey, f64)>,
    /// Devices per model id in the cluster (empty: unknown).
    supply: Vec<f64>,
}

impl Profile {
    /// Builds the profile from shape counts: shapes sorted by count (ties by key, descending),
    /// the smallest prefix whose counts reach `coverage` (e.g. 0.95) of the total is kept, and
    /// frequencies are renormalized over the kept shapes.
    pub fn from_counts(counts: &BTreeMap<TypicalKey, u64>, coverage: f64) -> Self {
        let total: u64 = counts.values().sum();
        if total == 0 {
            return Self::default();
        }
        let mut v: Vec<(TypicalKey, u64)> = counts.iter().map(|(k, c)| (*k, *c)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(b.0.cmp(&a.0)));
        let expected = coverage.clamp(0.0, 1.0) * total as f64;
        let mut cum = 0u64;
        let mut kept = Vec::new();
        for (k, c) in v {
            if (cum as f64) >= expected && !kept.is_empty() {
                break;
            }
            cum += c;
            kept.push((k, c));
        }
        let shapes: Vec<(TypicalKey, f64)> = kept.iter().map(|(k, c)| (*k, *c as f64 / cum as f64)).collect();
        let mut by_group: BTreeMap<GroupKey, Vec<(u64, f64)>> = BTreeMap::new();
        for (k, f) in &shapes {
            let dev = (k.count > 0 && k.milli > 0).then_some((k.kind, k.count, k.milli));
            by_group.entry((dev, if dev.is_some() { k.models } else { 0 })).or_default().push((k.cpu_milli, *f));
        }
        let groups = by_group
            .into_iter()
            .map(|((dev, models), mut items)| {
                items.sort_by_key(|i| i.0);
                let mut prefix = Vec::with_capacity(items.len() + 1);
                let mut acc = 0.0;
                prefix.push(0.0);
                for (_, f) in &items {
                    acc += f;
                    prefix.push(acc);
                }
                TypGroup { dev, models, cpus: items.iter().map(|i| i.0).collect(), prefix, total: acc }
            })
            .collect();
        Self { groups, shapes, supply: Vec::new() }
    }

    /// Records how many devices of each model id the cluster has, for [`Self::model_pressure`].
    pub fn set_supply(&mut self, supply: Vec<f64>) {
        self.supply = supply;
    }

    /// True when there is no workload to measure against.
    pub fn is_empty(&self) -> bool {
        self.shapes.is_empty()
    }

    /// Per model id, how much the typical shapes that are limited to some models ask of it,
    /// relative to its share of the cluster's devices: the frequency x devices asked, shared
    /// evenly among the models each shape allows, divided by the model's share of all devices
    /// (when [`Self::set_supply`] gave it; else the raw demand). Shapes that accept any model
    /// add nothing. A value of 1 or more means constrained work alone asks at least the model's
    /// share of the work: the model is contended.
    pub fn model_pressure(&self) -> Vec<f64> {
        let mut p = vec![0.0; 128];
        for (k, f) in &self.shapes {
            if k.count == 0 || k.models == crate::cluster::ALL_MODELS || k.models == 0 {
                continue;
            }
            let n = f64::from(k.models.count_ones());
            let dev = f64::from(k.count) * f64::from(k.milli) / 1000.0;
            for (m, v) in p.iter_mut().enumerate() {
                if k.models & (1u128 << m) != 0 {
                    *v += f * dev / n;
                }
            }
        }
        // Relative to the model's share of the cluster's devices, when known.
        let total: f64 = self.supply.iter().sum();
        if total > 0.0 {
            for (m, v) in p.iter_mut().enumerate() {
                let share = self.supply.get(m).copied().unwrap_or(0.0) / total;
                *v = if share > 0.0 { *v / share } else { 0.0 };
            }
        }
        p
    }

    /// The kept shapes and their frequencies.
    pub fn shapes(&self) -> &[(TypicalKey, f64)] {
        &self.shapes
    }

    /// Expected fragmentation of a node, in device milli (0 ..= free device milli).
    pub fn fragmentation(&self, g: &StaticGroup, n: &NodeView<'_>) -> f64 {
        // Per device kind, once: free milli ascending (unhealthy devices count as 0), prefix
        // sums, and the models present. Groups whose model set covers every model of that
        // kind on the node are answered by binary search; others walk the devices.
        let mut per_kind: [Option<KindSummary>; 2] = [None, None];
        let mut f = 0.0;
        for grp in &self.groups {
            match grp.dev {
                None => {
                    let mut l = 0u64;
                    for k in [DeviceKind::Gpu, DeviceKind::Npu] {
                        l += summary(&mut per_kind, k, g, n).total();
                    }
                    f += grp.total * l as f64;
                }
                Some((kind, count, milli)) => {
                    let sum = summary(&mut per_kind, kind, g, n);
                    let l_kind = sum.total();
                    if l_kind == 0 {
                        continue;
                    }
                    let (any, cnt, q3) = if grp.models & sum.models == sum.models {
                        let pp = sum.sorted[..sum.len].partition_point(|&a| a < u32::from(milli));
                        (sum.healthy > 0, (sum.len - pp) as u32, sum.prefix[pp])
                    } else {
                        let (mut q3, mut cnt, mut any) = (0u64, 0u32, false);
                        for (d, st) in g.devs.iter().zip(n.devs) {
                            if d.kind != kind {
                                continue;
                            }
                            let a = st.avail();
                            if st.healthy && grp.models & (1u128 << d.model) != 0 {
                                any = true;
                                if a >= u32::from(milli) {
                                    cnt += 1;
                                } else {
                                    q3 += u64::from(a);
                                }
                            } else {
                                q3 += u64::from(a);
                            }
                        }
                        (any, cnt, q3)
                    };
                    if !any || cnt < count {
                        f += grp.total * l_kind as f64;
                    } else {
                        let ok = grp.cpus.partition_point(|&c| c <= n.cpu_free);
                        let w_ok = grp.prefix[ok];
                        f += w_ok * q3 as f64 + (grp.total - w_ok) * l_kind as f64;
                    }
                }
            }
        }
        f
    }
}

/// Free milli of one device kind on one node, sorted, with prefix sums.
struct KindSummary {
    sorted: [u32; MAX_NODE_DEVICES],
    prefix: [u64; MAX_NODE_DEVICES + 1],
    len: usize,
    healthy: usize,
    models: ModelSet,
}

impl KindSummary {
    fn total(&self) -> u64 {
        self.prefix[self.len]
    }
}

fn summary<'a>(
    cache: &'a mut [Option<KindSummary>; 2],
    kind: DeviceKind,
    g: &StaticGroup,
    n: &NodeView<'_>,
) -> &'a KindSummary {
    let slot = match kind {
        DeviceKind::Gpu => 0,
        DeviceKind::Npu => 1,
    };
    cache[slot].get_or_insert_with(|| {
        let mut s = KindSummary {
            sorted: [0; MAX_NODE_DEVICES],
            prefix: [0; MAX_NODE_DEVICES + 1],
            len: 0,
            healthy: 0,
            models: 0,
        };
        for (d, st) in g.devs.iter().zip(n.devs) {
            if d.kind == kind && s.len < MAX_NODE_DEVICES {
                s.sorted[s.len] = st.avail();
                s.len += 1;
                if st.healthy {
                    s.healthy += 1;
                    s.models |= 1u128 << d.model;
                }
            }
        }
        s.sorted[..s.len].sort_unstable();
        for i in 0..s.len {
            s.prefix[i + 1] = s.prefix[i] + u64::from(s.sorted[i]);
        }
        s
    })
}
