//! The resource vector used for quotas, fair share and accounting.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Add, AddAssign};

/// Amounts of the four resource dimensions that quotas and fair share are defined over.
/// Device amounts are in milli-devices (1000 = one whole device), so fractional GPUs count
/// exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, Hash)]
#[serde(default)]
pub struct ResVec {
    /// CPU in milli-cores.
    pub cpu_milli: u64,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// GPUs in milli-devices.
    pub gpu_milli: u64,
    /// NPUs in milli-devices.
    pub npu_milli: u64,
}

impl ResVec {
    /// The zero vector.
    pub const ZERO: ResVec = ResVec { cpu_milli: 0, memory_mib: 0, gpu_milli: 0, npu_milli: 0 };
    /// A vector with every dimension unbounded (used for "no limit").
    pub const MAX: ResVec =
        ResVec { cpu_milli: u64::MAX, memory_mib: u64::MAX, gpu_milli: u64::MAX, npu_milli: u64::MAX };

    /// The dimensions as an array, in a fixed order: cpu, memory, gpu, npu.
    pub fn dims(&self) -> [u64; 4] {
        [self.cpu_milli, self.memory_mib, self.gpu_milli, self.npu_milli]
    }

    /// Builds a vector from [`ResVec::dims`] order.
    pub fn from_dims(d: [u64; 4]) -> Self {
        Self { cpu_milli: d[0], memory_mib: d[1], gpu_milli: d[2], npu_milli: d[3] }
    }

    /// Names of the dimensions, in [`ResVec::dims`] order.
    pub const DIM_NAMES: [&'static str; 4] = ["cpu_milli", "memory_mib", "gpu_milli", "npu_milli"];

    /// Component-wise saturating subtraction.
    pub fn saturating_sub(&self, o: &ResVec) -> ResVec {
        let (a, b) = (self.dims(), o.dims());
        ResVec::from_dims(std::array::from_fn(|i| a[i].saturating_sub(b[i])))
    }

    /// Component-wise saturating addition.
    pub fn saturating_add(&self, o: &ResVec) -> ResVec {
        let (a, b) = (self.dims(), o.dims());
        ResVec::from_dims(std::array::from_fn(|i| a[i].saturating_add(b[i])))
    }

    /// Component-wise minimum.
    pub fn min(&self, o: &ResVec) -> ResVec {
        let (a, b) = (self.dims(), o.dims());
        ResVec::from_dims(std::array::from_fn(|i| a[i].min(b[i])))
    }

    /// True when every dimension of `self` is at most the same dimension of `o`.
    pub fn fits_within(&self, o: &ResVec) -> bool {
        let (a, b) = (self.dims(), o.dims());
        (0..4).all(|i| a[i] <= b[i])
    }

    /// The first dimension in which `self` exceeds `o`, if any.
    pub fn first_exceeding(&self, o: &ResVec) -> Option<&'static str> {
        let (a, b) = (self.dims(), o.dims());
        (0..4).find(|&i| a[i] > b[i]).map(|i| Self::DIM_NAMES[i])
    }

    /// The dominant share of `self` against `total`: the largest fraction over the dimensions
    /// the total has (DRF). Dimensions the total lacks are ignored.
    pub fn dominant_share(&self, total: &ResVec) -> f64 {
        let (a, t) = (self.dims(), total.dims());
        (0..4).filter(|&i| t[i] > 0).map(|i| a[i] as f64 / t[i] as f64).fold(0.0, f64::max)
    }

    /// True when all dimensions are zero.
    pub fn is_zero(&self) -> bool {
        self.dims().iter().all(|&d| d == 0)
    }
}

impl Add for ResVec {
    type Output = ResVec;
    fn add(self, o: ResVec) -> ResVec {
        self.saturating_add(&o)
    }
}

impl AddAssign for ResVec {
    fn add_assign(&mut self, o: ResVec) {
        *self = self.saturating_add(&o);
    }
}

impl fmt::Display for ResVec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cpu={}m mem={}Mi gpu={}m npu={}m", self.cpu_milli, self.memory_mib, self.gpu_milli, self.npu_milli)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dominant_share_picks_the_largest_fraction() {
        let total = ResVec { cpu_milli: 100_000, memory_mib: 1000, gpu_milli: 8000, npu_milli: 0 };
        let used = ResVec { cpu_milli: 10_000, memory_mib: 100, gpu_milli: 4000, npu_milli: 0 };
        assert!((used.dominant_share(&total) - 0.5).abs() < 1e-12);
        assert_eq!(used.first_exceeding(&total), None);
        assert_eq!(total.first_exceeding(&used), Some("cpu_milli"));
    }
}
