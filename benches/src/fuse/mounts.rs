//! Starting and stopping the mounts the FUSE benchmark compares: hotstart's, in this process,
//! and the peers', as child processes. Each goes on a fresh directory, is waited for until the
//! kernel lists it in /proc/self/mountinfo, and is unmounted when dropped (`fusermount3 -u`,
//! lazily if still busy). A peer is configured only by the flags given here: AWS_* and RCLONE_*
//! variables of this environment are not passed on.

use std::fs::{self, File};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::ValueEnum;
use hotstart_fuse::{FsConfig, MountConfig, MountHandle};
use hotstart_store::Store;
use hotstart_testkit::SeaweedFs;
use tempfile::TempDir;

/// How long a peer may take to mount.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);

/// A FUSE mount of the store other than hotstart's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Peer {
    /// SeaweedFS's own FUSE mount.
    Weed,
    /// s3fs-fuse.
    S3fs,
    /// rclone mount.
    Rclone,
}

impl Peer {
    pub fn name(self) -> &'static str {
        match self {
            Peer::Weed => "weed mount",
            Peer::S3fs => "s3fs",
            Peer::Rclone => "rclone mount",
        }
    }
}

/// What serves a measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// StripedReader / StripedWriter in this process, no FUSE.
    Direct,
    /// `hotstart mount`; `tee: false` keeps no local copy of streamed files.
    Hotstart {
        tee: bool,
    },
    Peer(Peer),
    /// No mount and no client library: the same bytes as plain HTTP PUTs of one stripe each,
    /// [`RAW_STREAMS`](super::RAW_STREAMS) at once (writes only).
    Raw(Raw),
}

/// Where raw PUTs go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Raw {
    /// The S3 gateway, as every S3 client writes (it hands the bytes to the filer, which hands
    /// them to the volume server).
    Gateway,
    /// The volume server itself, as `weed mount` writes (a file id from the master, then the
    /// bytes straight to the volume server).
    Volume,
}

impl Target {
    pub fn name(self) -> String {
        match self {
            Target::Direct => "no FUSE".into(),
            Target::Hotstart { tee: true } => "hotstart mount".into(),
            Target::Hotstart { tee: false } => "hotstart mount, no local copy".into(),
            Target::Peer(p) => p.name().into(),
            Target::Raw(Raw::Gateway) => "raw PUTs to the S3 gateway".into(),
            Target::Raw(Raw::Volume) => "raw PUTs to the volume server".into(),
        }
    }
}

enum Serving {
    Hotstart(Option<MountHandle>),
    Child(Child),
}

/// A fresh mount of the bucket; unmounted on drop.
pub struct Mounted {
    dir: TempDir,
    serving: Serving,
}

impl Mounted {
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        match &mut self.serving {
            Serving::Hotstart(handle) => {
                if let Some(Err(e)) = handle.take().map(MountHandle::unmount) {
                    eprintln!("unmount {}: {e}", self.dir.path().display());
                }
            }
            Serving::Child(child) => {
                let mp = self.dir.path();
                let unmounted = (0..20).any(|_| {
                    let ok = fusermount(&["-u"], mp);
                    if !ok {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    ok
                });
                if !unmounted {
                    fusermount(&["-uz"], mp);
                }
                let deadline = Instant::now() + Duration::from_secs(10);
                while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

fn fusermount(args: &[&str], mp: &Path) -> bool {
    Command::new("fusermount3")
        .args(args)
        .arg(mp)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn is_mounted(mp: &Path) -> bool {
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let mp = mp.to_string_lossy();
    info.lines()
        .any(|l| l.split(' ').nth(4) == Some(mp.as_ref()))
}

fn log_tail(log: &Path) -> String {
    let text = fs::read_to_string(log).unwrap_or_default();
    let tail: Vec<&str> = text.lines().rev().take(15).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// Where the bucket is served from.
pub struct Server<'a> {
    pub weed: &'a SeaweedFs,
    pub bucket: &'a str,
    pub store: &'a Store,
    /// The runtime hotstart's mount serves requests on.
    pub rt: &'a tokio::runtime::Handle,
    /// Mount points, logs and the peers' temporary files go here.
    pub scratch: &'a Path,
}

impl Server<'_> {
    fn keys(&self) -> (String, String) {
        let env = self.weed.env();
        let get = |k: &str| {
            env.iter()
                .find(|(name, _)| name == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        (get("AWS_ACCESS_KEY_ID"), get("AWS_SECRET_ACCESS_KEY"))
    }
}

/// Mounts the bucket for `target` on a fresh directory under the scratch directory (`n` numbers
/// the mount's files there) and waits until the kernel lists the mount.
pub fn mount(target: Target, server: &Server, fs: FsConfig, n: usize) -> anyhow::Result<Mounted> {
    let dir = tempfile::Builder::new()
        .prefix("mnt-")
        .tempdir_in(server.scratch)?;
    let mp = dir.path().to_path_buf();
    let log = server.scratch.join(format!("mount-{n}.log"));
    let (ak, sk) = server.keys();
    let endpoint = server.weed.endpoint();
    let mut cmd = match target {
        Target::Direct | Target::Raw(_) => bail!("no mount for {}", target.name()),
        Target::Hotstart { .. } => {
            let cfg = MountConfig {
                fs,
                fs_name: format!("s3://{}", server.bucket),
                ..MountConfig::default()
            };
            let handle = hotstart_fuse::mount(server.store.clone(), &mp, cfg, server.rt.clone())
                .context("hotstart mount (needs /dev/fuse, fusermount3 and root)")?;
            let serving = Serving::Hotstart(Some(handle));
            return Ok(Mounted { dir, serving });
        }
        Target::Peer(Peer::Weed) => {
            let cache = server.scratch.join(format!("weed-cache-{n}"));
            fs::create_dir(&cache)?;
            let mut c = Command::new(hotstart_testkit::find_weed()?);
            c.arg("mount")
                .arg(format!("-filer={}", server.weed.filer_address()))
                .arg(format!("-filer.path=/buckets/{}", server.bucket))
                .arg(format!("-dir={}", mp.display()))
                .arg(format!("-cacheDir={}", cache.display()))
                .arg(format!(
                    "-localSocket={}",
                    cache.join("mount.sock").display()
                ))
                // weed's own log files go to TMPDIR: keep them in the scratch directory.
                .env("TMPDIR", &cache);
            c
        }
        Target::Peer(Peer::S3fs) => {
            let passwd = server.scratch.join("s3fs.passwd");
            fs::write(&passwd, format!("{ak}:{sk}\n"))?;
            fs::set_permissions(&passwd, fs::Permissions::from_mode(0o600))?;
            let mut c = Command::new("s3fs");
            c.arg(server.bucket)
                .arg(&mp)
                .arg("-f")
                .arg("-o")
                .arg(format!(
                    "url={endpoint},use_path_request_style,passwd_file={},tmpdir={}",
                    passwd.display(),
                    server.scratch.display()
                ));
            c
        }
        Target::Peer(Peer::Rclone) => {
            let mut c = Command::new("rclone");
            c.arg("mount")
                .arg(format!(":s3:{}", server.bucket))
                .arg(&mp)
                .args(["--config", ""])
                .args(["--s3-provider", "SeaweedFS"])
                .args(["--s3-endpoint", &endpoint])
                .args(["--s3-access-key-id", &ak])
                .args(["--s3-secret-access-key", &sk])
                .args(["--s3-region", "us-east-1"])
                .args(["--vfs-cache-mode", "off"]);
            c
        }
    };
    // Only the flags above configure a peer: no AWS_* or RCLONE_* setting of this
    // environment (a CA bundle, a profile, another endpoint) reaches it.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("AWS_") || k.starts_with("RCLONE_") {
            cmd.env_remove(k.as_ref());
        }
    }
    let out = File::create(&log)?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("start {} (run scripts/setup.sh)", target.name()))?;
    let deadline = Instant::now() + MOUNT_TIMEOUT;
    while !is_mounted(&mp) {
        if let Some(status) = child.try_wait()? {
            bail!(
                "{} exited ({status}) before mounting:\n{}",
                target.name(),
                log_tail(&log)
            );
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{} did not mount in {MOUNT_TIMEOUT:?}:\n{}",
                target.name(),
                log_tail(&log)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let serving = Serving::Child(child);
    Ok(Mounted { dir, serving })
}
