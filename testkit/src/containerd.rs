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
        Containerd::start_with(name, snapshotter, None)
    }

    /// [`Containerd::start`] with its CRI plugin serving (as on a Kubernetes node), unpacking
    /// every image it pulls with the snapshotter `cri_snapshotter` (`name`, or containerd's own
    /// `overlayfs`), the layer annotations passed to it, and pulling from the plain-HTTP
    /// registry at `registry` (`host:port`). `ctr` then works in CRI's namespace, `k8s.io`.
    pub fn start_cri(
        name: &str,
        snapshotter: &Path,
        cri_snapshotter: &str,
        registry: &str,
    ) -> Option<Containerd> {
        Containerd::start_with(name, snapshotter, Some((cri_snapshotter, registry)))
    }

    fn start_with(name: &str, snapshotter: &Path, cri: Option<(&str, &str)>) -> Option<Containerd> {
        if !installed(&["containerd", "ctr", "runc"], "containerd runc") {
            return None;
        }
        // Short paths: containerd's sockets live under the state directory.
        let dir = tempfile::Builder::new()
            .prefix("hs-ctrd-")
            .tempdir_in("/tmp")
            .expect("a temporary directory");
        let config = dir.path().join("config.toml");
        let cri_section = match cri {
            None => String::new(),
            Some((cri_snapshotter, registry)) => format!(
                r#"[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "{cri_snapshotter}"
    disable_snapshot_annotations = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni}"
    conf_dir = "{cni}"
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."{registry}"]
    endpoint = ["http://{registry}"]
"#,
                cni = dir.path().join("cni").display()
            ),
        };
        let disabled = if cri.is_some() {
            ""
        } else {
            "\"io.containerd.grpc.v1.cri\", "
        };
        std::fs::write(
            &config,
            format!(
                r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = [{disabled}"io.containerd.snapshotter.v1.btrfs",
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
{cri_section}"#,
                root = dir.path().join("root").display(),
                state = dir.path().join("state").display(),
                sock = dir.path().join("c.sock").display(),
                ttrpc = dir.path().join("c.ttrpc").display(),
                snapshotter = snapshotter.display(),
            ),
        )
        .expect("write containerd's config");
        let mut cmd = Command::new("containerd");
        cmd.arg("--config").arg(&config);
        let child = spawn_logged(cmd, &dir.path().join("containerd.log"), "containerd");
        let mut c = Containerd {
            child,
            dir,
            namespace: if cri.is_some() {
                "k8s.io"
            } else {
                "hotstart-test"
            }
            .into(),
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

    /// Runs `ctr` against this containerd, in its namespace.
    pub fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("--address")
            .arg(self.socket())
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

    /// Removes every image of its namespace (CRI names an image by its reference and by its
    /// id) and waits for the garbage collection that removes their snapshots.
    pub fn remove_images(&self) {
        let names = self.ctr_ok(&["images", "ls", "--quiet"]);
        let mut args = vec!["images", "rm", "--sync"];
        args.extend(names.lines().filter(|l| !l.is_empty()));
        if args.len() > 3 {
            self.ctr_ok(&args);
        }
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

    /// Its gRPC socket (where CRI is served too).
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("c.sock")
    }

    /// The namespace [`Containerd::ctr`] works in, for other clients of this containerd.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Pulls `image` through CRI, as a kubelet does (see [`cri_pull`]); panics with
    /// containerd's log when it fails.
    pub fn cri_pull(&self, image: &str) -> String {
        cri_pull(&self.socket(), image)
            .unwrap_or_else(|e| panic!("CRI pull of {image}: {e}\n{}", self.log()))
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        crate::terminate(&mut self.child, Duration::from_secs(10));
    }
}

/// Whether every one of `bins` is on PATH; if not, prints `skipping <test>: ...` (or panics
/// when `CI` is set) naming the Debian `packages` that have them.
fn installed(bins: &[&str], packages: &str) -> bool {
    let missing: Vec<&str> = bins
        .iter()
        .copied()
        .filter(|b| which(b).is_none())
        .collect();
    if missing.is_empty() {
        return true;
    }
    let why = format!(
        "{} not installed (Debian: apt-get install {packages}; scripts/setup.sh does)",
        missing.join(", ")
    );
    if crate::seaweedfs::ci() {
        panic!("CI is set, so these tests may not be skipped: {why}");
    }
    let test = thread::current().name().unwrap_or("test").to_string();
    let _ = io::stderr().write_all(format!("skipping {test}: {why}\n").as_bytes());
    false
}

/// An OCI registry (Debian's `docker-registry`, the distribution project's) on 127.0.0.1, with
/// its storage in a temporary directory; stopped on drop.
pub struct Registry {
    child: Child,
    _dir: tempfile::TempDir,
    port: u16,
}

impl Registry {
    /// Starts one; `None` (after saying so) when `docker-registry` is not installed and `CI` is
    /// not set.
    pub fn start() -> Option<Registry> {
        if !installed(&["docker-registry"], "docker-registry") {
            return None;
        }
        let dir = tempfile::tempdir().expect("a temporary directory");
        let port = crate::free_port().expect("a free port");
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                 http:\n  addr: 127.0.0.1:{port}\n",
                dir.path().join("data").display()
            ),
        )
        .expect("write the registry's config");
        let mut cmd = Command::new("docker-registry");
        cmd.arg("serve").arg(&config);
        let mut child = spawn_logged(cmd, &dir.path().join("registry.log"), "docker-registry");
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        // Ready when it answers the registry API's base check (200): whatever else might
        // answer on the port is not it.
        while !crate::get(addr, "/v2/", Duration::from_secs(2)).is_ok_and(|r| r.status == 200) {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "docker-registry exited ({status}): {}",
                    std::fs::read_to_string(dir.path().join("registry.log")).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "docker-registry did not answer");
            thread::sleep(Duration::from_millis(100));
        }
        Some(Registry {
            child,
            _dir: dir,
            port,
        })
    }

    /// `127.0.0.1:<port>`, the host part of image names pushed here.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
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

/// The messages of the one CRI call a kubelet makes to pull an image (field numbers of
/// `runtime.v1.ImageService/PullImage`; what is not needed is left out).
mod cri {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ImageSpec {
        #[prost(string, tag = "1")]
        pub image: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PullImageRequest {
        #[prost(message, optional, tag = "1")]
        pub image: Option<ImageSpec>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PullImageResponse {
        #[prost(string, tag = "1")]
        pub image_ref: String,
    }
}

/// `runtime.v1.ImageService/PullImage` of `image` through containerd's socket `socket`.
///
/// containerd's CRI plugin pulls with its unpacker, which hands each layer's
/// `containerd.io/snapshot/` annotations to the snapshotter and downloads only the layers the
/// snapshotter does not already have. (`ctr images pull` fetches every layer before it
/// unpacks, so it never takes that path.)
pub fn cri_pull(socket: &Path, image: &str) -> Result<String, String> {
    use cri::{ImageSpec, PullImageRequest, PullImageResponse};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let socket = socket.to_path_buf();
    rt.block_on(async move {
        let channel = tonic::transport::Endpoint::from_static("http://localhost")
            .connect_with_connector(tower::service_fn(move |_| {
                tokio::net::UnixStream::connect(socket.clone())
            }))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.map_err(|e| format!("ready: {e}"))?;
        let request = PullImageRequest {
            image: Some(ImageSpec {
                image: image.to_string(),
            }),
        };
        let codec = tonic::codec::ProstCodec::<PullImageRequest, PullImageResponse>::default();
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(
            "/runtime.v1.ImageService/PullImage",
        );
        grpc.unary(tonic::Request::new(request), path, codec)
            .await
            .map(|r| r.into_inner().image_ref)
            .map_err(|s| s.message().to_string())
    })
}

/// Starts `cmd` (tied to this process) with its stdout and stderr in the file `log`.
fn spawn_logged(mut cmd: Command, log: &Path, what: &str) -> Child {
    let file = std::fs::File::create(log).expect("log file");
    cmd.stdout(file.try_clone().expect("log file")).stderr(file);
    spawn_tied(cmd, None).unwrap_or_else(|e| panic!("start {what}: {e}"))
}
