//! A small HTTP/1.1 responder for `/livez`, `/readyz` and `/metrics`.
//!
//! One request per connection: the request head is read (at most [`MAX_HEAD`] bytes, within
//! [`READ_TIMEOUT`]), the request line parsed, one response written with `Connection: close`,
//! and the connection closed. A request body is never read. Anything malformed gets `400`, an
//! unknown path `404`, a method other than `GET` or `HEAD` `405`, a head that is too large
//! `431`; a client that stalls is dropped. Nothing a client sends can make the responder
//! allocate more than `MAX_HEAD` bytes or hold a connection longer than the timeout.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::debug;

/// Largest request head read.
pub const MAX_HEAD: usize = 8 << 10;
/// How long a client has to send its request head.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// A response: status, content type, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Response {
    pub fn text(status: u16, body: impl Into<String>) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }
}

/// What the responder asks for each `GET path`.
pub trait Routes: Send + Sync + 'static {
    /// The response to `GET path`, or `None` for 404.
    fn get(&self, path: &str) -> Option<Response>;
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// Parses the request line of `head`: the method and the path (without a query).
fn request_line(head: &[u8]) -> Result<(&str, &str), u16> {
    let line_end = head.windows(2).position(|w| w == b"\r\n").ok_or(400u16)?;
    let line = std::str::from_utf8(&head[..line_end]).map_err(|_| 400u16)?;
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(400);
    };
    if !matches!(version, "HTTP/1.1" | "HTTP/1.0") || !target.starts_with('/') {
        return Err(400);
    }
    let path = target.split('?').next().unwrap_or(target);
    Ok((method, path))
}

/// The response to one request head.
pub fn respond(routes: &dyn Routes, head: &[u8]) -> (Response, bool) {
    match request_line(head) {
        Err(status) => (Response::text(status, "bad request\n"), false),
        Ok((method, path)) => {
            let head_only = method == "HEAD";
            if method != "GET" && !head_only {
                return (Response::text(405, "only GET and HEAD\n"), false);
            }
            let r = routes
                .get(path)
                .unwrap_or_else(|| Response::text(404, "not found\n"));
            (r, head_only)
        }
    }
}

async fn read_head(sock: &mut TcpStream) -> Result<Vec<u8>, u16> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    loop {
        let n = sock.read(&mut buf).await.map_err(|_| 400u16)?;
        if n == 0 {
            return Err(400);
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") {
            return Ok(head);
        }
        if head.len() > MAX_HEAD {
            return Err(431);
        }
    }
}

async fn serve_one(mut sock: TcpStream, routes: Arc<dyn Routes>) {
    let (resp, head_only) = match tokio::time::timeout(READ_TIMEOUT, read_head(&mut sock)).await {
        Err(_) => return, // stalled: drop
        Ok(Err(status)) => (Response::text(status, "bad request\n"), false),
        Ok(Ok(head)) => respond(routes.as_ref(), &head),
    };
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        resp.status,
        reason(resp.status),
        resp.content_type,
        resp.body.len()
    );
    if !head_only {
        out.push_str(&resp.body);
    }
    let write = async {
        sock.write_all(out.as_bytes()).await?;
        sock.shutdown().await
    };
    if let Err(e) = tokio::time::timeout(READ_TIMEOUT, write)
        .await
        .unwrap_or(Ok(()))
    {
        debug!(error = %e, "http response not sent");
    }
}

/// Binds `addr`; the listener and its actual address.
pub async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let l = TcpListener::bind(addr).await?;
    let a = l.local_addr()?;
    Ok((l, a))
}

/// Serves every connection on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, routes: Arc<dyn Routes>) {
    loop {
        match listener.accept().await {
            Ok((sock, _)) => {
                tokio::spawn(serve_one(sock, routes.clone()));
            }
            Err(e) => {
                debug!(error = %e, "http accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed;

    impl Routes for Fixed {
        fn get(&self, path: &str) -> Option<Response> {
            (path == "/livez").then(|| Response::text(200, "ok\n"))
        }
    }

    #[test]
    fn requests_are_parsed_strictly() {
        let r = |head: &[u8]| respond(&Fixed, head).0.status;
        assert_eq!(r(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"), 200);
        assert_eq!(r(b"GET /livez?verbose HTTP/1.0\r\n\r\n"), 200);
        assert!(respond(&Fixed, b"HEAD /livez HTTP/1.1\r\n\r\n").1);
        assert_eq!(r(b"GET /nope HTTP/1.1\r\n\r\n"), 404);
        assert_eq!(r(b"POST /livez HTTP/1.1\r\n\r\n"), 405);
        assert_eq!(r(b"GET /livez\r\n\r\n"), 400);
        assert_eq!(r(b"GET livez HTTP/1.1\r\n\r\n"), 400);
        assert_eq!(r(b"GET /livez HTTP/2.0\r\n\r\n"), 400);
        assert_eq!(r(b"GET  /livez HTTP/1.1\r\n\r\n"), 400);
        assert_eq!(r(b"\xff\xfe /livez HTTP/1.1\r\n\r\n"), 400);
        assert_eq!(r(b"garbage"), 400);
    }
}
