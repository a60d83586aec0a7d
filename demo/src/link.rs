//! Fault proxies on the peer links: a network partition between chosen sidecars, on one machine.
//!
//! Every sidecar reaches each peer through a proxy of its own for that direction (node `i`'s
//! `--peers` names, for node `j`, the port of the proxy `i → j`, which forwards to `j`'s
//! listener). On loopback every connection comes from 127.0.0.1, so packet filters cannot tell
//! the links apart; a proxy per directed link can.
//!
//! A cut link behaves as a partitioned network does, not as a refused one: nothing is closed,
//! bytes stop moving. Connections open across the cut stall (the sender's writes and the
//! receiver's reads wait, so the sidecars' own timeouts decide what gives up); a connection made
//! during the cut is accepted but reaches the peer only once the link heals, as a SYN
//! retransmitted until the route is back. When the link heals, what was held moves on.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::{Error, Result};

/// How often a stalled direction looks again at whether its link healed.
const POLL: Duration = Duration::from_millis(10);

/// One proxy per ordered pair of nodes.
pub struct Links {
    nodes: usize,
    /// `nodes × nodes`, row `from`, column `to` (the diagonal unused).
    ports: Vec<u16>,
    cut: Vec<Arc<AtomicBool>>,
    stop: Arc<AtomicBool>,
}

impl Links {
    /// Proxies between `targets.len()` nodes; node `j` listens for peers on `targets[j]`.
    pub fn start(targets: &[u16]) -> Result<Links> {
        let nodes = targets.len();
        let stop = Arc::new(AtomicBool::new(false));
        let mut ports = vec![0; nodes * nodes];
        let mut cut = Vec::with_capacity(nodes * nodes);
        for from in 0..nodes {
            for (to, &target) in targets.iter().enumerate() {
                let flag = Arc::new(AtomicBool::new(false));
                cut.push(flag.clone());
                if from == to {
                    continue;
                }
                let listener = TcpListener::bind("127.0.0.1:0")
                    .map_err(|e| Error::io("bind a peer link's proxy", e))?;
                ports[from * nodes + to] = listener
                    .local_addr()
                    .map_err(|e| Error::io("bind a peer link's proxy", e))?
                    .port();
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name(format!("demo-link-{from}-{to}"))
                    .spawn(move || accept(listener, target, flag, stop))
                    .map_err(|e| Error::io("start a peer link's proxy", e))?;
            }
        }
        Ok(Links {
            nodes,
            ports,
            cut,
            stop,
        })
    }

    /// The port node `from` reaches node `to` at.
    pub fn port(&self, from: usize, to: usize) -> u16 {
        self.ports[from * self.nodes + to]
    }

    /// Cuts (or heals) both directions between nodes `a` and `b`.
    pub fn set_cut(&self, a: usize, b: usize, cut: bool) {
        self.cut[a * self.nodes + b].store(cut, Ordering::SeqCst);
        self.cut[b * self.nodes + a].store(cut, Ordering::SeqCst);
    }

    /// Heals every link.
    pub fn heal_all(&self) {
        for c in &self.cut {
            c.store(false, Ordering::SeqCst);
        }
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.heal_all();
        // Wake every accept loop so it sees `stop` and its listener closes.
        for &p in self.ports.iter().filter(|&&p| p != 0) {
            let _ = TcpStream::connect(("127.0.0.1", p));
        }
    }
}

fn accept(listener: TcpListener, target: u16, cut: Arc<AtomicBool>, stop: Arc<AtomicBool>) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = conn else { continue };
        let (cut, stop) = (cut.clone(), stop.clone());
        let _ = std::thread::Builder::new()
            .name("demo-link-conn".into())
            .spawn(move || forward(client, target, cut, stop));
    }
}

/// Waits while the link is cut; false once the proxies stop.
fn wait_healed(cut: &AtomicBool, stop: &AtomicBool) -> bool {
    while cut.load(Ordering::SeqCst) {
        if stop.load(Ordering::SeqCst) {
            return false;
        }
        std::thread::sleep(POLL);
    }
    !stop.load(Ordering::SeqCst)
}

/// Carries one connection to the peer: connects once the link is up (a refused connection, the
/// peer being down, closes the client's), then moves bytes both ways.
fn forward(client: TcpStream, target: u16, cut: Arc<AtomicBool>, stop: Arc<AtomicBool>) {
    if !wait_healed(&cut, &stop) {
        return;
    }
    let Ok(upstream) = TcpStream::connect(("127.0.0.1", target)) else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (Ok(c2), Ok(u2)) = (client.try_clone(), upstream.try_clone()) else {
        return;
    };
    let (cut2, stop2) = (cut.clone(), stop.clone());
    let back = std::thread::Builder::new()
        .name("demo-link-back".into())
        .spawn(move || pump(u2, c2, &cut2, &stop2));
    pump(client, upstream, &cut, &stop);
    if let Ok(t) = back {
        let _ = t.join();
    }
}

/// Copies `from` to `to` until either end closes; while the link is cut, what was read waits.
fn pump(mut from: TcpStream, mut to: TcpStream, cut: &AtomicBool, stop: &AtomicBool) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if !wait_healed(cut, stop) || to.write_all(&buf[..n]).is_err() {
            let _ = from.shutdown(Shutdown::Both);
            let _ = to.shutdown(Shutdown::Both);
            return;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// An echo server; its port.
    fn echo() -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let mut c = c.unwrap();
                std::thread::spawn(move || {
                    let mut r = c.try_clone().unwrap();
                    let _ = std::io::copy(&mut r, &mut c);
                });
            }
        });
        port
    }

    fn round_trip(s: &mut TcpStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        s.write_all(msg)?;
        let mut got = vec![0; msg.len()];
        s.read_exact(&mut got)?;
        Ok(got)
    }

    #[test]
    fn a_cut_link_holds_bytes_until_it_heals_and_loses_none() {
        let links = Links::start(&[echo(), echo()]).unwrap();
        let mut s = TcpStream::connect(("127.0.0.1", links.port(0, 1))).unwrap();
        assert_eq!(round_trip(&mut s, b"before").unwrap(), b"before");

        links.set_cut(1, 0, true);
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let err = round_trip(&mut s, b"during").unwrap_err();
        assert!(
            matches!(
                err.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "{err}"
        );
        // A connection made during the cut is accepted but goes nowhere yet.
        let mut late = TcpStream::connect(("127.0.0.1", links.port(0, 1))).unwrap();
        late.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        assert!(round_trip(&mut late, b"late").is_err());

        let healed = Instant::now();
        links.set_cut(0, 1, false);
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = vec![0; 6];
        s.read_exact(&mut got).unwrap();
        assert_eq!(
            got, b"during",
            "the bytes held during the cut arrive, in order"
        );
        late.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = vec![0; 4];
        late.read_exact(&mut got).unwrap();
        assert_eq!(got, b"late");
        assert!(healed.elapsed() < Duration::from_secs(5));
        assert_eq!(round_trip(&mut s, b"after").unwrap(), b"after");
    }

    #[test]
    fn the_other_links_carry_on_through_a_cut() {
        let links = Links::start(&[echo(), echo(), echo()]).unwrap();
        links.set_cut(0, 1, true);
        let mut s = TcpStream::connect(("127.0.0.1", links.port(0, 2))).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(round_trip(&mut s, b"ok").unwrap(), b"ok");
        let mut s = TcpStream::connect(("127.0.0.1", links.port(2, 1))).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(round_trip(&mut s, b"ok").unwrap(), b"ok");
    }
}
