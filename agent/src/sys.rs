//! The few OS calls the agent and the shim make: sessions, signals to process groups, process
//! identity from /proc, and files written atomically.

use std::io::Write as _;
use std::path::Path;

/// Identity of a live process: its pid and its start time (clock ticks after boot, field 22 of
/// `/proc/<pid>/stat`), so a reused pid is never mistaken for the process we started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProcId {
    /// The pid.
    pub pid: i32,
    /// Start time in clock ticks after boot.
    pub start_time: u64,
}

/// Start time and state letter of `pid`, from `/proc/<pid>/stat`; `None` when it is gone.
pub fn proc_stat(pid: i32) -> Option<(u64, char)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ppid ...": comm may hold spaces and parentheses, so parse after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    // Fields after comm start at field 3 (state); starttime is field 22.
    let start = f.nth(22 - 4)?.parse().ok()?;
    Some((start, state))
}

impl ProcId {
    /// The identity of `pid` now.
    pub fn of(pid: i32) -> Option<ProcId> {
        proc_stat(pid).map(|(start_time, _)| ProcId { pid, start_time })
    }

    /// Whether this very process still runs (not gone, not a zombie, pid not reused).
    pub fn alive(&self) -> bool {
        matches!(proc_stat(self.pid), Some((t, s)) if t == self.start_time && s != 'Z' && s != 'X')
    }
}

/// Sends `sig` to the process group `pgid`. ESRCH (no such group) is not an error.
#[allow(unsafe_code)]
pub fn kill_group(pgid: i32, sig: i32) -> std::io::Result<()> {
    if pgid <= 1 {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("refusing to signal group {pgid}")));
    }
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    let r = unsafe { libc::kill(-pgid, sig) };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ESRCH) { Ok(()) } else { Err(e) }
}

/// Makes a child started by `cmd` the leader of a new session (and so of a new process group),
/// so it survives the agent and can be signalled as a group.
#[allow(unsafe_code)]
pub fn new_session(cmd: &mut tokio::process::Command) {
    // SAFETY: the closure runs in the forked child before exec and calls only setsid(2), which
    // is async-signal-safe; it allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Opens (creating) `path` and takes an exclusive `flock` on it without waiting: `Ok(None)`
/// when another process holds it. The lock lasts as long as the returned file is open; the
/// descriptor is close-on-exec, so children never inherit it.
#[allow(unsafe_code)]
pub fn try_lock(path: &Path) -> std::io::Result<Option<std::fs::File>> {
    use std::os::fd::AsRawFd as _;
    let f = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(path)?;
    // SAFETY: flock(2) on a descriptor we own; no memory is passed.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r == 0 {
        return Ok(Some(f));
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) { Ok(None) } else { Err(e) }
}

/// Takes an exclusive `flock` on `f`, waiting for it; released when `f` is closed.
#[allow(unsafe_code)]
pub fn lock_exclusive(f: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    loop {
        // SAFETY: flock(2) on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Writes `data` to `path` atomically: a temp file in the same directory, fsync, rename, fsync
/// of the directory. A reader sees the old file or the whole new one.
pub fn write_atomic(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    sync_dir(dir)
}

/// fsync of a directory (so a created or renamed entry survives a crash).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Like [`write_atomic`] without the fsyncs: a reader sees the old file or the whole new one,
/// but the new one may not survive a machine crash. For state that is meaningless after a
/// reboot (the lease).
pub fn write_replace(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)
}

/// Writes `data` at the start of `path`, padded with spaces (and a final newline) to exactly
/// `size` bytes, in place: no temporary file, no rename, no truncation. Once the file has been
/// written at this size, rewriting it needs no new blocks on a filesystem that overwrites in
/// place (ext4, xfs, tmpfs; not btrfs or ZFS, which copy on write), so it keeps working when the
/// filesystem is full. A reader may see a write half done: records written this way carry their
/// own check (the lease) or are renamed into place once written (`exit.json`).
pub fn write_padded(path: &Path, data: &[u8], size: usize) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt as _;
    if data.len() >= size {
        return Err(std::io::Error::other(format!(
            "{} bytes do not fit the {size} bytes reserved in {}",
            data.len(),
            path.display()
        )));
    }
    let f = std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(path)?;
    let mut buf = Vec::with_capacity(size);
    buf.extend_from_slice(data);
    buf.resize(size - 1, b' ');
    buf.push(b'\n');
    f.write_all_at(&buf, 0)?;
    if f.metadata()?.len() > size as u64 {
        // Left by an older, longer record: cutting it needs no space.
        f.set_len(size as u64)?;
    }
    Ok(())
}

/// Writes `data` as `path` through `reserved`, a file of `size` bytes written earlier by
/// [`write_padded`] while the disk had room: it is rewritten in place, fsynced and renamed to
/// `path`, so this needs no free space. Without a reservation (or for a record too long for
/// it), falls back on [`write_atomic`].
pub fn write_reserved(path: &Path, reserved: &Path, data: &[u8], size: usize) -> std::io::Result<()> {
    let fits = data.len() < size && std::fs::metadata(reserved).is_ok_and(|m| m.len() == size as u64);
    if !fits {
        return write_atomic(path, data);
    }
    write_padded(reserved, data, size)?;
    std::fs::File::open(reserved)?.sync_all()?;
    std::fs::rename(reserved, path)?;
    sync_dir(path.parent().unwrap_or_else(|| Path::new(".")))
}

/// Free space of the filesystem holding `path`: `(available to unprivileged users, total)`,
/// in bytes (statvfs(3)).
#[allow(unsafe_code)]
pub fn fs_space(path: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: a zeroed statvfs is a valid value of a plain C struct of integers.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs(3) reads a NUL-terminated path we own and writes one struct we own.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::useless_conversion)] // the field types differ between libc targets
    let (frsize, bavail, blocks) = (u64::from(st.f_frsize), u64::from(st.f_bavail), u64::from(st.f_blocks));
    Ok((bavail.saturating_mul(frsize), blocks.saturating_mul(frsize)))
}

/// Bytes allocated on disk to the files under `dir` (their `st_blocks`), not following symbolic
/// links, skipping the top-level entries named in `skip`, and looking at no more than
/// `max_entries` entries (a directory with more is counted in part).
pub fn dir_usage(dir: &Path, skip: &[&str], max_entries: usize) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    let mut total = 0u64;
    let mut seen = 0usize;
    let mut stack = vec![(dir.to_path_buf(), true)];
    while let Some((d, top)) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.filter_map(Result::ok) {
            seen += 1;
            if seen > max_entries {
                return total;
            }
            if top && e.file_name().to_str().is_some_and(|n| skip.contains(&n)) {
                continue;
            }
            let Ok(m) = e.path().symlink_metadata() else {
                continue;
            };
            total = total.saturating_add(m.blocks().saturating_mul(512));
            if m.is_dir() {
                stack.push((e.path(), false));
            }
        }
    }
    total
}

/// `CLOCK_BOOTTIME` in milliseconds: monotonic, counts time suspended, and is the same clock
/// in every process of the machine, so the agent and the shims can compare its readings.
#[allow(unsafe_code)]
pub fn boottime_ms() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime(2) writes one timespec into memory we own.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if r != 0 {
        // CLOCK_BOOTTIME exists since Linux 2.6.39; fall back on CLOCK_MONOTONIC, which is
        // shared by all processes too.
        // SAFETY: as above.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    }
    let s = u64::try_from(ts.tv_sec).unwrap_or(0);
    let ns = u64::try_from(ts.tv_nsec).unwrap_or(0);
    s.saturating_mul(1000).saturating_add(ns / 1_000_000)
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`), empty when unreadable: boot-time
/// readings of another boot must not be compared with this one's.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_owned()).unwrap_or_default()
}

/// The process group of `pid` (field 5 of `/proc/<pid>/stat`); `None` when it is gone.
pub fn proc_pgrp(pid: i32) -> Option<i32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    // After comm: state (3), ppid (4), pgrp (5).
    rest.split_whitespace().nth(2)?.parse().ok()
}

/// Sends `sig` to `child` and, when this process leads its own process group, to every other
/// member of that group but itself (found in /proc). A process cannot SIGKILL its own group
/// without dying, and the shim must outlive its task to record how it ended.
#[allow(unsafe_code)]
pub fn signal_group_but_self(child: i32, sig: i32) {
    if child > 1 {
        // SAFETY: kill(2) takes plain integers; `child` is our unreaped child, so its pid
        // cannot have been reused.
        unsafe { libc::kill(child, sig) };
    }
    // SAFETY: getpid(2) and getpgrp(2) take no arguments.
    let (me, group) = unsafe { (libc::getpid(), libc::getpgrp()) };
    if me != group {
        // Not a group leader (started by hand, not by the agent): the group is someone else's.
        return;
    }
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in rd.filter_map(Result::ok) {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if pid != me && pid != child && proc_pgrp(pid) == Some(me) {
            // SAFETY: as above; a pid that left the group meanwhile gets a signal meant for
            // the task's group, a window of microseconds.
            unsafe { libc::kill(pid, sig) };
        }
    }
}

/// Waits until child `pid` has exited or `timeout` passed, without reaping it: true when it
/// exited (or may have: on error the caller checks with a non-blocking wait). Uses a pidfd
/// (Linux 5.3) and falls back on sleeping for at most 50 ms.
#[allow(unsafe_code)]
pub fn wait_exit(pidfd: Option<&std::os::fd::OwnedFd>, timeout: Option<std::time::Duration>) -> bool {
    use std::os::fd::AsRawFd as _;
    match pidfd {
        Some(fd) => {
            let ms = timeout.map_or(-1, |t| i32::try_from(t.as_millis()).unwrap_or(i32::MAX));
            let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: poll(2) on one pollfd we own, for a bounded time.
            let r = unsafe { libc::poll(&mut p, 1, ms) };
            r != 0
        }
        None => {
            let t = timeout.unwrap_or(std::time::Duration::from_millis(50)).min(std::time::Duration::from_millis(50));
            std::thread::sleep(t);
            true
        }
    }
}

/// A pidfd for child `pid`, when the kernel offers them.
#[allow(unsafe_code)]
pub fn pidfd_open(pid: i32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd as _;
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = i32::try_from(fd).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: the descriptor was just created for us and is owned by nobody else.
    Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Seconds since the Unix epoch.
pub fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn padded_records_are_rewritten_in_place_at_a_fixed_size() {
        use std::os::unix::fs::MetadataExt as _;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("rec");
        write_padded(&p, b"{\"a\":1}", 64).unwrap();
        let ino = std::fs::metadata(&p).unwrap().ino();
        write_padded(&p, b"{}", 64).unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!((m.ino(), m.len()), (ino, 64), "same file, same size: no new blocks");
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<serde_json::Value>(&text).unwrap(), serde_json::json!({}));
        assert!(write_padded(&p, &[b'x'; 64], 64).unwrap_err().to_string().contains("do not fit"));
        // Through a reservation: renamed into place; without one, written atomically.
        let r = d.path().join(".rec.reserved");
        write_padded(&r, b"{}", 128).unwrap();
        write_reserved(&d.path().join("out"), &r, b"{\"b\":2}", 128).unwrap();
        assert!(!r.exists());
        assert_eq!(std::fs::read_to_string(d.path().join("out")).unwrap().trim_end(), "{\"b\":2}");
        write_reserved(&d.path().join("out2"), &r, b"[]", 128).unwrap();
        assert_eq!(std::fs::read(d.path().join("out2")).unwrap(), b"[]");
    }

    #[test]
    fn disk_usage_and_free_space() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("sub/big"), vec![1u8; 256 * 1024]).unwrap();
        std::fs::write(d.path().join("stdout.log"), vec![1u8; 256 * 1024]).unwrap();
        let all = dir_usage(d.path(), &[], 1000);
        let files = dir_usage(d.path(), &["stdout.log"], 1000);
        assert!(files >= 256 * 1024 && all >= files + 256 * 1024, "{files} {all}");
        assert!(dir_usage(d.path(), &[], 1) < all, "bounded by max_entries");
        let (free, total) = fs_space(d.path()).unwrap();
        assert!(total > 0 && free <= total);
        assert!(fs_space(&d.path().join("missing")).is_err());
    }

    #[test]
    fn own_process_is_alive_and_a_stranger_is_not() {
        let me = ProcId::of(std::process::id() as i32).unwrap();
        assert!(me.alive());
        let other = ProcId { start_time: me.start_time + 1, ..me };
        assert!(!other.alive(), "a different start time is another process");
        assert!(ProcId::of(i32::MAX).is_none());
    }

    #[test]
    fn a_held_lock_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.lock");
        let held = try_lock(&p).unwrap().unwrap();
        assert!(try_lock(&p).unwrap().is_none(), "a second open file description must not get it");
        drop(held);
        assert!(try_lock(&p).unwrap().is_some());
    }

    #[test]
    fn boottime_moves_forward_and_groups_are_read() {
        let a = boottime_ms();
        assert!(a > 0);
        assert!(boottime_ms() >= a);
        let me = std::process::id() as i32;
        assert!(proc_pgrp(me).is_some_and(|g| g > 0));
        assert!(proc_pgrp(i32::MAX).is_none());
        assert!(!boot_id().is_empty());
    }

    #[test]
    fn atomic_write_replaces() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
    }
}
