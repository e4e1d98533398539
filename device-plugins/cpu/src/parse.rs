//! Pure parsers for the /proc, sysfs and cgroup files the CPU plugin reads.
//!
//! Every function takes the file's text (and the path, for messages) and returns data or a
//! [`ParseError`] naming the file and the line; none of them touches the file system or panics,
//! so the unit tests feed them fixtures copied from real machines.

use std::collections::BTreeSet;
use std::fmt;

/// The most logical CPUs a cpulist may name (Linux's own NR_CPUS maximum is 8192).
pub const MAX_CPUS: u32 = 65_536;

/// A malformed line in a /proc, sysfs or cgroup file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// The file, e.g. `/proc/cpuinfo`.
    pub file: String,
    /// The 1-based line (0 when the problem is the file as a whole).
    pub line: usize,
    /// What is wrong, and what was expected.
    pub message: String,
}

impl ParseError {
    fn new(file: &str, line: usize, message: impl Into<String>) -> Self {
        Self { file: file.to_string(), line, message: message.into() }
    }
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file, self.message)
        } else {
            write!(f, "{} line {}: {}", self.file, self.line, self.message)
        }
    }
}

impl std::error::Error for ParseError {}

/// Sockets, physical cores and logical CPUs, from /proc/cpuinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuTopology {
    /// Distinct `physical id` values (1 when the file has none, e.g. on many ARM kernels).
    pub sockets: u32,
    /// Distinct (`physical id`, `core id`) pairs (the logical CPU count when the file has no core ids).
    pub cores: u32,
    /// `processor` entries.
    pub logical: u32,
}

/// Parses /proc/cpuinfo: blocks of `key : value` lines, one block per logical CPU.
pub fn parse_cpuinfo(text: &str, file: &str) -> Result<CpuTopology, ParseError> {
    let mut processors = BTreeSet::new();
    let mut sockets = BTreeSet::new();
    let mut cores = BTreeSet::new();
    // The block being read: (processor, physical id, core id).
    let mut cur: (Option<u32>, Option<u32>, Option<u32>) = (None, None, None);
    let mut flush = |cur: &mut (Option<u32>, Option<u32>, Option<u32>)| {
        if let Some(p) = cur.0 {
            processors.insert(p);
            if let Some(s) = cur.1 {
                sockets.insert(s);
                if let Some(c) = cur.2 {
                    cores.insert((s, c));
                }
            }
        }
        *cur = (None, None, None);
    };
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            flush(&mut cur);
            continue;
        }
        let Some((key, value)) = line.split_once(':') else {
            // Some architectures print free-form lines; only the keys below matter.
            continue;
        };
        let key = key.trim();
        let value = value.trim();
        if !matches!(key, "processor" | "physical id" | "core id") {
            continue;
        }
        let v: u32 = value
            .parse()
            .map_err(|_| ParseError::new(file, n, format!("`{key}` is {value:?}, expected a non-negative integer")))?;
        match key {
            "processor" => {
                if cur.0.is_some() {
                    // A new processor without a blank line in between: close the previous block.
                    flush(&mut cur);
                }
                cur.0 = Some(v);
            }
            "physical id" => cur.1 = Some(v),
            _ => cur.2 = Some(v),
        }
    }
    flush(&mut cur);
    if processors.is_empty() {
        return Err(ParseError::new(file, 0, "no `processor` entries"));
    }
    let logical = count_u32(processors.len(), file)?;
    let sockets = if sockets.is_empty() { 1 } else { count_u32(sockets.len(), file)? };
    let cores = if cores.is_empty() { logical } else { count_u32(cores.len(), file)? };
    Ok(CpuTopology { sockets, cores, logical })
}

fn count_u32(n: usize, file: &str) -> Result<u32, ParseError> {
    u32::try_from(n)
        .ok()
        .filter(|&n| n <= MAX_CPUS)
        .ok_or_else(|| ParseError::new(file, 0, format!("{n} CPUs, more than the limit of {MAX_CPUS}")))
}

/// Parses a kernel cpulist such as `0-15,32-47` (also `0-63:2/4` stride form is refused clearly).
/// An empty list (a memory-only NUMA node) is valid.
pub fn parse_cpulist(text: &str, file: &str) -> Result<BTreeSet<u32>, ParseError> {
    let mut cpus = BTreeSet::new();
    let s = text.trim();
    if s.is_empty() {
        return Ok(cpus);
    }
    for part in s.split(',') {
        let part = part.trim();
        let bad = || ParseError::new(file, 1, format!("cpulist item {part:?} is not `N` or `N-M`"));
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().map_err(|_| bad())?, b.parse::<u32>().map_err(|_| bad())?),
            None => {
                let v = part.parse::<u32>().map_err(|_| bad())?;
                (v, v)
            }
        };
        if lo > hi {
            return Err(ParseError::new(file, 1, format!("cpulist range {part:?} runs backwards")));
        }
        if hi >= MAX_CPUS {
            return Err(ParseError::new(file, 1, format!("CPU {hi} is beyond the limit of {MAX_CPUS} CPUs")));
        }
        cpus.extend(lo..=hi);
    }
    Ok(cpus)
}

/// Formats CPUs back into the kernel's cpulist form (`0-3,8`).
pub fn format_cpulist(cpus: &BTreeSet<u32>) -> String {
    let mut out = Vec::new();
    let mut it = cpus.iter().copied().peekable();
    while let Some(start) = it.next() {
        let mut end = start;
        while it.peek() == Some(&(end + 1)) {
            end += 1;
            it.next();
        }
        out.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
    }
    out.join(",")
}

/// Reads `MemTotal` in KiB from /proc/meminfo (`MemTotal:  16384 kB`) or a NUMA node's meminfo
/// (`Node 0 MemTotal:  16384 kB`).
pub fn parse_meminfo_total_kib(text: &str, file: &str) -> Result<u64, ParseError> {
    for (i, line) in text.lines().enumerate() {
        let Some((key, value)) = line.split_once(':') else { continue };
        if key.trim() != "MemTotal" && !key.trim_end().ends_with(" MemTotal") {
            continue;
        }
        let mut words = value.split_whitespace();
        let num = words.next().unwrap_or("");
        let unit = words.next().unwrap_or("kB");
        let v: u64 = num
            .parse()
            .map_err(|_| ParseError::new(file, i + 1, format!("MemTotal is {num:?}, expected a number of kB")))?;
        if unit != "kB" {
            return Err(ParseError::new(file, i + 1, format!("MemTotal unit is {unit:?}, expected kB")));
        }
        return Ok(v);
    }
    Err(ParseError::new(file, 0, "no MemTotal line"))
}

/// Jiffies from the aggregate `cpu` line of /proc/stat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuTimes {
    /// user + nice + system + irq + softirq + steal (guest time is already inside user/nice).
    pub busy: u64,
    /// idle + iowait.
    pub idle: u64,
}

/// Parses the first `cpu ` line of /proc/stat.
pub fn parse_proc_stat(text: &str, file: &str) -> Result<CpuTimes, ParseError> {
    for (i, line) in text.lines().enumerate() {
        let mut words = line.split_whitespace();
        if words.next() != Some("cpu") {
            continue;
        }
        let mut v = [0u64; 8];
        let mut n = 0;
        for (slot, w) in v.iter_mut().zip(words) {
            *slot = w
                .parse()
                .map_err(|_| ParseError::new(file, i + 1, format!("cpu field {} is {w:?}, expected jiffies", n + 1)))?;
            n += 1;
        }
        if n < 4 {
            return Err(ParseError::new(file, i + 1, format!("cpu line has {n} fields, expected at least 4")));
        }
        let [user, nice, system, idle, iowait, irq, softirq, steal] = v;
        let busy = [user, nice, system, irq, softirq, steal].iter().fold(0u64, |a, b| a.saturating_add(*b));
        return Ok(CpuTimes { busy, idle: idle.saturating_add(iowait) });
    }
    Err(ParseError::new(file, 0, "no aggregate `cpu` line"))
}

/// Busy share in percent between two samples; `prev` is zero for "since boot". Counters that run
/// backwards (a restored snapshot) count from zero.
pub fn utilization_pct(prev: CpuTimes, cur: CpuTimes) -> f64 {
    let (prev, cur) =
        if cur.busy < prev.busy || cur.idle < prev.idle { (CpuTimes::default(), cur) } else { (prev, cur) };
    let busy = cur.busy - prev.busy;
    let total = busy + (cur.idle - prev.idle);
    if total == 0 { 0.0 } else { (busy as f64 * 100.0 / total as f64).clamp(0.0, 100.0) }
}

/// `Cpus_allowed_list` of /proc/self/status: the process's affinity mask.
pub fn parse_status_cpus_allowed(text: &str, file: &str) -> Result<BTreeSet<u32>, ParseError> {
    for (i, line) in text.lines().enumerate() {
        if let Some(rest) = line.strip_prefix("Cpus_allowed_list:") {
            return parse_cpulist(rest, file).map_err(|e| ParseError { line: i + 1, ..e });
        }
    }
    Err(ParseError::new(file, 0, "no Cpus_allowed_list line"))
}

/// The cgroup paths of /proc/self/cgroup: `(v2 path, v1 cpu path, v1 memory path)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupPaths {
    /// The unified (v2) hierarchy's path (`0::/path`).
    pub unified: Option<String>,
    /// The v1 `cpu` controller's path.
    pub cpu_v1: Option<String>,
    /// The v1 `memory` controller's path.
    pub memory_v1: Option<String>,
}

/// Parses /proc/self/cgroup (`ID:CONTROLLERS:PATH` per line).
pub fn parse_proc_cgroup(text: &str, file: &str) -> Result<CgroupPaths, ParseError> {
    let mut out = CgroupPaths::default();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(ParseError::new(file, i + 1, format!("{line:?} is not `ID:CONTROLLERS:PATH`")));
        };
        if id == "0" && ctrls.is_empty() {
            out.unified = Some(path.to_string());
        }
        for c in ctrls.split(',') {
            match c {
                "cpu" => out.cpu_v1 = Some(path.to_string()),
                "memory" => out.memory_v1 = Some(path.to_string()),
                _ => {}
            }
        }
    }
    Ok(out)
}

/// cgroup v2 `cpu.max` (`max 100000` or `QUOTA PERIOD`) as millicores; `None` when unlimited.
pub fn parse_cpu_max(text: &str, file: &str) -> Result<Option<u64>, ParseError> {
    let mut words = text.split_whitespace();
    let quota = words.next().ok_or_else(|| ParseError::new(file, 1, "empty, expected `QUOTA PERIOD`"))?;
    let period = words.next().unwrap_or("100000");
    if quota == "max" {
        return Ok(None);
    }
    let bad = |w: &str| ParseError::new(file, 1, format!("{w:?} is not a number of microseconds"));
    let q: u64 = quota.parse().map_err(|_| bad(quota))?;
    let p: u64 = period.parse().map_err(|_| bad(period))?;
    quota_millis(q, p, file).map(Some)
}

/// cgroup v1 `cpu.cfs_quota_us` and `cpu.cfs_period_us` as millicores; `None` when unlimited (-1).
pub fn parse_cfs_quota(quota: &str, period: &str, file: &str) -> Result<Option<u64>, ParseError> {
    let q: i64 =
        quota.trim().parse().map_err(|_| ParseError::new(file, 1, format!("cfs quota {quota:?} is not a number")))?;
    if q < 0 {
        return Ok(None);
    }
    let p: u64 = period
        .trim()
        .parse()
        .map_err(|_| ParseError::new(file, 1, format!("cfs period {period:?} is not a number")))?;
    quota_millis(q.unsigned_abs(), p, file).map(Some)
}

fn quota_millis(quota_us: u64, period_us: u64, file: &str) -> Result<u64, ParseError> {
    if period_us == 0 {
        return Err(ParseError::new(file, 1, "period is 0, expected > 0"));
    }
    Ok(quota_us.saturating_mul(1000) / period_us)
}

/// A cgroup memory limit file (v2 `memory.max`: `max` or bytes; v1 `memory.limit_in_bytes`:
/// bytes, where a value near `i64::MAX` means unlimited) as MiB; `None` when unlimited.
pub fn parse_memory_limit(text: &str, file: &str) -> Result<Option<u64>, ParseError> {
    let t = text.trim();
    if t == "max" {
        return Ok(None);
    }
    let bytes: u64 = t.parse().map_err(|_| ParseError::new(file, 1, format!("{t:?} is not `max` or a byte count")))?;
    // v1 reports "unlimited" as PAGE_COUNTER_MAX * page size, just under i64::MAX.
    if bytes >= (1u64 << 62) {
        return Ok(None);
    }
    Ok(Some(bytes / (1024 * 1024)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod plugin_cpu_parse_tests {
    use super::*;

    const CPUINFO_2S: &str = "processor\t: 0\nvendor_id\t: GenuineIntel\nphysical id\t: 0\ncore id\t\t: 0\n\n\
processor\t: 1\nphysical id\t: 0\ncore id\t\t: 1\n\n\
processor\t: 2\nphysical id\t: 1\ncore id\t\t: 0\n\n\
processor\t: 3\nphysical id\t: 1\ncore id\t\t: 1\n\n\
processor\t: 4\nphysical id\t: 0\ncore id\t\t: 0\n\n\
processor\t: 5\nphysical id\t: 0\ncore id\t\t: 1\n\n\
processor\t: 6\nphysical id\t: 1\ncore id\t\t: 0\n\n\
processor\t: 7\nphysical id\t: 1\ncore id\t\t: 1\n";

    #[test]
    fn cpuinfo_two_sockets_with_hyperthreads() {
        let t = parse_cpuinfo(CPUINFO_2S, "/proc/cpuinfo").unwrap();
        assert_eq!(t, CpuTopology { sockets: 2, cores: 4, logical: 8 });
    }

    #[test]
    fn cpuinfo_arm_without_topology_keys() {
        let text = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\n\nprocessor\t: 1\nBogoMIPS\t: 50.00\n\n\
Hardware\t: foo\n";
        let t = parse_cpuinfo(text, "/proc/cpuinfo").unwrap();
        assert_eq!(t, CpuTopology { sockets: 1, cores: 2, logical: 2 });
    }

    #[test]
    fn cpuinfo_without_blank_lines_between_blocks() {
        let text = "processor : 0\nphysical id : 0\ncore id : 0\nprocessor : 1\nphysical id : 0\ncore id : 1\n";
        let t = parse_cpuinfo(text, "f").unwrap();
        assert_eq!(t, CpuTopology { sockets: 1, cores: 2, logical: 2 });
    }

    #[test]
    fn cpuinfo_bad_values_name_file_and_line() {
        let e = parse_cpuinfo("processor : 0\nphysical id : zero\n", "/proc/cpuinfo").unwrap_err();
        assert_eq!(e.line, 2);
        assert!(e.to_string().contains("/proc/cpuinfo line 2"), "{e}");
        assert!(e.to_string().contains("physical id"), "{e}");
        let e = parse_cpuinfo("garbage\n\n", "/proc/cpuinfo").unwrap_err();
        assert!(e.to_string().contains("no `processor`"), "{e}");
        assert!(parse_cpuinfo("", "x").is_err());
    }

    #[test]
    fn cpulists() {
        let f = "cpulist";
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n", f).unwrap().into_iter().collect::<Vec<_>>(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert!(parse_cpulist("\n", f).unwrap().is_empty());
        assert!(parse_cpulist("3-1", f).unwrap_err().message.contains("backwards"));
        assert!(parse_cpulist("0-x", f).is_err());
        assert!(parse_cpulist("0-4294967295", f).unwrap_err().message.contains("limit"));
        let set: BTreeSet<u32> = [0, 1, 2, 3, 8, 10, 11].into();
        assert_eq!(format_cpulist(&set), "0-3,8,10-11");
        assert_eq!(format_cpulist(&BTreeSet::new()), "");
    }

    #[test]
    fn meminfo() {
        let f = "/proc/meminfo";
        assert_eq!(parse_meminfo_total_kib("MemTotal:       24683584 kB\nMemFree: 1 kB\n", f).unwrap(), 24683584);
        let node = "Node 0 MemTotal:        6121208 kB\nNode 0 MemFree:         3954920 kB\n";
        assert_eq!(parse_meminfo_total_kib(node, "node0/meminfo").unwrap(), 6121208);
        assert!(parse_meminfo_total_kib("MemFree: 1 kB\n", f).unwrap_err().message.contains("no MemTotal"));
        let e = parse_meminfo_total_kib("MemTotal: lots kB\n", f).unwrap_err();
        assert_eq!((e.line, e.file.as_str()), (1, f));
        assert!(parse_meminfo_total_kib("MemTotal: 5 MB\n", f).is_err());
    }

    #[test]
    fn proc_stat_and_utilization() {
        let f = "/proc/stat";
        let a = parse_proc_stat("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n", f).unwrap();
        assert_eq!(a, CpuTimes { busy: 150, idle: 850 });
        let b = parse_proc_stat("cpu  200 0 100 850 50 0 0 0 0 0\n", f).unwrap();
        assert!((utilization_pct(a, b) - 75.0).abs() < 1e-9);
        assert!((utilization_pct(CpuTimes::default(), a) - 15.0).abs() < 1e-9);
        // Backwards counters count from zero rather than underflowing.
        assert!((utilization_pct(b, a) - 15.0).abs() < 1e-9);
        assert_eq!(utilization_pct(a, a), 0.0);
        // Old kernels print only four fields.
        assert_eq!(parse_proc_stat("cpu 1 2 3 4\n", f).unwrap(), CpuTimes { busy: 6, idle: 4 });
        assert!(parse_proc_stat("cpu 1 2\n", f).unwrap_err().message.contains("at least 4"));
        assert!(parse_proc_stat("cpu 1 2 x 4\n", f).unwrap_err().message.contains("field 3"));
        assert!(parse_proc_stat("intr 5\n", f).is_err());
    }

    #[test]
    fn affinity_and_cgroups() {
        let st = "Name:\tcat\nCpus_allowed:\t3\nCpus_allowed_list:\t0-1\n";
        assert_eq!(parse_status_cpus_allowed(st, "status").unwrap().len(), 2);
        let e = parse_status_cpus_allowed("Name: x\nCpus_allowed_list:\tz\n", "status").unwrap_err();
        assert_eq!(e.line, 2);

        let v1 = "9:name=systemd:/\n4:memory:/job/a\n2:cpu,cpuacct:/job\n0::/\n";
        let p = parse_proc_cgroup(v1, "cgroup").unwrap();
        assert_eq!(p.unified.as_deref(), Some("/"));
        assert_eq!(p.cpu_v1.as_deref(), Some("/job"));
        assert_eq!(p.memory_v1.as_deref(), Some("/job/a"));
        assert!(parse_proc_cgroup("nonsense\n", "cgroup").is_err());

        assert_eq!(parse_cpu_max("max 100000\n", "cpu.max").unwrap(), None);
        assert_eq!(parse_cpu_max("250000 100000\n", "cpu.max").unwrap(), Some(2500));
        assert!(parse_cpu_max("1 0\n", "cpu.max").unwrap_err().message.contains("period is 0"));
        assert!(parse_cpu_max("", "cpu.max").is_err());
        assert_eq!(parse_cfs_quota("-1\n", "100000\n", "q").unwrap(), None);
        assert_eq!(parse_cfs_quota("50000\n", "100000\n", "q").unwrap(), Some(500));

        assert_eq!(parse_memory_limit("max\n", "memory.max").unwrap(), None);
        assert_eq!(parse_memory_limit("9223372036854771712\n", "limit").unwrap(), None);
        assert_eq!(parse_memory_limit("1073741824\n", "limit").unwrap(), Some(1024));
        assert!(parse_memory_limit("lots\n", "limit").is_err());
    }
}
