//! The client's credentials (`--ca`, `--cert`, `--key`, `--token`, `--insecure` and their
//! `SUANLI_*` variables): which TLS material a client command dials with and which token it
//! sends. The same credentials reach the agents (`suanli job logs`).
//!
//! ```text
//!  --insecure                     plaintext (servers started --insecure); a token is still sent
//!  --ca CA --cert C --key K       mutual TLS as the certificate's holder (plus --token: the token's holder)
//!  --ca CA --token T              TLS verifying the servers, no client certificate; the token says who
//!  nothing                        $SUANLI_TLS_DIR, else ./.suanli/dev/tls (what `suanli dev` made):
//!                                 ca.pem + admin.pem + admin-key.pem (with --token: ca.pem only)
//! ```

use anyhow::{Context, bail};
use clap::Args;
use std::path::{Path, PathBuf};
use suanli_security::tls::{Tls, TlsFiles};

/// Where `suanli dev` keeps its certificates, relative to where it runs (the repository root).
pub const DEV_TLS_DIR: &str = ".suanli/dev/tls";

/// How the client proves who it is and checks the servers (each flag also read from the
/// environment variable shown).
#[derive(Args, Debug, Clone, Default)]
pub struct CredArgs {
    /// The cluster's CA certificate (PEM): the servers' certificates are verified against it.
    #[arg(long, global = true, env = "SUANLI_CA")]
    pub ca: Option<PathBuf>,
    /// This client's certificate (PEM), presented to the servers (with --key).
    #[arg(long, global = true, env = "SUANLI_CERT")]
    pub cert: Option<PathBuf>,
    /// The private key of --cert (PEM).
    #[arg(long, global = true, env = "SUANLI_KEY")]
    pub key: Option<PathBuf>,
    /// A bearer token (`suanli token create`): sent with every call, it says who the caller is.
    #[arg(long, global = true, env = "SUANLI_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Plaintext: only for servers started --insecure.
    #[arg(long, global = true, env = "SUANLI_INSECURE")]
    pub insecure: bool,
}

/// What a client dials with.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    /// TLS material (`None`: plaintext).
    pub tls: Option<Tls>,
    /// A bearer token.
    pub token: Option<String>,
}

/// The TLS directory used when no credential is given: `SUANLI_TLS_DIR`, else `./.suanli/dev/tls`
/// when it exists.
fn default_dir() -> Option<PathBuf> {
    match std::env::var_os("SUANLI_TLS_DIR") {
        Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
        _ => Some(PathBuf::from(DEV_TLS_DIR)).filter(|d| d.join("ca.pem").exists()),
    }
}

impl CredArgs {
    /// The credentials these flags (or the environment, or the dev cluster's directory) name;
    /// an error names the flag and says what to pass.
    pub fn load(&self) -> anyhow::Result<Credentials> {
        self.load_with(default_dir)
    }

    /// [`CredArgs::load`], with `dir` finding the directory used when no credential is given.
    fn load_with(&self, dir: impl FnOnce() -> Option<PathBuf>) -> anyhow::Result<Credentials> {
        let token = self.token.as_deref().map(str::trim).filter(|t| !t.is_empty()).map(str::to_owned);
        if self.insecure {
            if self.ca.is_some() || self.cert.is_some() {
                bail!("--insecure: plaintext has no use for --ca, --cert or --key (SUANLI_CA, SUANLI_CERT, SUANLI_KEY); drop one or the other");
            }
            return Ok(Credentials { tls: None, token });
        }
        let files = match (&self.ca, &self.cert, &self.key) {
            (Some(ca), Some(cert), Some(key)) => {
                Some(TlsFiles { ca: ca.clone(), cert: cert.clone(), key: key.clone() })
            }
            (Some(ca), None, None) => {
                if token.is_none() {
                    bail!(
                        "--ca without --cert and --key: pass the client certificate (--cert, --key) or a token (--token)"
                    );
                }
                return Ok(Credentials { tls: Some(load_ca_only(ca)?), token });
            }
            (None, Some(_), _) | (None, _, Some(_)) => {
                bail!("--cert and --key need --ca (the cluster's CA certificate, SUANLI_CA) to verify the servers")
            }
            (Some(_), _, _) => bail!("--cert and --key come together"),
            (None, None, None) => None,
        };
        let files = match files {
            Some(f) => f,
            None => {
                let Some(dir) = dir() else {
                    bail!(
                        "no credentials: pass --ca CA --cert CERT --key KEY (or SUANLI_CA, SUANLI_CERT, SUANLI_KEY), \
                         --ca CA --token TOKEN, or SUANLI_TLS_DIR=DIR (a `suanli tls init` directory: its admin \
                         certificate); --insecure only for servers started --insecure. From the directory \
                         `suanli dev` runs in, ./{DEV_TLS_DIR} is used"
                    );
                };
                if token.is_some() {
                    return Ok(Credentials { tls: Some(load_ca_only(&dir.join("ca.pem"))?), token });
                }
                suanli_security::certs::paths(&dir, "admin")
            }
        };
        let tls = Tls::load(files).context("TLS credentials (--ca, --cert, --key or SUANLI_TLS_DIR)")?;
        Ok(Credentials { tls: Some(tls), token })
    }
}

/// TLS that verifies the servers against `ca` and presents no client certificate.
fn load_ca_only(ca: &Path) -> anyhow::Result<Tls> {
    Tls::load_ca_only(ca.to_owned()).context("--ca (SUANLI_CA)")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(a: CredArgs) -> String {
        format!("{:#}", a.load().expect_err("refused"))
    }

    #[test]
    fn partial_or_conflicting_credentials_name_the_flags() {
        let p = |s: &str| Some(PathBuf::from(s));
        let e = err(CredArgs { insecure: true, ca: p("/x/ca.pem"), ..CredArgs::default() });
        assert!(e.starts_with("--insecure: plaintext has no use for --ca"), "{e}");
        let e = err(CredArgs { ca: p("/x/ca.pem"), ..CredArgs::default() });
        assert!(e.contains("--ca without --cert and --key") && e.contains("--token"), "{e}");
        let e = err(CredArgs { cert: p("/x/c.pem"), key: p("/x/k.pem"), ..CredArgs::default() });
        assert!(e.contains("need --ca"), "{e}");
        let e = err(CredArgs { ca: p("/x/ca.pem"), cert: p("/x/c.pem"), ..CredArgs::default() });
        assert!(e.contains("--cert and --key come together"), "{e}");
        let e = err(CredArgs { ca: p("/nonexistent/ca.pem"), cert: p("/x/c.pem"), key: p("/x/k.pem"), ..CredArgs::default() });
        assert!(e.contains("--ca, --cert, --key") && e.contains("/nonexistent/ca.pem"), "names the file: {e}");
        let e = err(CredArgs { ca: p("/nonexistent/ca.pem"), token: Some("sl1.a.b".into()), ..CredArgs::default() });
        assert!(e.contains("--ca (SUANLI_CA)") && e.contains("/nonexistent/ca.pem"), "{e}");
        // Plaintext needs no file; a token still travels.
        let c = CredArgs { insecure: true, token: Some(" sl1.a.b ".into()), ..CredArgs::default() }.load().expect("insecure");
        assert!(c.tls.is_none() && c.token.as_deref() == Some("sl1.a.b"));
    }

    #[test]
    fn a_tls_dir_gives_the_admin_certificate_or_with_a_token_only_the_ca() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let tls = dir.path().join("tls");
        let hosts = vec!["localhost".to_owned()];
        let admin = suanli_security::Principal::from_uri("suanli://user/admin?role=admin").expect("admin");
        suanli_security::certs::init(
            &tls,
            &[suanli_security::certs::Leaf::server("server", &hosts), suanli_security::certs::Leaf::user(admin)],
            suanli_security::certs::DEFAULT_VALIDITY,
        )
        .expect("certs::init");
        let found = || Some(tls.clone());
        let c = CredArgs::default().load_with(found).expect("the directory's admin");
        let t = c.tls.expect("TLS");
        assert_eq!(t.own_identity().and_then(|p| p.to_uri()).as_deref(), Some("suanli://user/admin?role=admin"));
        let c = CredArgs { token: Some("sl1.a.b".into()), ..CredArgs::default() }.load_with(found).expect("CA only");
        let e = format!("{:#}", CredArgs::default().load_with(|| None).expect_err("nothing found"));
        assert!(e.starts_with("no credentials: pass --ca CA --cert CERT --key KEY") && e.contains("--insecure"), "{e}");
        assert_eq!(c.tls.expect("TLS").own_identity(), None, "a token's caller presents no certificate");
    }
}
