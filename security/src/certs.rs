//! Development certificates (`suanli tls init DIR`, `suanli tls issue`): a CA and the
//! certificates a cluster needs, made with rcgen. Production clusters bring their own PKI:
//! what suanli needs of a certificate is in docs/security.md (a URI SAN naming the holder,
//! DNS/IP SANs for whoever serves, both client and server auth key usages).
//!
//! The files of `DIR`:
//!
//! ```text
//!  ca.pem ca-key.pem                    the CA (keep ca-key.pem away from the cluster)
//!  server.pem server-key.pem            suanli://server/server, SANs: the hosts given
//!  admin.pem admin-key.pem              suanli://user/admin?role=admin
//!  node-<id>.pem node-<id>-key.pem      suanli://node/<id>, SANs: the hosts given
//!  user-<name>.pem user-<name>-key.pem  suanli://user/<name>?role=..&team=..
//! ```

use crate::principal::Principal;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The hosts a development certificate is valid for unless told otherwise.
pub const DEFAULT_HOSTS: &[&str] = &["localhost", "127.0.0.1", "::1"];

/// How long development certificates are valid unless told otherwise (1 year).
pub const DEFAULT_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);

/// What a certificate is made for.
#[derive(Debug, Clone)]
pub struct Leaf {
    /// Who it names.
    pub principal: Principal,
    /// DNS names and IP addresses it may serve as (empty for a user).
    pub hosts: Vec<String>,
    /// The file stem (`server`, `node-n1`, `user-alice`, `admin`).
    pub stem: String,
}

impl Leaf {
    /// The server certificate (`server`), for `hosts`.
    pub fn server(name: &str, hosts: &[String]) -> Leaf {
        let _ = (name, hosts);
        todo!("h-tls")
    }
    /// A node's certificate (`node-<id>`), for `hosts`.
    pub fn node(id: &str, hosts: &[String]) -> Leaf {
        let _ = (id, hosts);
        todo!("h-tls")
    }
    /// A user's certificate (`admin` for the user `admin` with role admin, `user-<name>` otherwise).
    pub fn user(principal: Principal) -> Leaf {
        let _ = principal;
        todo!("h-tls")
    }
}

/// The paths a leaf's certificate and key are written to in `dir`.
pub fn paths(dir: &Path, stem: &str) -> crate::tls::TlsFiles {
    crate::tls::TlsFiles {
        ca: dir.join("ca.pem"),
        cert: dir.join(format!("{stem}.pem")),
        key: dir.join(format!("{stem}-key.pem")),
    }
}

/// Creates `dir` with a new CA and `leaves` (refuses a `dir` that already holds a `ca.pem`:
/// an existing CA is never overwritten). Key files are written mode 0600.
pub fn init(dir: &Path, leaves: &[Leaf], validity: Duration) -> std::io::Result<Vec<PathBuf>> {
    let _ = (dir, leaves, validity);
    todo!("h-tls")
}

/// Issues `leaf` from the CA in `dir` (`ca.pem`, `ca-key.pem`), overwriting that leaf's files
/// if they exist (how certificates are rotated); returns the files written.
pub fn issue(dir: &Path, leaf: &Leaf, validity: Duration) -> std::io::Result<crate::tls::TlsFiles> {
    let _ = (dir, leaf, validity);
    todo!("h-tls")
}
