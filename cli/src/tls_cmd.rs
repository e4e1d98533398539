//! `suanli tls init DIR` and `suanli tls issue DIR`: a development CA and the certificates a
//! cluster needs (docs/tls.md). The files are suanli-security's `certs` layout; each file
//! written is printed, one path a line.

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use std::path::{Path, PathBuf};
use std::time::Duration;
use suanli_security::certs::{self, Leaf};
use suanli_security::principal::{Credential, valid_name};
use suanli_security::{Principal, Role};

/// The longest validity `--days` accepts (100 years, as `certs` does).
const MAX_DAYS: u64 = certs::MAX_VALIDITY.as_secs() / 86400;

/// `suanli tls`.
#[derive(Args, Debug)]
pub struct TlsArgs {
    #[command(subcommand)]
    cmd: TlsCmd,
}

#[derive(Subcommand, Debug)]
enum TlsCmd {
    /// Make a development CA in DIR and the server and admin certificates (plus any nodes and
    /// users asked for). Refuses a DIR that already holds a CA.
    Init(InitArgs),
    /// Issue (or re-issue, to rotate) one certificate from the CA in DIR; a running process
    /// picks the new files up by itself (file change or SIGHUP).
    Issue(IssueArgs),
}

#[derive(Args, Debug)]
struct InitArgs {
    /// The directory to create (mode 0700) or fill.
    dir: PathBuf,
    /// A DNS name or IP address the server and node certificates are valid for (repeatable;
    /// default: localhost, 127.0.0.1, ::1 and this machine's hostname).
    #[arg(long = "host", value_name = "H")]
    hosts: Vec<String>,
    /// A node certificate to write too (`node-<ID>.pem`; repeatable).
    #[arg(long = "node", value_name = "ID")]
    nodes: Vec<String>,
    /// A user certificate to write too (`user-<NAME>.pem`; ROLE: admin, operator, member
    /// (needs TEAM) or viewer; repeatable).
    #[arg(long = "user", value_name = "NAME:ROLE[:TEAM]")]
    users: Vec<String>,
    /// Validity of the certificates in days (the CA: at least 10 years).
    #[arg(long, value_name = "N", default_value_t = 365)]
    days: u64,
}

#[derive(Args, Debug)]
#[command(group = clap::ArgGroup::new("leaf").required(true).multiple(false).args(["server", "node", "user"]))]
struct IssueArgs {
    /// The directory holding the CA (`ca.pem`, `ca-key.pem`).
    dir: PathBuf,
    /// A server certificate (`server.pem` for the name `server`, `server-<NAME>.pem` otherwise).
    #[arg(long, value_name = "NAME")]
    server: Option<String>,
    /// A node (agent) certificate (`node-<ID>.pem`).
    #[arg(long, value_name = "ID")]
    node: Option<String>,
    /// A user certificate (`admin.pem` for admin:admin, `user-<NAME>.pem` otherwise).
    #[arg(long, value_name = "NAME:ROLE[:TEAM]")]
    user: Option<String>,
    /// A DNS name or IP address a server or node certificate is valid for (repeatable;
    /// default: localhost, 127.0.0.1, ::1 and this machine's hostname).
    #[arg(long = "host", value_name = "H")]
    hosts: Vec<String>,
    /// Validity in days.
    #[arg(long, value_name = "N", default_value_t = 365)]
    days: u64,
}

/// Runs `suanli tls ...`.
pub fn run(a: TlsArgs) -> anyhow::Result<()> {
    match a.cmd {
        TlsCmd::Init(a) => init(a),
        TlsCmd::Issue(a) => issue(a),
    }
}

fn init(a: InitArgs) -> anyhow::Result<()> {
    let validity = validity(a.days)?;
    let hosts = hosts(&a.hosts)?;
    let mut leaves = vec![
        Leaf::server("server", &hosts),
        Leaf::user(Principal::User {
            name: "admin".into(),
            role: Role::Admin,
            team: None,
            credential: Credential::Certificate,
        }),
    ];
    for id in &a.nodes {
        leaves.push(Leaf::node(&node_id("--node", id)?, &hosts));
    }
    for u in &a.users {
        let leaf = Leaf::user(parse_user(u)?);
        if leaves.iter().any(|l| l.stem == leaf.stem) {
            bail!("--user {u}: {}.pem is written already (each user once; admin:admin is always written)", leaf.stem);
        }
        leaves.push(leaf);
    }
    for id in &a.nodes {
        if a.nodes.iter().filter(|n| *n == id).count() > 1 {
            bail!("--node {id}: given twice");
        }
    }
    let written = certs::init(&a.dir, &leaves, validity).with_context(|| format!("tls init {}", a.dir.display()))?;
    for p in written {
        println!("{}", p.display());
    }
    Ok(())
}

fn issue(a: IssueArgs) -> anyhow::Result<()> {
    let validity = validity(a.days)?;
    let leaf = if let Some(name) = &a.server {
        Leaf::server(&node_id("--server", name)?, &hosts(&a.hosts)?)
    } else if let Some(id) = &a.node {
        Leaf::node(&node_id("--node", id)?, &hosts(&a.hosts)?)
    } else if let Some(u) = &a.user {
        if !a.hosts.is_empty() {
            bail!("--host: a user certificate names no hosts (only --server and --node take --host)");
        }
        Leaf::user(parse_user(u)?)
    } else {
        bail!("one of --server, --node or --user is needed");
    };
    let files = certs::issue(&a.dir, &leaf, validity).with_context(|| format!("tls issue {}", a.dir.display()))?;
    println!("{}", files.key.display());
    println!("{}", files.cert.display());
    Ok(())
}

fn validity(days: u64) -> anyhow::Result<Duration> {
    if days == 0 || days > MAX_DAYS {
        bail!("--days {days}: must be between 1 and {MAX_DAYS}");
    }
    Ok(Duration::from_secs(days * 86400))
}

/// A node id or server name, checked (`flag` names the flag in the error).
fn node_id(flag: &str, id: &str) -> anyhow::Result<String> {
    if !valid_name(id) {
        bail!(
            "{flag} {id:?}: not a valid name (1 to {} bytes of letters, digits, '.', '_', '-')",
            suanli_security::principal::MAX_IDENTITY_NAME
        );
    }
    Ok(id.to_owned())
}

/// `NAME:ROLE[:TEAM]` as a user principal.
fn parse_user(s: &str) -> anyhow::Result<Principal> {
    let parts: Vec<&str> = s.split(':').collect();
    let (name, role, team) = match parts.as_slice() {
        [name, role] => (*name, *role, None),
        [name, role, team] => (*name, *role, Some(*team)),
        _ => bail!("--user {s}: expected NAME:ROLE or NAME:ROLE:TEAM"),
    };
    if !valid_name(name) {
        bail!("--user {s}: name {name:?} is not a valid name (letters, digits, '.', '_', '-')");
    }
    let role: Role = role.parse().map_err(|e| anyhow::anyhow!("--user {s}: {e}"))?;
    if let Some(t) = team
        && !valid_name(t)
    {
        bail!("--user {s}: team {t:?} is not a valid name (letters, digits, '.', '_', '-')");
    }
    if role == Role::Member && team.is_none() {
        bail!("--user {s}: a member needs a team (NAME:member:TEAM)");
    }
    Ok(Principal::User {
        name: name.to_owned(),
        role,
        team: team.map(str::to_owned),
        credential: Credential::Certificate,
    })
}

/// The hosts given (checked), or the defaults and this machine's hostname.
fn hosts(given: &[String]) -> anyhow::Result<Vec<String>> {
    if !given.is_empty() {
        for h in given {
            certs::check_host(h).map_err(|e| anyhow::anyhow!("--host: {e}"))?;
        }
        return Ok(given.to_vec());
    }
    let mut hosts: Vec<String> = certs::DEFAULT_HOSTS.iter().map(|h| (*h).to_owned()).collect();
    if let Some(h) = hostname()
        && certs::check_host(&h).is_ok()
        && !hosts.contains(&h)
    {
        hosts.push(h);
    }
    Ok(hosts)
}

/// This machine's hostname (Linux), if it has one.
fn hostname() -> Option<String> {
    let read = |p: &Path| std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty());
    read(Path::new("/proc/sys/kernel/hostname")).or_else(|| read(Path::new("/etc/hostname")))
}
