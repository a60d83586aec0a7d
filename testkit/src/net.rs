//! Ports for the servers a test or benchmark starts.

use std::net::TcpListener;

/// A TCP port on 127.0.0.1 that is free now: the kernel picks it and the listener is closed
/// again, so another socket may take it before the caller binds it. Prefer letting the server
/// bind port 0 itself where it reports the port it got; use this where a port must be named
/// ahead (a child's command line).
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
