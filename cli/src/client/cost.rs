//! `suanli cost report|prices`: the cost ledger (docs/cost.md), over the `Cost` service.

use super::render::{print_json, table};
use super::{ConnArgs, Output, parse_duration_s};
use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use std::path::PathBuf;
use suanli_client::pb;

/// `suanli cost ...`.
#[derive(Args, Debug)]
pub struct CostArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(subcommand)]
    cmd: CostCmd,
}

/// Report formats.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Aligned plain text.
    Table,
    /// One JSON document (amounts as decimal strings, and exact base units).
    Json,
    /// Comma-separated values with a header line.
    Csv,
}

/// Cost commands.
#[derive(Subcommand, Debug)]
pub enum CostCmd {
    /// What capacity cost, grouped, split into useful, lost_preemption, lost_failure,
    /// running and idle; the total equals capacity x time x price.
    Report {
        /// Group by team, queue, job or pool.
        #[arg(long, default_value = "team")]
        by: String,
        /// Window start: seconds since the epoch, RFC 3339 (2026-12-05T10:00:00Z), or a
        /// duration back from now (-24h, -30m). Default: open.
        #[arg(long, allow_hyphen_values = true)]
        since: Option<String>,
        /// Window end, in the same forms. Default: now.
        #[arg(long, allow_hyphen_values = true)]
        until: Option<String>,
        /// table, json or csv (default: json with --output json, else table).
        #[arg(long, value_enum)]
        format: Option<Format>,
    },
    /// The price catalog.
    #[command(subcommand)]
    Prices(PricesCmd),
}

/// Price commands.
#[derive(Subcommand, Debug)]
pub enum PricesCmd {
    /// Replace the catalog from a TOML file (examples/prices.toml).
    Set {
        /// The prices file.
        #[arg(long)]
        file: PathBuf,
    },
    /// Show the catalog and the device models without a price.
    Show,
}

/// A prices file.
#[derive(serde::Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct PricesFile {
    #[serde(default)]
    currency: String,
    #[serde(default)]
    cpu_core_hour: Option<toml::Value>,
    #[serde(default)]
    memory_gib_hour: Option<toml::Value>,
    #[serde(default)]
    device: Vec<DeviceEntry>,
}

#[derive(serde::Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct DeviceEntry {
    model: String,
    #[serde(default)]
    pool: String,
    #[serde(default)]
    region: String,
    per_hour: toml::Value,
}

/// A price in a file: a string ("2.5") or a number (2.5), kept as written.
fn price_text(field: &str, v: &toml::Value) -> anyhow::Result<String> {
    match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(format!("{f}")),
        other => anyhow::bail!("{field}: expected a decimal price, got {other}"),
    }
}

/// Loads a prices file into its wire form (the server checks every bound).
pub fn load_prices(path: &std::path::Path) -> anyhow::Result<pb::PriceCatalogInfo> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let f: PricesFile = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let opt = |field: &str, v: &Option<toml::Value>| v.as_ref().map_or(Ok(String::new()), |v| price_text(field, v));
    let mut devices = Vec::with_capacity(f.device.len());
    for (i, d) in f.device.iter().enumerate() {
        devices.push(pb::DevicePriceInfo {
            model: d.model.clone(),
            pool: d.pool.clone(),
            region: d.region.clone(),
            per_hour: price_text(&format!("device[{i}].per_hour"), &d.per_hour)?,
        });
    }
    Ok(pb::PriceCatalogInfo {
        currency: f.currency,
        devices,
        cpu_core_hour: opt("cpu_core_hour", &f.cpu_core_hour)?,
        memory_gib_hour: opt("memory_gib_hour", &f.memory_gib_hour)?,
    })
}

/// A time for `--since`/`--until`: seconds since the epoch, RFC 3339, or `-DURATION` back
/// from `now`.
pub fn parse_time(s: &str, now: u64) -> Result<u64, String> {
    let s = s.trim();
    if let Some(d) = s.strip_prefix('-') {
        return Ok(now.saturating_sub(parse_duration_s(d)?));
    }
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()) {
        return s.parse().map_err(|_| format!("{s:?} is too large"));
    }
    rfc3339(s)
        .ok_or_else(|| format!("{s:?}: expected seconds since the epoch, RFC 3339 (2026-12-05T10:00:00Z) or -24h"))
}

/// `YYYY-MM-DDThh:mm:ss[.frac](Z|±hh:mm)` as seconds since the epoch.
fn rfc3339(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> { s.get(r)?.parse().ok() };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if b[13] != b':'
        || b[16] != b':'
        || !(1..=12).contains(&mo)
        || !(1..=31).contains(&d)
        || h > 23
        || mi > 59
        || sec > 60
    {
        return None;
    }
    let mut rest = &s[19..];
    if let Some(r) = rest.strip_prefix('.') {
        rest = r.trim_start_matches(|c: char| c.is_ascii_digit());
    }
    let offset = match rest {
        "Z" | "z" => 0,
        _ => {
            let sign = match rest.as_bytes().first()? {
                b'+' => 1,
                b'-' => -1,
                _ => return None,
            };
            let (oh, om) = rest.get(1..)?.split_once(':')?;
            sign * (oh.parse::<i64>().ok()? * 3600 + om.parse::<i64>().ok()? * 60)
        }
    };
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days * 86_400 + h * 3600 + mi * 60 + sec - offset).ok()
}

fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn cols(a: Option<&pb::CostAmounts>) -> Vec<String> {
    let a = a.cloned().unwrap_or_default();
    vec![a.useful, a.lost_preemption, a.lost_failure, a.running, a.idle, a.total]
}

const HEADERS: [&str; 7] = ["KEY", "USEFUL", "LOST_PREEMPTION", "LOST_FAILURE", "RUNNING", "IDLE", "TOTAL"];

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_owned() }
}

impl CostArgs {
    /// Runs the command on a single-threaded runtime.
    pub fn run(self) -> anyhow::Result<()> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting tokio")?
            .block_on(self.run_async())
    }

    async fn run_async(self) -> anyhow::Result<()> {
        let out = self.conn.output;
        match self.cmd {
            CostCmd::Prices(PricesCmd::Set { file }) => {
                let catalog = load_prices(&file)?;
                let conn = self.conn.connect()?;
                let index = conn.set_prices(catalog).await?;
                match out {
                    Output::Json => print_json(&serde_json::json!({"prices_set": true, "index": index})),
                    Output::Table => {
                        println!("prices set (log index {index})");
                        Ok(())
                    }
                }
            }
            CostCmd::Prices(PricesCmd::Show) => {
                let conn = self.conn.connect()?;
                let p = conn.get_prices().await?;
                match out {
                    Output::Json => print_json(&p),
                    Output::Table => {
                        let c = p.catalog.unwrap_or_default();
                        println!("currency: {}", if c.currency.is_empty() { "-" } else { &c.currency });
                        println!("cpu core-hour: {}", c.cpu_core_hour);
                        println!("memory GiB-hour: {}", c.memory_gib_hour);
                        let rows: Vec<Vec<String>> = c
                            .devices
                            .iter()
                            .map(|d| vec![d.model.clone(), d.pool.clone(), d.region.clone(), d.per_hour.clone()])
                            .collect();
                        print!("{}", table(&["MODEL", "POOL", "REGION", "PER_HOUR"], &rows));
                        if !p.unpriced_models.is_empty() {
                            println!("unpriced models (cost 0): {}", p.unpriced_models.join(", "));
                        }
                        Ok(())
                    }
                }
            }
            CostCmd::Report { by, since, until, format } => {
                let now = now_s();
                let t = |flag: &str, v: &Option<String>| -> anyhow::Result<u64> {
                    v.as_deref().map_or(Ok(0), |s| parse_time(s, now).map_err(|e| anyhow::anyhow!("--{flag}: {e}")))
                };
                let (since, until) = (t("since", &since)?, t("until", &until)?);
                let conn = self.conn.connect()?;
                let r = conn.cost_report(&by, since, until).await?;
                let format = format.unwrap_or(if out == Output::Json { Format::Json } else { Format::Table });
                print_report(&r, format)
            }
        }
    }
}

/// Prints a cost report (a region's, or the federation's roll-up) as a table, JSON or CSV.
pub(crate) fn print_report(r: &pb::CostReportResponse, format: Format) -> anyhow::Result<()> {
    match format {
        Format::Json => print_json(r),
        Format::Csv => {
            println!("{}", HEADERS.map(|h| h.to_ascii_lowercase()).join(","));
            for row in r.rows.iter().chain(r.total.iter()) {
                let mut c = vec![csv_field(&row.key)];
                c.extend(cols(row.amounts.as_ref()));
                println!("{}", c.join(","));
            }
            Ok(())
        }
        Format::Table => {
            let mut rows: Vec<Vec<String>> = r
                .rows
                .iter()
                .chain(r.total.iter())
                .map(|row| {
                    let mut c = vec![row.key.clone()];
                    c.extend(cols(row.amounts.as_ref()));
                    c
                })
                .collect();
            let mut cap = vec!["capacity".to_owned()];
            cap.extend(std::iter::repeat_n(String::new(), HEADERS.len() - 2));
            cap.push(r.capacity.clone());
            rows.push(cap);
            print!("{}", table(&HEADERS, &rows));
            println!(
                "window {}..{} by {}{}{}",
                r.since,
                r.until,
                r.by,
                if r.currency.is_empty() { String::new() } else { format!(", {}", r.currency) },
                if r.horizon > 0 { format!(", only totals before {}", r.horizon) } else { String::new() }
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times() {
        assert_eq!(parse_time("1700000000", 0), Ok(1_700_000_000));
        assert_eq!(parse_time("-1h", 10_000), Ok(6_400));
        assert_eq!(parse_time("1970-01-01T00:00:00Z", 0), Ok(0));
        assert_eq!(parse_time("2026-12-05T10:00:00Z", 0), Ok(1_796_464_800));
        assert_eq!(parse_time("2026-12-05T12:00:00+02:00", 0), Ok(1_796_464_800));
        assert!(parse_time("yesterday", 0).is_err());
    }
}
