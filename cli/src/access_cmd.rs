//! `suanli whoami`, `suanli token create|revoke|list` and `suanli audit`: identities, bearer
//! tokens and the audit log (docs/security.md), over the `Access` service.

use crate::client::render::{dash, fields, print_json, table};
use crate::client::{ConnArgs, Output, parse_duration_s};
use anyhow::Context;
use clap::{Args, Subcommand};
use serde_json::json;
use suanli_client::Connection;

/// `suanli whoami`.
#[derive(Args, Debug)]
pub struct WhoamiArgs {
    #[command(flatten)]
    conn: ConnArgs,
}

/// `suanli token ...`.
#[derive(Args, Debug)]
pub struct TokenArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(subcommand)]
    cmd: TokenCmd,
}

/// Token commands.
#[derive(Subcommand, Debug)]
pub enum TokenCmd {
    /// Create a bearer token; it is printed once (the cluster keeps only its id and claims).
    Create {
        /// The user the token stands for (1-253 of letters, digits, `.`, `_`, `-`).
        #[arg(long)]
        name: String,
        /// Its role: admin, operator, member or viewer.
        #[arg(long)]
        role: String,
        /// Its team (required for members).
        #[arg(long, default_value = "")]
        team: String,
        /// Its lifetime: 45s, 90m, 12h, 30d (at most the servers' max_token_ttl_s).
        #[arg(long, default_value = "30d", value_parser = parse_duration_s)]
        ttl: u64,
    },
    /// Revoke a token by id (it is refused everywhere from then on).
    Revoke {
        /// The token's id (`token list`, or `whoami` with the token).
        id: String,
    },
    /// List the tokens issued and not yet expired, revoked ones included.
    List,
}

/// `suanli audit`.
#[derive(Args, Debug)]
pub struct AuditArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// Only calls whose caller contains this text (`alice`, `node:n1`, `token:<id>`).
    #[arg(long, default_value = "")]
    principal: String,
    /// Only calls whose method contains this text (`Jobs/Submit`, `Nodes/`).
    #[arg(long, default_value = "")]
    method: String,
    /// Only records after this sequence number (0: from the oldest kept).
    #[arg(long, default_value_t = 0)]
    after: u64,
    /// Most records printed.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    limit: u32,
}

/// A single-threaded runtime for one command.
fn block_on<F: std::future::Future<Output = anyhow::Result<()>>>(f: F) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting tokio")?.block_on(f)
}

/// `t` (seconds since the Unix epoch) as `YYYY-MM-DD hh:mm:ss UTC`.
pub fn utc(t: u64) -> String {
    let (days, secs) = (t / 86_400, t % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", secs / 3600, secs % 3600 / 60, secs % 60)
}

impl WhoamiArgs {
    /// Runs it.
    pub fn run(self) -> anyhow::Result<()> {
        block_on(async move {
            let conn = self.conn.connect()?;
            let r = conn.whoami().await?;
            match self.conn.output {
                Output::Json => print_json(&r),
                Output::Table => {
                    let mut kv = vec![("principal", r.principal.clone()), ("kind", r.kind.clone())];
                    if !r.name.is_empty() {
                        kv.push(("name", r.name.clone()));
                    }
                    if !r.role.is_empty() {
                        kv.push(("role", r.role.clone()));
                        kv.push(("team", dash(&r.team)));
                    }
                    if !r.token_id.is_empty() {
                        kv.push(("token", r.token_id.clone()));
                    }
                    println!("{}", fields(&kv));
                    Ok(())
                }
            }
        })
    }
}

impl TokenArgs {
    /// Runs it.
    pub fn run(self) -> anyhow::Result<()> {
        block_on(async move {
            let conn = self.conn.connect()?;
            token(&conn, self.conn.output, self.cmd).await
        })
    }
}

async fn token(conn: &Connection, out: Output, cmd: TokenCmd) -> anyhow::Result<()> {
    match cmd {
        TokenCmd::Create { name, role, team, ttl } => {
            let r = conn.create_token(&name, &role, &team, ttl).await?;
            match out {
                Output::Json => print_json(&r),
                Output::Table => {
                    println!("{}", r.token);
                    eprintln!(
                        "token {} for {name} ({role}{}) expires {}; it is shown only now: keep it secret",
                        r.id,
                        if team.is_empty() { String::new() } else { format!(", team {team}") },
                        utc(r.expires_at)
                    );
                    Ok(())
                }
            }
        }
        TokenCmd::Revoke { id } => {
            let index = conn.revoke_token(&id).await?;
            match out {
                Output::Json => print_json(&json!({"revoked": id, "index": index})),
                Output::Table => {
                    println!("token {id} revoked (log index {index})");
                    Ok(())
                }
            }
        }
        TokenCmd::List => {
            let tokens = conn.list_tokens().await?;
            match out {
                Output::Json => print_json(&tokens),
                Output::Table => {
                    let rows: Vec<Vec<String>> = tokens
                        .iter()
                        .map(|t| {
                            vec![
                                t.id.clone(),
                                t.name.clone(),
                                t.role.clone(),
                                dash(&t.team),
                                utc(t.issued_at),
                                utc(t.expires_at),
                                if t.revoked { "revoked".into() } else { "-".into() },
                                t.created_by.clone(),
                            ]
                        })
                        .collect();
                    let h = ["ID", "NAME", "ROLE", "TEAM", "ISSUED", "EXPIRES", "REVOKED", "CREATED BY"];
                    println!("{}", table(&h, &rows));
                    Ok(())
                }
            }
        }
    }
}

impl AuditArgs {
    /// Runs it.
    pub fn run(self) -> anyhow::Result<()> {
        block_on(async move {
            let conn = self.conn.connect()?;
            let (records, next) = conn.audit(self.after, &self.principal, &self.method, self.limit).await?;
            match self.conn.output {
                Output::Json => print_json(&json!({"records": records, "next_after_seq": next})),
                Output::Table => {
                    let rows: Vec<Vec<String>> = records
                        .iter()
                        .map(|r| {
                            vec![
                                r.seq.to_string(),
                                utc(r.at_ms / 1000),
                                r.principal.clone(),
                                r.method.clone(),
                                dash(&r.target),
                                r.code.clone(),
                                dash(&r.message),
                            ]
                        })
                        .collect();
                    let h = ["SEQ", "TIME", "PRINCIPAL", "METHOD", "TARGET", "CODE", "MESSAGE"];
                    println!("{}", table(&h, &rows));
                    if next != 0 {
                        eprintln!("more records follow: --after {next}");
                    }
                    Ok(())
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_written_as_utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_796_428_799), "2026-12-04 23:59:59 UTC");
    }

    #[test]
    fn token_lifetimes_take_units() {
        assert_eq!(parse_duration_s("30d"), Ok(30 * 86_400));
        assert_eq!(parse_duration_s("12h"), Ok(12 * 3_600));
        assert_eq!(parse_duration_s("90m"), Ok(90 * 60));
        assert_eq!(parse_duration_s("45s"), Ok(45));
        assert!(parse_duration_s("1y").is_err());
    }
}
