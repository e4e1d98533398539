//! A fault-injecting TCP proxy: one per directed link (client → server, agent → server,
//! server → server), so a partition can cut exactly the links a scenario names.
//!
//! ```text
//!  dialer ──▶ 127.0.0.1:P (Proxy) ──▶ target
//!              │ Fault { blocked, delay_ms, reset_per_mille }, changed at run time
//! ```
//!
//! - **blocked**: no byte moves in either direction (connections stay open, reads stop, so
//!   the sender's TCP buffers fill), as on a network that drops every packet. New connections
//!   are accepted but carry nothing. When the block lifts, held bytes flow again, like TCP
//!   retransmitting after a partition heals.
//! - **delay**: every chunk waits `delay_ms` before it is forwarded (order kept).
//! - **reset**: each chunk has a `reset_per_mille` chance of closing the connection both ways.
//!   A byte stream cannot lose a packet without corrupting it; what a real network's losses
//!   look like to TCP, past its retransmissions, is a broken connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use suanli_scheduler::DetRng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What a link does to its traffic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fault {
    /// Nothing moves.
    pub blocked: bool,
    /// Added to every chunk, in milliseconds.
    pub delay_ms: u64,
    /// Chance per chunk (out of 1000) that the connection is reset.
    pub reset_per_mille: u16,
}

/// One directed link: a listener on a loopback port forwarding to its target.
pub struct Proxy {
    /// The address dialers use instead of the target's.
    pub addr: String,
    /// Where traffic goes (`None` until known: connections wait for it).
    target: watch::Sender<Option<String>>,
    fault: watch::Sender<Fault>,
    accept: JoinHandle<()>,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicU64>,
}

impl Proxy {
    /// Starts a proxy to `target` on a fresh loopback port; `seed` drives its resets.
    pub async fn start(target: String, seed: u64) -> std::io::Result<Proxy> {
        let p = Proxy::bind(seed).await?;
        p.set_target(target);
        Ok(p)
    }

    /// Starts a proxy on a fresh loopback port whose target is not known yet (the server it
    /// leads to picks its port when it starts): connections wait until [`Proxy::set_target`].
    pub async fn bind(seed: u64) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?.to_string();
        let (tx, rx) = watch::channel(Fault::default());
        let (target, to) = watch::channel(None::<String>);
        let accepted = Arc::new(AtomicU64::new(0));
        let count = accepted.clone();
        let accept = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            let mut n: u64 = 0;
            loop {
                tokio::select! {
                    r = listener.accept() => {
                        let Ok((inbound, _)) = r else { continue };
                        count.fetch_add(1, Ordering::Relaxed);
                        n += 1;
                        let (to, rx) = (to.clone(), rx.clone());
                        conns.spawn(connection(inbound, to, rx, seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(Proxy { addr, target, fault: tx, accept, accepted })
    }

    /// Sets where traffic goes (connections accepted before wait for it).
    pub fn set_target(&self, target: String) {
        self.target.send_replace(Some(target));
    }

    /// Where traffic goes, once known.
    pub fn target(&self) -> Option<String> {
        self.target.borrow().clone()
    }

    /// Sets the link's fault (takes effect on live connections at their next chunk).
    pub fn set(&self, f: Fault) {
        self.fault.send_replace(f);
    }

    /// The link's fault now.
    pub fn fault(&self) -> Fault {
        *self.fault.borrow()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // Aborting the accept task drops its JoinSet, which aborts every connection.
        self.accept.abort();
    }
}

async fn connection(
    inbound: TcpStream,
    mut target: watch::Receiver<Option<String>>,
    mut fault: watch::Receiver<Fault>,
    seed: u64,
) {
    let target = match target.wait_for(Option::is_some).await {
        Ok(t) => t.clone().unwrap_or_default(),
        Err(_) => return,
    };
    // A blocked link carries nothing, not even the connection to the target.
    if fault.wait_for(|f| !f.blocked).await.is_err() {
        return;
    }
    let Ok(outbound) = TcpStream::connect(&target).await else { return };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (ri, wi) = inbound.into_split();
    let (ro, wo) = outbound.into_split();
    let up = pump(ri, wo, fault.clone(), DetRng::new(seed));
    let down = pump(ro, wi, fault, DetRng::new(seed.rotate_left(17)));
    // Either direction ending (EOF, error, reset) ends both.
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut fault: watch::Receiver<Fault>,
    mut rng: DetRng,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if fault.wait_for(|f| !f.blocked).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // A block that began while this chunk was in flight holds it too.
        let f = match fault.wait_for(|f| !f.blocked).await {
            Ok(f) => *f,
            Err(_) => return,
        };
        if f.reset_per_mille > 0 && rng.below(1000) < u64::from(f.reset_per_mille) {
            return;
        }
        if f.delay_ms > 0 {
            tokio::time::sleep(Duration::from_millis(f.delay_ms)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    async fn echo_server() -> String {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut b = [0u8; 1024];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn forwards_blocks_and_heals() {
        let target = echo_server().await;
        let p = Proxy::start(target, 1).await.unwrap();
        let mut c = TcpStream::connect(&p.addr).await.unwrap();
        let mut b = [0u8; 5];
        c.write_all(b"hello").await.unwrap();
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"hello");

        p.set(Fault { blocked: true, ..Fault::default() });
        c.write_all(b"again").await.unwrap();
        let r = tokio::time::timeout(Duration::from_millis(300), c.read_exact(&mut b)).await;
        assert!(r.is_err(), "a blocked link delivered bytes");

        p.set(Fault::default());
        tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut b)).await.unwrap().unwrap();
        assert_eq!(&b, b"again", "held bytes flow once the partition heals");
    }

    #[tokio::test]
    async fn resets_break_the_connection() {
        let target = echo_server().await;
        let p = Proxy::start(target, 7).await.unwrap();
        p.set(Fault { reset_per_mille: 1000, ..Fault::default() });
        let mut c = TcpStream::connect(&p.addr).await.unwrap();
        c.write_all(b"x").await.unwrap();
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(5), c.read(&mut b)).await.unwrap();
        assert!(matches!(r, Ok(0) | Err(_)), "expected a closed connection, got {r:?}");
    }
}
