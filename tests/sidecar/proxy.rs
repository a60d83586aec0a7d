//! A TCP proxy in front of the object store, to make persistence slow (a bandwidth cap) or make
//! it hang (a black hole that accepts and never answers).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// When a proxy forwarded its first byte, and the bytes forwarded since by all its connections.
type Budget = Arc<Mutex<Option<(Instant, u64)>>>;

/// What the proxy does with the bytes.
#[derive(Debug, Clone, Copy)]
pub enum Mode {
    /// Forward to `upstream`, all connections together at most `bytes_per_sec`.
    Throttle {
        upstream: SocketAddr,
        bytes_per_sec: u64,
    },
    /// Accept and never answer.
    BlackHole,
}

/// Starts a proxy on a free loopback port; it lives as long as the process.
pub fn start(mode: Mode) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
    let addr = l.local_addr().expect("addr");
    let budget: Budget = Arc::new(Mutex::new(None));
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in l.incoming() {
            let Ok(conn) = conn else { continue };
            match mode {
                Mode::BlackHole => held.push(conn),
                Mode::Throttle {
                    upstream,
                    bytes_per_sec,
                } => {
                    let Ok(up) = TcpStream::connect(upstream) else {
                        continue;
                    };
                    let (a, b) = (conn.try_clone(), up.try_clone());
                    let (Ok(a), Ok(b)) = (a, b) else { continue };
                    let (b1, b2) = (budget.clone(), budget.clone());
                    std::thread::spawn(move || pump(conn, up, bytes_per_sec, b1));
                    std::thread::spawn(move || pump(b, a, bytes_per_sec, b2));
                }
            }
        }
    });
    addr
}

/// Copies `from` to `to`, keeping every connection's bytes together under `rate` a second.
fn pump(mut from: TcpStream, mut to: TcpStream, rate: u64, budget: Budget) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
        let (first, sent) = {
            let mut b = budget.lock().unwrap_or_else(|p| p.into_inner());
            let (first, total) = b.get_or_insert((Instant::now(), 0));
            *total += n as u64;
            (*first, *total)
        };
        let due = Duration::from_secs_f64(sent as f64 / rate as f64);
        if let Some(wait) = due.checked_sub(first.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
