//! The SeaweedFS harness against a real `weed server`: objects round-trip over plain HTTP,
//! buckets are idempotent, and servers die with their owner, however it ends.

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use hotstart_testkit::SeaweedFs;

/// Bytes that differ at every offset, so a shifted or truncated body cannot compare equal.

#[test]
fn unsigned_put_then_get_returns_the_same_bytes() {
    let Some(s3) = SeaweedFs::shared() else {
        return;
    };
    let url = s3.fresh_bucket("testkit-roundtrip");
    let bucket = url.strip_prefix("s3://").expect("s3:// url");
    s3.create_bucket(bucket)
        .expect("creating an existing bucket again succeeds");

    let data = hotstart_testkit::pattern(3 << 20, 3);
    let put = s3
        .request("PUT", &format!("/{bucket}/dir/object.bin"), &[], &data)
        .expect("PUT");
    assert_eq!(put.status, 200, "PUT: {}", put.text());

    let get = s3
        .request("GET", &format!("/{bucket}/dir/object.bin"), &[], &[])
        .expect("GET");
    assert_eq!(get.status, 200, "GET: {}", get.text());
    assert_eq!(get.body.len(), data.len());
    assert!(get.body == data, "GET returned different bytes");

    let range = s3
        .request(
            "GET",
            &format!("/{bucket}/dir/object.bin"),
            &[("Range", "bytes=1000-1999")],
            &[],
        )
        .expect("ranged GET");
    assert_eq!(range.status, 206);
    assert_eq!(range.body, data[1000..2000]);

    let missing = s3
        .request("GET", &format!("/{bucket}/nope"), &[], &[])
        .expect("GET missing");
    assert_eq!(missing.status, 404);
}

#[test]
fn env_names_the_endpoint_and_fresh_buckets_differ() {
    let Some(s3) = SeaweedFs::shared() else {
        return;
    };
    let env = s3.env();
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(get("AWS_ENDPOINT_URL"), Some(s3.endpoint()));
    assert_eq!(get("AWS_ALLOW_HTTP").as_deref(), Some("true"));
    assert!(get("AWS_ACCESS_KEY_ID").is_some() && get("AWS_SECRET_ACCESS_KEY").is_some());
    assert_ne!(s3.fresh_bucket("same"), s3.fresh_bucket("same"));
}

/// A private server: usable, then gone (process, port and temp dir) after `stop`.
#[test]
fn private_server_stops_cleanly() {
    let Some(_) = SeaweedFs::shared() else { return }; // skips or fails like the others
    let mut server = SeaweedFs::start().expect("start a private server");
    server
        .create_bucket("private-bucket")
        .expect("create bucket");
    let put = server
        .request("PUT", "/private-bucket/k", &[], b"v")
        .expect("PUT");
    assert_eq!(put.status, 200);
    let (pid, dir, addr) = (server.pid(), server.dir().to_path_buf(), server.addr());
    server.stop();
    assert!(!alive(pid), "weed {pid} still running after stop");
    assert!(!dir.exists(), "{} left behind", dir.display());
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "{addr} still answers"
    );
}

/// Entry point for the child processes of the two tests below (does nothing otherwise): starts
/// the shared server, prints its pid and dir, then exits or hangs as told.
#[test]
fn child_process_helper() {
    let Ok(mode) = std::env::var("TESTKIT_CHILD_MODE") else {
        return;
    };
    let s3 = SeaweedFs::shared().expect("weed is available in the child");
    println!("WEED {} {}", s3.pid(), s3.dir().display());
    if mode == "hang" {
        thread::sleep(Duration::from_secs(600));
    }
}

/// Runs this test binary as a child that starts the shared server; returns the child and the
/// server's pid and dir.
fn spawn_child(mode: &str) -> (std::process::Child, u32, PathBuf) {
    let exe = std::env::current_exe().expect("current_exe");
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "child_process_helper",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TESTKIT_CHILD_MODE", mode)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the test binary");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    while let Some(line) = lines.next() {
        let line = line.expect("child stdout");
        if let Some((_, rest)) = line.split_once("WEED ") {
            let (pid, dir) = rest.split_once(' ').expect("pid and dir");
            // Keep reading, so the child's later output does not hit a closed pipe.
            thread::spawn(move || lines.for_each(drop));
            return (child, pid.parse().expect("pid"), PathBuf::from(dir));
        }
    }
    panic!(
        "child exited without starting the server: {:?}",
        child.wait()
    );
}

#[test]
fn shared_server_is_removed_when_the_process_exits() {
    let Some(_) = SeaweedFs::shared() else { return };
    let (mut child, pid, dir) = spawn_child("exit");
    assert!(child.wait().expect("wait").success());
    wait_dead(pid);
    assert!(!dir.exists(), "atexit left {} behind", dir.display());
}

#[test]
fn shared_server_dies_when_the_process_is_sigkilled() {
    let Some(_) = SeaweedFs::shared() else { return };
    let (mut child, pid, dir) = spawn_child("hang");
    assert!(alive(pid));
    child.kill().expect("SIGKILL the child");
    child.wait().expect("wait");
    wait_dead(pid);
    // The orphaned dir is swept by the next start in any process.
    let mut next = SeaweedFs::start().expect("start another server");
    assert!(!dir.exists(), "orphan {} was not swept", dir.display());
    next.stop();
}

fn wait_dead(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) {
        assert!(Instant::now() < deadline, "weed {pid} outlived its owner");
        thread::sleep(Duration::from_millis(50));
    }
}

/// Alive and not a zombie (an orphan's zombie lingers where pid 1 does not reap).
fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| rest.to_string()))
        .is_some_and(|rest| !rest.starts_with('Z') && !rest.starts_with('X'))
}
