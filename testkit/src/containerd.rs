//! A private containerd per test: its own root, state, socket and config, with a proxy
//! snapshotter plugged in, driven through `ctr`.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::thread;
use std::time::{Duration, Instant};

use crate::spawn::spawn_tied;

/// A running containerd, stopped (and its directory removed) on drop.
pub struct Containerd {
    child: Child,
    dir: tempfile::TempDir,
    namespace: String,
}

impl Containerd {
    /// Starts containerd with a proxy snapshotter named `name` at the unix socket `snapshotter`.
    ///
    /// Returns `None`, after printing `skipping <test>: ...`, when containerd, ctr or runc is
    /// not installed and `CI` is not set; panics when `CI` is set and one is missing, or when
    /// containerd does not start (with its log).
    pub fn start(name: &str, snapshotter: &Path) -> Option<Containerd> {
        let missing: Vec<&str> = ["containerd", "ctr", "runc"]
            .into_iter()
            .filter(|b| which(b).is_none())
            .collect();
        if !missing.is_empty() {
            let why = format!(
                "{} not installed (Debian: apt-get install containerd runc; scripts/setup.sh does)",
                missing.join(", ")
            );
            if crate::seaweedfs::ci() {
                panic!("CI is set, so containerd tests may not be skipped: {why}");
            }
            let test = thread::current().name().unwrap_or("test").to_string();
            let _ = io::stderr().write_all(format!("skipping {test}: {why}\n").as_bytes());
            return None;
        }
        // Short paths: containerd's sockets live under the state directory.
        let dir = tempfile::Builder::new()
            .prefix("hs-ctrd-")
            .tempdir_in("/tmp")
            .expect("a temporary directory");
        let config = dir.path().join("config.toml");
        std::fs::write(
            &config,
            format!(
                r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{ttrpc}"
[proxy_plugins]
  [proxy_plugins.{name}]
    type = "snapshot"
    address = "{snapshotter}"
"#,
                root = dir.path().join("root").display(),
                state = dir.path().join("state").display(),
                sock = dir.path().join("c.sock").display(),
                ttrpc = dir.path().join("c.ttrpc").display(),
                snapshotter = snapshotter.display(),
            ),
        )
        .expect("write containerd's config");
        let log = std::fs::File::create(dir.path().join("containerd.log")).expect("log file");
        let mut cmd = Command::new("containerd");
        cmd.arg("--config")
            .arg(&config)
            .stdout(log.try_clone().expect("log file"))
            .stderr(log);
        let child = spawn_tied(cmd, None).expect("start containerd");
        let mut c = Containerd {
            child,
            dir,
            namespace: "hotstart-test".into(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if c.ctr(&["version"]).status.success() {
                return Some(c);
            }
            if let Ok(Some(status)) = c.child.try_wait() {
                panic!("containerd exited ({status}):\n{}", c.log());
            }
            if Instant::now() > deadline {
                panic!("containerd did not answer within 30 s:\n{}", c.log());
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Runs `ctr` against this containerd, in the test namespace.
    pub fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("--address")
            .arg(self.dir.path().join("c.sock"))
            .args(["--namespace", &self.namespace])
            .args(args)
            .output()
            .expect("run ctr")
    }

    /// [`Containerd::ctr`], which must succeed; returns its stdout.
    pub fn ctr_ok(&self, args: &[&str]) -> String {
        let out = self.ctr(args);
        assert!(
            out.status.success(),
            "ctr {args:?} failed: {}\n{}\ncontainerd's log:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The tail of containerd's log.
    pub fn log(&self) -> String {
        let text =
            std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// containerd's root directory (its content store and metadata).
    pub fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // SAFETY: plain kill(2) of our own child's pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(bin))
        .find(|p| p.is_file())
}
