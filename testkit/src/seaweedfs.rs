//! A real SeaweedFS S3 server (`weed server -s3`) for tests and benchmarks.
//!
//! How a server starts:
//! 1. Pick eight free 127.0.0.1 ports (master, volume, filer and S3, each with its gRPC port set
//!    explicitly, so the default "port + 10000" gRPC ports never collide) by binding port 0.
//! 2. Make a temp dir `$TMPDIR/hotstart-weed-<pid>-XXXX` holding `data/`, `weed.log` (the
//!    server's stdout and stderr), the `ports` file and weed's own glog files (`TMPDIR` points
//!    there for the child).
//! 3. Spawn `weed server` through [`crate::spawn`], so the kernel kills it if this process dies.
//! 4. Poll until it is really usable: `GET /` answers 200, then a probe bucket and object can be
//!    created, read back and deleted (the first write waits for the volume server to register).
//!    On failure the error carries the log tail; a lost port race is retried with new ports.
//!
//! Auth: with no `-s3.config`, SeaweedFS accepts both unsigned requests and requests signed
//! with any AWS keys, so [`SeaweedFs::env`] returns fixed dummy keys.
//!
//! Cleanup: [`SeaweedFs::stop`] (also on drop) SIGKILLs the server (a graceful stop takes ~15 s
//! and the data is disposable), removes the temp dir and the gRPC unix sockets weed leaves in
//! `/tmp` (`/tmp/seaweedfs-*-grpc-<port>.sock`, a path weed hard-codes). The shared server is
//! stopped by an `atexit` handler. If the process is SIGKILLed, `PR_SET_PDEATHSIG` kills the
//! server and the next start in any process removes the orphaned temp dir and sockets (those
//! whose owner pid is no longer alive).

use std::env;
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{self, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, TryLockError};
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::http::{self, Response};
use crate::locate::find_weed;
use crate::spawn::spawn_tied;

/// How long a server may take to become usable (a cold start takes 3–5 s).
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Timeout of each request the helpers make.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Volume size limit: small volumes start fast and are not preallocated.
const VOLUME_SIZE_LIMIT_MB: u32 = 64;
/// Upper bound on volumes. Each bucket is a collection that grows 7 volumes on first write;
/// a fixed bound (not `-volume.max=0`, "free disk / volume size") keeps many test buckets
/// working on a small disk. Volumes are not preallocated (files grow as written), so the
/// bound costs nothing.
const MAX_VOLUMES: u32 = 10_000;
/// Temp dir name prefix; the owner's pid follows it.
const DIR_PREFIX: &str = "hotstart-weed-";
/// Where weed puts its gRPC unix sockets, whatever `TMPDIR` says.
const WEED_SOCKET_DIR: &str = "/tmp";
/// Attempts when another process takes one of the picked ports before weed binds it.
const PORT_ATTEMPTS: u32 = 3;

/// The dummy credentials returned by [`SeaweedFs::env`]; SeaweedFS without identities accepts
/// any signature.
const ACCESS_KEY_ID: &str = "hotstart-test";
const SECRET_ACCESS_KEY: &str = "hotstart-test-secret";

/// A blob stored by [`SeaweedFs::put_blob`]: its volume server and file id.
#[derive(Debug, Clone)]
pub struct Blob {
    volume: SocketAddr,
    fid: String,
}

impl Blob {
    fn path(&self) -> String {
        format!("/{}", self.fid)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ports {
    master: u16,
    master_grpc: u16,
    volume: u16,
    volume_grpc: u16,
    filer: u16,
    filer_grpc: u16,
    s3: u16,
    s3_grpc: u16,
}

impl Ports {
    /// Eight distinct ports that are free on 127.0.0.1 right now.
    fn pick() -> io::Result<Ports> {
        let listeners = (0..8)
            .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
            .collect::<io::Result<Vec<_>>>()?;
        let p = listeners
            .iter()
            .map(|l| l.local_addr().map(|a| a.port()))
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Ports::from_slice(&p).expect("eight ports"))
    }

    fn from_slice(p: &[u16]) -> Option<Ports> {
        let &[
            master,
            master_grpc,
            volume,
            volume_grpc,
            filer,
            filer_grpc,
            s3,
            s3_grpc,
        ] = p
        else {
            return None;
        };
        Some(Ports {
            master,
            master_grpc,
            volume,
            volume_grpc,
            filer,
            filer_grpc,
            s3,
            s3_grpc,
        })
    }

    fn all(&self) -> [u16; 8] {
        [
            self.master,
            self.master_grpc,
            self.volume,
            self.volume_grpc,
            self.filer,
            self.filer_grpc,
            self.s3,
            self.s3_grpc,
        ]
    }

    fn to_line(self) -> String {
        self.all().map(|p| p.to_string()).join(" ")
    }

    fn parse(line: &str) -> Option<Ports> {
        let p: Vec<u16> = line
            .split_whitespace()
            .map(|s| s.parse().ok())
            .collect::<Option<_>>()?;
        Ports::from_slice(&p)
    }

    /// The unix sockets weed creates in `/tmp` for these ports.
    fn weed_sockets(&self) -> Vec<PathBuf> {
        [
            ("master-grpc", self.master_grpc),
            ("volume-grpc", self.volume_grpc),
            ("filer-grpc", self.filer_grpc),
            ("s3-grpc", self.s3_grpc),
            ("filer", self.filer),
            ("s3", self.s3),
        ]
        .iter()
        .map(|(what, port)| {
            Path::new(WEED_SOCKET_DIR).join(format!("seaweedfs-{what}-{port}.sock"))
        })
        .collect()
    }
}

struct State {
    child: Option<Child>,
    dir: Option<TempDir>,
}

/// A running SeaweedFS server with its S3 gateway (master, volume server, filer and S3 in one
/// `weed server` process), its data in a temp dir, stopped on [`SeaweedFs::stop`] or drop.
pub struct SeaweedFs {
    ip: Ipv4Addr,
    ports: Ports,
    dir: PathBuf,
    pid: u32,
    state: Mutex<State>,
}

enum Shared {
    Up(SeaweedFs),
    /// `weed` is not installed: tests skip, unless CI is set.
    Missing(io::Error),
    /// `weed` is installed but the server did not start: always a failure.
    Broken(io::Error),
}

static SHARED: OnceLock<Shared> = OnceLock::new();

impl SeaweedFs {
    /// The server shared by every test in this process, started on first use.
    ///
    /// Returns `None`, after printing `skipping <test>: <why>` on stderr, when `weed` is not
    /// found and `CI` is not set. Panics with the reason when `CI` is set (non-empty, not
    /// `false`/`0`) and `weed` is not found, and whenever `weed` is found but the server does
    /// not start (with the server's log tail). Killed, and its temp dir removed, when the
    /// process exits, and killed by the kernel if the process is SIGKILLed.
    pub fn shared() -> Option<&'static SeaweedFs> {
        let shared = SHARED.get_or_init(|| {
            let weed = match find_weed() {
                Ok(weed) => weed,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Shared::Missing(e),
                Err(e) => return Shared::Broken(e),
            };
            match SeaweedFs::start_with(&weed, None, Ipv4Addr::LOCALHOST) {
                Ok(server) => {
                    // SAFETY: registers a plain `extern "C" fn` that captures nothing; it only
                    // reads a static and does not unwind (see `stop_shared_at_exit`).
                    if unsafe { libc::atexit(stop_shared_at_exit) } != 0 {
                        eprintln!("testkit: atexit failed; the kernel will kill weed at exit");
                    }
                    Shared::Up(server)
                }
                Err(e) => Shared::Broken(e),
            }
        });
        match shared {
            Shared::Up(server) => Some(server),
            Shared::Missing(e) if !ci() => {
                let test = thread::current().name().unwrap_or("test").to_string();
                // Straight to fd 2, past the test harness's output capture, so it is seen.
                let line = format!("skipping {test}: SeaweedFS not available: {e}\n");
                let _ = io::stderr().write_all(line.as_bytes());
                None
            }
            Shared::Missing(e) => panic!("CI is set, so SeaweedFS tests may not be skipped: {e}"),
            Shared::Broken(e) => panic!("the shared SeaweedFS server did not start: {e}"),
        }
    }

    /// Starts a private server on 127.0.0.1 (benchmarks use this to own their server).
    pub fn start() -> io::Result<SeaweedFs> {
        SeaweedFs::start_with(&find_weed()?, None, Ipv4Addr::LOCALHOST)
    }

    /// Starts a private server inside the network namespace `netns` (as made by
    /// `benches/netem.sh up`), listening on `ip`, an address of that namespace. Clients in this
    /// process reach it over the namespace's link. Needs CAP_SYS_ADMIN (root).
    pub fn start_in_netns(netns: &str, ip: Ipv4Addr) -> io::Result<SeaweedFs> {
        SeaweedFs::start_with(&find_weed()?, Some(netns), ip)
    }

    fn start_with(weed: &Path, netns: Option<&str>, ip: Ipv4Addr) -> io::Result<SeaweedFs> {
        sweep_orphans();
        let mut attempt = 1;
        loop {
            match SeaweedFs::try_start(weed, netns, ip) {
                Err(e) if e.kind() == io::ErrorKind::AddrInUse && attempt < PORT_ATTEMPTS => {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    fn try_start(weed: &Path, netns: Option<&str>, ip: Ipv4Addr) -> io::Result<SeaweedFs> {
        let ports = Ports::pick()?;
        let tmp = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .tempdir()?;
        let dir = tmp.path().to_path_buf();
        fs::write(dir.join("ports"), ports.to_line())?;
        fs::create_dir(dir.join("data"))?;
        let log = File::create(dir.join("weed.log"))?;
        let mut cmd = Command::new(weed);
        cmd.arg("server")
            .arg(format!("-dir={}", dir.join("data").display()))
            .arg(format!("-ip={ip}"))
            .arg(format!("-ip.bind={ip}"))
            .arg(format!("-master.port={}", ports.master))
            .arg(format!("-master.port.grpc={}", ports.master_grpc))
            .arg(format!("-master.volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}"))
            .arg(format!("-volume.port={}", ports.volume))
            .arg(format!("-volume.port.grpc={}", ports.volume_grpc))
            .arg(format!("-volume.max={MAX_VOLUMES}"))
            .arg("-master.telemetry=false")
            .arg("-volume.preStopSeconds=0")
            .arg("-filer")
            .arg(format!("-filer.port={}", ports.filer))
            .arg(format!("-filer.port.grpc={}", ports.filer_grpc))
            .arg(format!(
                "-filer.localSocket={}",
                dir.join("filer.sock").display()
            ))
            .arg("-s3")
            .arg(format!("-s3.port={}", ports.s3))
            .arg(format!("-s3.port.grpc={}", ports.s3_grpc))
            .arg(format!("-s3.localSocket={}", dir.join("s3.sock").display()))
            // Iceberg and Lance catalogs listen on fixed ports (8181, 9101) unless disabled.
            .arg("-s3.port.iceberg=0")
            .arg("-s3.port.lance=0")
            .env("TMPDIR", &dir)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = spawn_tied(cmd, netns)
            .map_err(|e| io::Error::new(e.kind(), format!("spawn {}: {e}", weed.display())))?;
        let server = SeaweedFs {
            ip,
            ports,
            dir,
            pid: child.id(),
            state: Mutex::new(State {
                child: Some(child),
                dir: Some(tmp),
            }),
        };
        // On error `server` drops here, which kills weed and removes the temp dir.
        server.wait_ready(READY_TIMEOUT)?;
        Ok(server)
    }

    /// The S3 endpoint, `http://IP:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}:{}", self.ip, self.ports.s3)
    }

    /// The S3 endpoint's socket address.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((self.ip, self.ports.s3))
    }

    /// The filer, as weed's own clients take it: `IP:PORT.GRPC_PORT` (e.g. for
    /// `weed mount -filer=...`; S3 bucket `B` is the filer directory `/buckets/B`).
    pub fn filer_address(&self) -> String {
        format!("{}:{}.{}", self.ip, self.ports.filer, self.ports.filer_grpc)
    }

    /// The pid of the `weed` process (for fault injection: stop it, kill it).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The server's temp dir: `data/`, `weed.log` (the server's output) and weed's glog files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Creates bucket `name`; succeeds if it already exists.
    pub fn create_bucket(&self, name: &str) -> io::Result<()> {
        let r = self.request("PUT", &format!("/{name}"), &[], &[])?;
        let exists = r.status == 409 && r.text().contains("BucketAlreadyOwnedByYou");
        if r.status == 200 || exists {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "PUT /{name}: HTTP {}: {}",
                r.status,
                r.text()
            )))
        }
    }

    /// Creates a bucket with a new name (`prefix` made S3-safe, a counter and the pid) and
    /// returns its URL, `s3://NAME`. Panics if the bucket cannot be created.
    pub fn fresh_bucket(&self, prefix: &str) -> String {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let suffix = format!(
            "-{}-{}",
            COUNTER.fetch_add(1, Ordering::Relaxed),
            std::process::id()
        );
        let name = bucket_name(prefix, &suffix);
        if let Err(e) = self.create_bucket(&name) {
            panic!(
                "fresh_bucket: cannot create bucket {name} on {}: {e}",
                self.endpoint()
            );
        }
        format!("s3://{name}")
    }

    /// The variables an S3 client needs for this server: `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`,
    /// `AWS_REGION`, `AWS_DEFAULT_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (dummy
    /// keys; any signature is accepted). Set them on a child process or, before any threads
    /// read the environment, on this one.
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT_URL", self.endpoint().as_str()),
            ("AWS_ALLOW_HTTP", "true"),
            ("AWS_REGION", "us-east-1"),
            ("AWS_DEFAULT_REGION", "us-east-1"),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID),
            ("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// The same settings as [`SeaweedFs::env`] as object_store configuration keys
    /// (`aws_endpoint_url`, ...), for `hotstart_store::Store::open_with`.
    pub fn client_options(&self) -> Vec<(String, String)> {
        self.env()
            .into_iter()
            .map(|(k, v)| (k.to_ascii_lowercase(), v))
            .collect()
    }

    /// Stores `body` as one blob the way weed's own clients (`weed mount`, `weed upload`) write
    /// data: a file id from the master's `/dir/assign`, then one PUT straight to the volume
    /// server it names, with neither the S3 gateway nor the filer in between. Returns where the
    /// blob is, for [`SeaweedFs::get_blob`]. For measuring what that path costs the server.
    pub fn put_blob(&self, collection: &str, body: &[u8]) -> io::Result<Blob> {
        let master = SocketAddr::from((self.ip, self.ports.master));
        let path = format!("/dir/assign?collection={collection}");
        let started = Instant::now();
        let (r, assigned) = loop {
            let r = http::request(master, "GET", &path, &[], &[], REQUEST_TIMEOUT)?;
            let assigned: serde_json::Value = serde_json::from_slice(&r.body)
                .map_err(|e| io::Error::other(format!("{path}: {e}: {}", r.text())))?;
            // A collection's first write waits while the master grows its volumes.
            let growing = assigned["error"]
                .as_str()
                .is_some_and(|e| e.contains("growth in progress"));
            if !growing || started.elapsed() > READY_TIMEOUT {
                break (r, assigned);
            }
            thread::sleep(Duration::from_millis(50));
        };
        let field = |name: &str| {
            assigned[name]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| io::Error::other(format!("{path}: no {name} in {}", r.text())))
        };
        let volume: SocketAddr = field("url")?
            .parse()
            .map_err(|e| io::Error::other(format!("{path}: volume address: {e}")))?;
        let blob = Blob {
            volume,
            fid: field("fid")?,
        };
        let r = http::request(volume, "PUT", &blob.path(), &[], body, REQUEST_TIMEOUT)?;
        if r.status != 201 && r.status != 200 {
            return Err(io::Error::other(format!(
                "PUT {}: HTTP {}: {}",
                blob.path(),
                r.status,
                r.text()
            )));
        }
        Ok(blob)
    }

    /// The bytes of a blob [`SeaweedFs::put_blob`] stored, read from its volume server.
    pub fn get_blob(&self, blob: &Blob) -> io::Result<Vec<u8>> {
        let r = http::request(blob.volume, "GET", &blob.path(), &[], &[], REQUEST_TIMEOUT)?;
        if r.status != 200 {
            return Err(io::Error::other(format!(
                "GET {}: HTTP {}",
                blob.path(),
                r.status
            )));
        }
        Ok(r.body)
    }

    /// One unsigned HTTP request to the S3 endpoint, e.g. `request("GET", "/bucket/key", &[],
    /// &[])`, for checking objects independently of the client under test. The path must be
    /// URL-encoded already.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> io::Result<Response> {
        http::request(self.addr(), method, path, headers, body, REQUEST_TIMEOUT)
    }

    /// Kills the server and removes its temp dir. Idempotent; also done on drop.
    pub fn stop(&mut self) {
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        cleanup(state, &self.ports);
    }

    fn wait_ready(&self, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                return Err(self.startup_error(format!("weed exited ({status}) during startup")));
            }
            let last = match self.probe() {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if self.log_tail().contains("address already in use") {
                return Err(self.startup_error("a port was taken before weed bound it".into()));
            }
            if Instant::now() >= deadline {
                return Err(self.startup_error(format!(
                    "S3 endpoint {} not usable after {timeout:?} (last: {last})",
                    self.endpoint()
                )));
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Whether the server can store and return an object right now.
    fn probe(&self) -> io::Result<()> {
        let quick = |method: &str, path: &str, body: &[u8]| {
            http::request(self.addr(), method, path, &[], body, Duration::from_secs(5))
        };
        let r = quick("GET", "/", &[])?;
        if r.status != 200 {
            return Err(io::Error::other(format!("GET / -> {}", r.status)));
        }
        let bucket = "testkit-ready-probe";
        self.create_bucket(bucket)?;
        let path = format!("/{bucket}/probe");
        let r = quick("PUT", &path, b"ready")?;
        if r.status != 200 {
            return Err(io::Error::other(format!(
                "PUT {path} -> {}: {}",
                r.status,
                r.text()
            )));
        }
        let r = quick("GET", &path, &[])?;
        if r.status != 200 || r.body != b"ready" {
            return Err(io::Error::other(format!(
                "GET {path} -> {}: {}",
                r.status,
                r.text()
            )));
        }
        // Best effort: leave no probe bucket behind to show up in listings.
        let _ = quick("DELETE", &path, &[]);
        let _ = quick("DELETE", &format!("/{bucket}"), &[]);
        Ok(())
    }

    fn exited(&self) -> Option<ExitStatus> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        state
            .child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    fn log_tail(&self) -> String {
        const TAIL: usize = 6000;
        let log = fs::read(self.dir.join("weed.log")).unwrap_or_default();
        let mut start = log.len().saturating_sub(TAIL);
        if start > 0 {
            // Begin at a whole line.
            start += log[start..]
                .iter()
                .position(|&b| b == b'\n')
                .map_or(0, |i| i + 1);
        }
        String::from_utf8_lossy(&log[start..]).into_owned()
    }

    fn startup_error(&self, what: String) -> io::Error {
        let tail = self.log_tail();
        let kind = if tail.contains("address already in use") {
            io::ErrorKind::AddrInUse
        } else {
            io::ErrorKind::Other
        };
        let mut msg = format!("{what}; tail of weed.log:\n");
        let lines: Vec<&str> = tail.lines().collect();
        for line in &lines[lines.len().saturating_sub(40)..] {
            let _ = writeln!(msg, "    {line}");
        }
        io::Error::new(kind, msg)
    }
}

impl Drop for SeaweedFs {
    fn drop(&mut self) {
        self.stop();
    }
}

impl std::fmt::Debug for SeaweedFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeaweedFs")
            .field("endpoint", &self.endpoint())
            .field("pid", &self.pid)
            .field("dir", &self.dir)
            .finish()
    }
}

/// Kills the child, removes the sockets it left in /tmp and its temp dir.
fn cleanup(state: &mut State, ports: &Ports) {
    if let Some(mut child) = state.child.take() {
        let _ = child.kill();
        let _ = child.wait();
        remove_sockets(ports);
    }
    if let Some(dir) = state.dir.take() {
        let path = dir.path().to_path_buf();
        if let Err(e) = dir.close() {
            eprintln!("testkit: cannot remove {}: {e}", path.display());
        }
    }
}

fn remove_sockets(ports: &Ports) {
    for socket in ports.weed_sockets() {
        if fs::symlink_metadata(&socket).is_ok_and(|m| m.file_type().is_socket()) {
            let _ = fs::remove_file(&socket);
        }
    }
}

extern "C" fn stop_shared_at_exit() {
    // Must not unwind into C, and must not block on a lock another thread might hold at exit.
    let _ = std::panic::catch_unwind(|| {
        if let Some(Shared::Up(server)) = SHARED.get() {
            let mut state = match server.state.try_lock() {
                Ok(state) => state,
                Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                Err(TryLockError::WouldBlock) => return, // PDEATHSIG still kills weed
            };
            cleanup(&mut state, &server.ports);
        }
    });
}

/// Removes temp dirs (and their sockets) left by processes that died without cleaning up.
fn sweep_orphans() {
    let Ok(entries) = fs::read_dir(env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(owner) = name
            .to_str()
            .and_then(|n| n.strip_prefix(DIR_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        if process_alive(owner) {
            continue;
        }
        let path = entry.path();
        if let Some(ports) = fs::read_to_string(path.join("ports"))
            .ok()
            .and_then(|l| Ports::parse(&l))
        {
            remove_sockets(&ports);
        }
        let _ = fs::remove_dir_all(&path);
    }
}

fn process_alive(pid: libc::pid_t) -> bool {
    if pid <= 0 {
        return true; // not a pid we wrote; leave it alone
    }
    // SAFETY: signal 0 only checks whether the process exists and may be signalled.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Whether the CI variable asks for no skipping: a test that cannot find what it needs then
/// fails instead of skipping.
pub fn ci() -> bool {
    env::var("CI").is_ok_and(|v| {
        let v = v.trim();
        !v.is_empty() && !v.eq_ignore_ascii_case("false") && v != "0"
    })
}

/// `prefix` made into a valid S3 bucket name ending in `suffix` (at most 63 characters).
fn bucket_name(prefix: &str, suffix: &str) -> String {
    let cleaned: String = prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let mut stem = cleaned.trim_matches('-').to_string();
    if stem.is_empty() {
        stem = "test".to_string();
    }
    stem.truncate(63usize.saturating_sub(suffix.len()).max(1));
    let stem = stem.trim_end_matches('-');
    format!("{stem}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_names_are_valid() {
        assert_eq!(bucket_name("Striped_Read", "-3-42"), "striped-read-3-42");
        assert_eq!(bucket_name("__", "-0-1"), "test-0-1");
        let long = bucket_name(&"x".repeat(100), "-12-345678");
        assert_eq!(long.len(), 63);
        assert!(long.ends_with("-12-345678"));
    }

    #[test]
    fn ports_round_trip() {
        let p = Ports::pick().expect("ports");
        assert_eq!(Ports::parse(&p.to_line()), Some(p));
        let mut all = p.all().to_vec();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 8);
    }
}
