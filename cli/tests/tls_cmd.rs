//! `suanli tls init|issue`, run as the built binary: the files written load as TLS material
//! naming the identities asked for; bad input is an error naming the flag, never a panic.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Output};
use suanli_security::certs;
use suanli_security::principal::Credential;
use suanli_security::tls::Tls;
use suanli_security::{Principal, Role};

fn suanli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_suanli")).args(args).output().expect("run suanli")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn assert_clean_failure(o: &Output, needles: &[&str]) {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(2), "exit code; stderr: {e}");
    for n in needles {
        assert!(e.contains(n), "stderr should contain {n:?}: {e}");
    }
    assert!(!e.contains("panicked"), "must not panic: {e}");
}

fn identity(dir: &Path, stem: &str) -> Option<Principal> {
    Tls::load(certs::paths(dir, stem)).expect("the files load").own_identity()
}

fn user(name: &str, role: Role, team: Option<&str>) -> Principal {
    Principal::User { name: name.into(), role, team: team.map(str::to_owned), credential: Credential::Certificate }
}

#[test]
fn init_writes_the_ca_server_admin_and_what_was_asked() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("pki");
    let d = dir.to_str().expect("utf-8 path");
    let o = suanli(&[
        "tls",
        "init",
        d,
        "--node",
        "n1",
        "--user",
        "alice:member:nlp",
        "--user",
        "ops:operator",
        "--days",
        "30",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let printed: Vec<String> = stdout(&o).lines().map(str::to_owned).collect();
    for stem in ["ca", "server", "admin", "node-n1", "user-alice", "user-ops"] {
        for suffix in [".pem", "-key.pem"] {
            let p = dir.join(format!("{stem}{suffix}"));
            assert!(printed.contains(&p.display().to_string()), "{} not printed: {printed:?}", p.display());
            let mode = std::fs::metadata(&p).expect("written").mode() & 0o777;
            if suffix == "-key.pem" {
                assert_eq!(mode, 0o600, "{}", p.display());
            }
        }
    }
    assert_eq!(printed.len(), 12, "{printed:?}");
    assert_eq!(std::fs::metadata(&dir).expect("dir").mode() & 0o777, 0o700);
    assert_eq!(identity(&dir, "server"), Some(Principal::Server { name: "server".into() }));
    assert_eq!(identity(&dir, "admin"), Some(user("admin", Role::Admin, None)));
    assert_eq!(identity(&dir, "node-n1"), Some(Principal::Node { name: "n1".into() }));
    assert_eq!(identity(&dir, "user-alice"), Some(user("alice", Role::Member, Some("nlp"))));
    assert_eq!(identity(&dir, "user-ops"), Some(user("ops", Role::Operator, None)));

    // An existing CA is never overwritten.
    let again = suanli(&["tls", "init", d]);
    assert_clean_failure(&again, &["ca.pem", "already"]);

    // Issue: a new node, a rotation of the server (new files, same CA), a user.
    let before = std::fs::read(dir.join("server.pem")).expect("server.pem");
    let o = suanli(&["tls", "issue", d, "--server", "server", "--host", "localhost", "--host", "10.1.2.3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().count(), 2, "{}", stdout(&o));
    assert_ne!(std::fs::read(dir.join("server.pem")).expect("server.pem"), before);
    assert_eq!(identity(&dir, "server"), Some(Principal::Server { name: "server".into() }));
    let o = suanli(&["tls", "issue", d, "--node", "n2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(identity(&dir, "node-n2"), Some(Principal::Node { name: "n2".into() }));
    let o = suanli(&["tls", "issue", d, "--user", "bob:viewer"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(identity(&dir, "user-bob"), Some(user("bob", Role::Viewer, None)));
}

#[test]
fn bad_input_names_the_flag() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let d = tmp.path().join("pki");
    let d = d.to_str().expect("utf-8 path");
    for (args, needles) in [
        (vec!["tls", "init", d, "--user", "bob:god"], vec!["--user bob:god", "unknown role"]),
        (vec!["tls", "init", d, "--user", "bob:member"], vec!["--user bob:member", "team"]),
        (vec!["tls", "init", d, "--user", "bob"], vec!["--user bob", "NAME:ROLE"]),
        (vec!["tls", "init", d, "--user", "b b:admin"], vec!["--user b b:admin", "name"]),
        (vec!["tls", "init", d, "--user", "admin:admin"], vec!["--user admin:admin", "admin.pem"]),
        (vec!["tls", "init", d, "--node", "../n1"], vec!["--node \"../n1\""]),
        (vec!["tls", "init", d, "--node", "n1", "--node", "n1"], vec!["--node n1", "twice"]),
        (vec!["tls", "init", d, "--host", "not a host"], vec!["--host", "not a host"]),
        (vec!["tls", "init", d, "--days", "0"], vec!["--days 0"]),
        (vec!["tls", "init", d, "--days", "99999"], vec!["--days 99999"]),
    ] {
        let o = suanli(&args);
        assert_clean_failure(&o, &needles);
    }
    // Nothing was written by the refused commands.
    assert!(!Path::new(d).exists());

    let o = suanli(&["tls", "issue", d, "--node", "n1"]);
    assert_clean_failure(&o, &["ca.pem"]);
    let o = suanli(&["tls", "init", d]);
    assert!(o.status.success(), "{}", stderr(&o));
    for (args, needles) in [
        (vec!["tls", "issue", d, "--user", "bob:member"], vec!["--user bob:member", "team"]),
        (vec!["tls", "issue", d, "--user", "bob:viewer", "--host", "h"], vec!["--host", "user"]),
        (vec!["tls", "issue", d, "--server", "a/b"], vec!["--server \"a/b\""]),
        (vec!["tls", "issue", d, "--node", "n1", "--user", "bob:viewer"], vec!["--node", "--user"]),
        (vec!["tls", "issue", d], vec!["--server", "--node", "--user"]),
    ] {
        let o = suanli(&args);
        assert_clean_failure(&o, &needles);
    }
}
