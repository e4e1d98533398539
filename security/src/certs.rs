//! Development certificates (`suanli tls init DIR`, `suanli tls issue`): a CA and the
//! certificates a cluster needs, made with rcgen. Production clusters bring their own PKI:
//! what suanli needs of a certificate is in docs/tls.md (a URI SAN naming the holder,
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

use crate::principal::{MAX_IDENTITY_NAME, Principal, Role, valid_name};
use rcgen::string::Ia5String;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, SanType,
};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use std::io::{Read, Write};
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The hosts a development certificate is valid for unless told otherwise.
pub const DEFAULT_HOSTS: &[&str] = &["localhost", "127.0.0.1", "::1"];

/// How long development certificates are valid unless told otherwise (1 year).
pub const DEFAULT_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);

/// How long the CA made by [`init`] is valid at least (10 years; longer if the leaves' validity
/// is): leaves are re-issued from it (rotation) long after `init`.
pub const CA_MIN_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// The longest validity accepted (100 years).
pub const MAX_VALIDITY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// How far back a certificate's `not_before` is set (clocks of a cluster's machines differ).
pub const CLOCK_SKEW: Duration = Duration::from_secs(3600);

/// Largest `ca.pem` or `ca-key.pem` read by [`issue`], in bytes.
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// The common name of the CA [`init`] makes.
pub const CA_NAME: &str = "suanli development CA";

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
    /// The server certificate, for `hosts`: stem `server` for the server named `server` (the
    /// one `suanli tls init` writes), `server-<name>` for any other name.
    pub fn server(name: &str, hosts: &[String]) -> Leaf {
        let stem = if name == "server" { "server".to_owned() } else { format!("server-{name}") };
        Leaf { principal: Principal::Server { name: name.to_owned() }, hosts: hosts.to_vec(), stem }
    }
    /// A node's certificate (`node-<id>`), for `hosts`.
    pub fn node(id: &str, hosts: &[String]) -> Leaf {
        Leaf { principal: Principal::Node { name: id.to_owned() }, hosts: hosts.to_vec(), stem: format!("node-{id}") }
    }
    /// A user's certificate (`admin` for the user `admin` with role admin, `user-<name>` otherwise).
    pub fn user(principal: Principal) -> Leaf {
        let stem = match &principal {
            Principal::User { name, role: Role::Admin, team: None, .. } if name == "admin" => "admin".to_owned(),
            Principal::User { name, .. } => format!("user-{name}"),
            Principal::Node { name } => format!("node-{name}"),
            Principal::Server { name } => format!("server-{name}"),
            Principal::Anonymous => "anonymous".to_owned(),
            Principal::Insecure => "insecure".to_owned(),
        };
        Leaf { principal, hosts: Vec::new(), stem }
    }

    /// Whether the holder serves (servers and agents: server and client auth) or only calls
    /// (users: client auth).
    fn serves(&self) -> bool {
        matches!(self.principal, Principal::Server { .. } | Principal::Node { .. })
    }

    /// The principal's name (the certificate's CN).
    fn name(&self) -> &str {
        match &self.principal {
            Principal::User { name, .. } | Principal::Node { name } | Principal::Server { name } => name,
            Principal::Anonymous => "anonymous",
            Principal::Insecure => "insecure",
        }
    }

    /// The certificate parameters, checked: an error names what is wrong.
    fn params(&self, validity: Duration) -> std::io::Result<CertificateParams> {
        let uri = self.principal.to_uri().ok_or_else(|| {
            invalid(format!("principal {}: names nobody, so no certificate can name it", self.principal))
        })?;
        // The URI must read back as the same identity (names, roles and teams are checked there).
        let back = Principal::from_uri(&uri);
        let same = match (&back, &self.principal) {
            (
                Some(Principal::User { name: a, role: ra, team: ta, .. }),
                Principal::User { name: b, role: rb, team: tb, .. },
            ) => a == b && ra == rb && ta == tb,
            (Some(p), q) => p == q,
            (None, _) => false,
        };
        if !same {
            return Err(invalid(format!(
                "principal {}: not a valid identity (names: 1 to {MAX_IDENTITY_NAME} bytes of letters, digits, '.', '_', '-'; a member needs a team)",
                self.principal
            )));
        }
        if !valid_name(&self.stem) {
            return Err(invalid(format!("stem {:?}: not a valid file stem", self.stem)));
        }
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, self.name());
        params.subject_alt_names.push(SanType::URI(
            Ia5String::try_from(uri.as_str()).map_err(|e| invalid(format!("principal uri {uri}: {e}")))?,
        ));
        for h in &self.hosts {
            params.subject_alt_names.push(host_san(h)?);
        }
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = if self.serves() {
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth]
        } else {
            vec![ExtendedKeyUsagePurpose::ClientAuth]
        };
        params.use_authority_key_identifier_extension = true;
        set_validity(&mut params, validity)?;
        Ok(params)
    }
}

/// Whether `host` can be a certificate's host SAN: an IP address or a DNS name.
pub fn check_host(host: &str) -> Result<(), String> {
    if host.parse::<IpAddr>().is_ok() {
        return Ok(());
    }
    match rustls_pki_types::ServerName::try_from(host) {
        Ok(rustls_pki_types::ServerName::DnsName(_)) => Ok(()),
        _ => Err(format!("host {host:?}: neither an IP address nor a DNS name")),
    }
}

/// A host as a SAN: an IP address, else a DNS name (checked as one).
fn host_san(host: &str) -> std::io::Result<SanType> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    check_host(host).map_err(invalid)?;
    Ia5String::try_from(host).map(SanType::DnsName).map_err(|e| invalid(format!("host {host:?}: {e}")))
}

fn invalid(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, msg)
}

fn other(what: &str, e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(format!("{what}: {e}"))
}

/// `not_before` = now - [`CLOCK_SKEW`], `not_after` = now + `validity`.
fn set_validity(params: &mut CertificateParams, validity: Duration) -> std::io::Result<()> {
    check_validity(validity)?;
    let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).map_err(|e| other("system clock before 1970", e))?;
    let epoch = rcgen::date_time_ymd(1970, 1, 1);
    params.not_before = epoch + since_epoch.saturating_sub(CLOCK_SKEW);
    params.not_after = epoch + since_epoch + validity;
    Ok(())
}

fn check_validity(validity: Duration) -> std::io::Result<()> {
    if validity < Duration::from_secs(1) || validity > MAX_VALIDITY {
        return Err(invalid(format!(
            "validity {}s: must be between 1 s and {} days",
            validity.as_secs(),
            MAX_VALIDITY.as_secs() / 86400
        )));
    }
    Ok(())
}

/// The paths a leaf's certificate and key are written to in `dir`.
pub fn paths(dir: &Path, stem: &str) -> crate::tls::TlsFiles {
    crate::tls::TlsFiles {
        ca: dir.join("ca.pem"),
        cert: dir.join(format!("{stem}.pem")),
        key: dir.join(format!("{stem}-key.pem")),
    }
}

/// Creates `dir` (mode 0700 when it is created here) with a new CA (ECDSA P-256, valid for
/// `validity` but at least [`CA_MIN_VALIDITY`]) and `leaves`, each valid for `validity`.
/// Refuses a `dir` that already holds a `ca.pem`: an existing CA is never overwritten. Key
/// files are written mode 0600. Returns the files written, in order.
pub fn init(dir: &Path, leaves: &[Leaf], validity: Duration) -> std::io::Result<Vec<PathBuf>> {
    // Check everything before writing anything.
    check_validity(validity)?;
    for leaf in leaves {
        leaf.params(validity)?;
    }
    let ca_pem = dir.join("ca.pem");
    if std::fs::symlink_metadata(&ca_pem).is_ok() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!(
                "{}: a CA is already there (it is never overwritten; `suanli tls issue` issues from it)",
                ca_pem.display()
            ),
        ));
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;

    let ca_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(|e| other("CA key", e))?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, CA_NAME);
    params.distinguished_name.push(DnType::OrganizationName, "suanli");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    set_validity(&mut params, validity.max(CA_MIN_VALIDITY).min(MAX_VALIDITY))?;
    let ca_cert = params.self_signed(&ca_key).map_err(|e| other("CA certificate", e))?;
    let mut written = Vec::new();
    let ca_key_path = dir.join("ca-key.pem");
    write_atomic(&ca_key_path, ca_key.serialize_pem().as_bytes(), 0o600)?;
    written.push(ca_key_path);
    write_atomic(&ca_pem, ca_cert.pem().as_bytes(), 0o644)?;
    written.push(ca_pem);

    let issuer = Issuer::new(params, ca_key);
    for leaf in leaves {
        let files = write_leaf(dir, leaf, validity, &issuer)?;
        written.push(files.key);
        written.push(files.cert);
    }
    Ok(written)
}

/// Issues `leaf` from the CA in `dir` (`ca.pem`, `ca-key.pem`; when `ca.pem` holds several
/// certificates, the one matching `ca-key.pem`), overwriting that leaf's files if they exist
/// (how certificates are rotated); returns the files written.
///
/// Each file is written to a temporary file and renamed over the old one, so a reader never
/// sees half a file; the key is written first, then the certificate. A reloader that reads
/// between the two sees a key that does not match the certificate, fails that reload (the
/// previous material stays in use) and succeeds at its next poll, when the certificate changed.
pub fn issue(dir: &Path, leaf: &Leaf, validity: Duration) -> std::io::Result<crate::tls::TlsFiles> {
    leaf.params(validity)?;
    let ca_path = dir.join("ca.pem");
    let ca_key_path = dir.join("ca-key.pem");
    let ca_pem = read_capped(&ca_path)?;
    let ca_key_pem = read_capped(&ca_key_path)?;
    let ca_key_pem =
        std::str::from_utf8(&ca_key_pem).map_err(|_| invalid(format!("{}: not PEM text", ca_key_path.display())))?;
    let ca_key = KeyPair::from_pem(ca_key_pem).map_err(|e| {
        invalid(format!("{}: not a PKCS#8 private key rcgen can sign with: {e}", ca_key_path.display()))
    })?;
    let mut ca_der = None;
    for cert in CertificateDer::pem_slice_iter(&ca_pem) {
        let cert = cert.map_err(|e| invalid(format!("{}: {e}", ca_path.display())))?;
        let matches = x509_parser::parse_x509_certificate(&cert)
            .map(|(_, x)| x.public_key().subject_public_key.data.as_ref() == ca_key.public_key_raw())
            .unwrap_or(false);
        if matches {
            ca_der = Some(cert);
            break;
        }
    }
    let ca_der = ca_der.ok_or_else(|| {
        invalid(format!("{}: holds no certificate for the key in {}", ca_path.display(), ca_key_path.display()))
    })?;
    let issuer = Issuer::from_ca_cert_der(&ca_der, ca_key)
        .map_err(|e| invalid(format!("{}: not a CA certificate rcgen can issue from: {e}", ca_path.display())))?;
    write_leaf(dir, leaf, validity, &issuer)
}

/// Makes `leaf`'s key and certificate and writes them (key first).
fn write_leaf(
    dir: &Path,
    leaf: &Leaf,
    validity: Duration,
    issuer: &Issuer<'_, KeyPair>,
) -> std::io::Result<crate::tls::TlsFiles> {
    let params = leaf.params(validity)?;
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(|e| other("key", e))?;
    let cert = params.signed_by(&key, issuer).map_err(|e| other(&format!("certificate {}", leaf.stem), e))?;
    let files = paths(dir, &leaf.stem);
    write_atomic(&files.key, key.serialize_pem().as_bytes(), 0o600)?;
    write_atomic(&files.cert, cert.pem().as_bytes(), 0o644)?;
    Ok(files)
}

/// Reads at most [`MAX_PEM_BYTES`] of `path` (an error names the file and the limit).
fn read_capped(path: &Path) -> std::io::Result<Vec<u8>> {
    let f = std::fs::File::open(path).map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let mut buf = Vec::new();
    f.take(MAX_PEM_BYTES + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > MAX_PEM_BYTES {
        return Err(invalid(format!("{}: larger than {MAX_PEM_BYTES} bytes", path.display())));
    }
    Ok(buf)
}

/// Writes `bytes` to a temporary file next to `path` (mode `mode`), syncs it and renames it
/// over `path`: a reader sees the old file or the new one, never half of one.
fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // Unique per process and call: two threads issuing the same leaf never share a temp file.
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.tmp-{}-{seq}", std::process::id()));
    let res = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
        // The mode of `open` applies to new files only (and under the umask): set it.
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(std::io::Error::new(e.kind(), format!("{}: {e}", path.display())));
    }
    // The rename is durable once the directory is synced.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::principal::Credential;
    use std::os::unix::fs::MetadataExt;
    use x509_parser::extensions::GeneralName;

    fn hosts() -> Vec<String> {
        DEFAULT_HOSTS.iter().map(|h| (*h).to_owned()).collect()
    }

    fn user(name: &str, role: Role, team: Option<&str>) -> Principal {
        Principal::User { name: name.into(), role, team: team.map(str::to_owned), credential: Credential::Certificate }
    }

    fn parse(path: &Path) -> Vec<u8> {
        CertificateDer::from_pem_file(path).expect("a PEM certificate").to_vec()
    }

    #[test]
    fn init_writes_a_ca_and_leaves_with_their_identities_hosts_and_usages() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("pki");
        let leaves = [
            Leaf::server("server", &hosts()),
            Leaf::user(user("admin", Role::Admin, None)),
            Leaf::user(user("alice", Role::Member, Some("nlp"))),
            Leaf::node("n1", &["n1.example".to_owned(), "10.0.0.1".to_owned()]),
        ];
        assert_eq!(
            leaves.iter().map(|l| l.stem.as_str()).collect::<Vec<_>>(),
            ["server", "admin", "user-alice", "node-n1"]
        );
        let written = init(&dir, &leaves, DEFAULT_VALIDITY).expect("init");
        assert_eq!(written.len(), 2 + 2 * leaves.len());
        assert_eq!(std::fs::metadata(&dir).expect("dir").mode() & 0o777, 0o700);
        for p in &written {
            let mode = std::fs::metadata(p).expect("file").mode() & 0o777;
            if p.to_string_lossy().ends_with("-key.pem") {
                assert_eq!(mode, 0o600, "{}", p.display());
            }
        }

        let ca = parse(&dir.join("ca.pem"));
        let (_, ca) = x509_parser::parse_x509_certificate(&ca).expect("ca");
        assert!(ca.is_ca());
        for leaf in &leaves {
            let der = parse(&paths(&dir, &leaf.stem).cert);
            assert_eq!(crate::tls::principal_of(&der), leaf.principal);
            let (_, x) = x509_parser::parse_x509_certificate(&der).expect("leaf");
            assert!(!x.is_ca());
            assert_eq!(x.issuer(), ca.subject());
            let cn = x.subject().iter_common_name().next().and_then(|c| c.as_str().ok()).map(str::to_owned);
            assert_eq!(cn.as_deref(), Some(leaf.name()));
            let eku = x.extended_key_usage().expect("eku").expect("has an eku").value;
            assert!(eku.client_auth);
            assert_eq!(eku.server_auth, leaf.serves(), "{}", leaf.stem);
            let sans = x.subject_alternative_name().expect("san").expect("has sans");
            let mut names = Vec::new();
            for n in &sans.value.general_names {
                match n {
                    GeneralName::DNSName(d) => names.push((*d).to_owned()),
                    GeneralName::IPAddress(b) => names.push(match b.len() {
                        4 => IpAddr::from(<[u8; 4]>::try_from(*b).expect("v4")).to_string(),
                        _ => IpAddr::from(<[u8; 16]>::try_from(*b).expect("v6")).to_string(),
                    }),
                    _ => {}
                }
            }
            assert_eq!(names, leaf.hosts, "{}", leaf.stem);
            // Valid an hour back (clock skew), for the validity asked.
            let now = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs() as i64;
            let nb = x.validity().not_before.timestamp();
            assert!((now - 3600 - nb).abs() < 120, "not_before {nb} vs now {now}");
            let na = x.validity().not_after.timestamp();
            assert!((na - now - DEFAULT_VALIDITY.as_secs() as i64).abs() < 120);
        }

        let again = init(&dir, &leaves, DEFAULT_VALIDITY).expect_err("a CA is there");
        assert_eq!(again.kind(), std::io::ErrorKind::AlreadyExists);
    }

    #[test]
    fn issue_rotates_a_leaf_from_the_existing_ca() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path();
        init(dir, &[Leaf::node("n1", &hosts())], DEFAULT_VALIDITY).expect("init");
        let files = paths(dir, "node-n1");
        let before = std::fs::read(&files.cert).expect("cert");
        let written = issue(dir, &Leaf::node("n1", &hosts()), DEFAULT_VALIDITY).expect("issue");
        assert_eq!(written, files);
        assert_ne!(std::fs::read(&files.cert).expect("cert"), before);
        // The new certificate chains to the same CA and matches its new key.
        crate::tls::Tls::load(files).expect("loads");
        // No temp files are left behind.
        let left: Vec<_> = std::fs::read_dir(dir)
            .expect("dir")
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
            .collect();
        assert!(left.is_empty(), "{left:?}");

        let none = tempfile::tempdir().expect("tempdir");
        let err = issue(none.path(), &Leaf::node("n1", &hosts()), DEFAULT_VALIDITY).expect_err("no CA");
        assert!(err.to_string().contains("ca.pem"), "{err}");
    }

    #[test]
    fn bad_leaves_are_refused_naming_what_is_wrong() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("pki");
        for (leaf, word) in [
            (Leaf::node("../etc", &[]), "principal"),
            (Leaf::node("n1", &["bad host".to_owned()]), "host"),
            (Leaf::user(user("bob", Role::Member, None)), "team"),
            (Leaf::user(Principal::Anonymous), "names nobody"),
        ] {
            let err = init(&dir, std::slice::from_ref(&leaf), DEFAULT_VALIDITY).expect_err("refused");
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
            assert!(err.to_string().contains(word), "{err}");
        }
        let err = init(&dir, &[], Duration::ZERO).expect_err("zero validity");
        assert!(err.to_string().contains("validity"), "{err}");
        // Nothing was written for a refused init.
        assert!(!dir.exists());
    }
}
