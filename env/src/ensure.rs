//! `ensure`: make a directory hold the environment of some inputs, by restoring the snapshot of
//! their key or, on a miss, by installing and publishing it.
//!
//! 1. Compute the key ([`crate::key`]).
//! 2. Take the node locks of the target, then of the key ([`crate::node`]); remove what an
//!    interrupted restore left beside the target.
//! 3. If the target already holds this key (by this node's record of it): done.
//!    If it holds something this node did not put there: refuse ([`Error::TargetInUse`]).
//! 4. Hit (the store has a committed snapshot of the key): restore it ([`crate::restore`]),
//!    replacing an older environment of this node atomically.
//! 5. Miss: run the install command (its output streamed to ours), then capture the target and
//!    publish it ([`crate::capture`]). A failing install command publishes nothing, removes what
//!    it left at the target, and its exit code is returned ([`Error::InstallFailed`]). A failure to
//!    publish leaves the installed environment in place and is reported in the outcome.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Instant;

use hotstart_store::{ChunkStoreConfig, Store};
use serde_json::json;

use crate::capture::{CaptureReport, capture};
use crate::error::{Error, Result};
use crate::key::{Key, KeyInputs, KeySpec, absolute};
use crate::node::{NodeLock, NodeState, Phase, TargetState};
use crate::record::EnvStore;
use crate::restore::{RestoreOptions, RestoreReport, remove_leftovers, remove_tree, restore};
use crate::store_lock::LockTiming;

/// Everything `ensure` needs besides the store.
#[derive(Debug, Clone)]
pub struct EnsureConfig {
    /// Lock or requirements files whose bytes enter the key.
    pub locks: Vec<PathBuf>,
    /// The directory that must hold the environment.
    pub target: PathBuf,
    /// The install command, run on a miss. It sees `HOTSTART_ENV_TARGET` and `HOTSTART_ENV_KEY`.
    pub install: Vec<String>,
    /// The interpreter the environment is for.
    pub python: String,
    /// Leave the target out of the key so the snapshot can be restored at any path.
    pub relocatable: bool,
    /// Node-local cache: chunks in `<cache_dir>/chunks`, locks and state in `<cache_dir>/env`.
    pub cache_dir: PathBuf,
    /// Bytes the chunk cache may hold.
    pub cache_capacity: u64,
    /// Chunks fetched or uploaded at once.
    pub store_concurrency: usize,
    /// How restores write files.
    pub restore: RestoreOptions,
    /// Store-side locks against a concurrent gc.
    pub lock_timing: LockTiming,
}

impl EnsureConfig {
    /// A configuration with every default: `python3`, target in the key, the default cache.
    pub fn new(locks: Vec<PathBuf>, target: PathBuf, install: Vec<String>) -> EnsureConfig {
        EnsureConfig {
            locks,
            target,
            install,
            python: "python3".to_string(),
            relocatable: false,
            cache_dir: default_cache_dir(),
            cache_capacity: 8 << 30,
            store_concurrency: 32,
            restore: RestoreOptions::default(),
            lock_timing: LockTiming::default(),
        }
    }

    /// The chunk store configuration this implies.
    pub fn chunk_config(&self) -> ChunkStoreConfig {
        ChunkStoreConfig {
            concurrency: self.store_concurrency,
            cache_dir: Some(self.cache_dir.join("chunks")),
            cache_capacity: self.cache_capacity,
            ..Default::default()
        }
    }

    /// The key inputs this configuration names.
    pub fn key_spec(&self) -> Result<KeySpec> {
        let target = absolute(&self.target)?;
        Ok(KeySpec {
            locks: self.locks.clone(),
            python: self.python.clone(),
            command: self.install.clone(),
            target: (!self.relocatable).then_some(target),
        })
    }
}

/// The node-local cache directory: `$HOTSTART_CACHE_DIR`, else `$XDG_CACHE_HOME/hotstart`, else
/// `$HOME/.cache/hotstart`, else `/var/tmp/hotstart-cache`.
pub fn default_cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("HOTSTART_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("hotstart")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/hotstart")))
        .unwrap_or_else(|| PathBuf::from("/var/tmp/hotstart-cache"))
}

/// What `ensure` did.
#[derive(Debug)]
pub struct Outcome {
    pub key: Key,
    /// The absolute target.
    pub target: PathBuf,
    pub action: Action,
    /// Wall time of the whole call.
    pub seconds: f64,
}

/// Which way the environment got there.
#[derive(Debug)]
pub enum Action {
    /// The target already held this environment.
    Present,
    /// Restored from the snapshot.
    Restored(RestoreReport),
    /// Installed by the install command, then captured; `capture` says whether publishing
    /// worked (the environment is in place either way).
    Installed {
        install_seconds: f64,
        capture: Box<std::result::Result<CaptureReport, String>>,
    },
}

/// Makes `cfg.target` hold the environment of `cfg`'s inputs; see the module documentation.
#[tracing::instrument(skip_all, fields(target = %cfg.target.display()))]
pub async fn ensure(store: &Store, cfg: &EnsureConfig) -> Result<Outcome> {
    let p = prepare(cfg).await?;
    let replace = match p.found {
        Found::Present => return Ok(p.done(Action::Present)),
        Found::Foreign => {
            return Err(Error::TargetInUse {
                target: p.target.clone(),
            });
        }
        Found::Absent => false,
        Found::Ours => true,
    };
    let env = EnvStore::new(store, cfg.chunk_config())?;
    if let Some(record) = env.record(&p.key).await? {
        let report = restore(&env, &record, &p.target, replace, &cfg.restore).await?;
        p.node.write(&TargetState::ready(&p.target, &p.key)?)?;
        return Ok(p.done(Action::Restored(report)));
    }
    install_and_capture(p, cfg, &env).await
}

/// What is at the target, as `ensure` finds it once it holds the node locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// Nothing.
    Absent,
    /// An environment of the same key that this node put there.
    Present,
    /// Another environment (or a started install) that this node put there: ensure may replace it.
    Ours,
    /// Something this node did not put there.
    Foreign,
}

/// An `ensure` that holds its node locks and knows what is at the target.
pub(crate) struct Prepared {
    pub(crate) started: Instant,
    pub(crate) key: Key,
    pub(crate) inputs: KeyInputs,
    pub(crate) target: PathBuf,
    pub(crate) node: NodeState,
    pub(crate) found: Found,
    pub(crate) target_lock: NodeLock,
    pub(crate) _key_lock: NodeLock,
}

impl Prepared {
    pub(crate) fn done(&self, action: Action) -> Outcome {
        Outcome {
            key: self.key,
            target: self.target.clone(),
            action,
            seconds: self.started.elapsed().as_secs_f64(),
        }
    }
}

/// Steps 1 to 3 of the module documentation: the key, the node locks, the leftovers of
/// interrupted restores removed, and what is at the target.
pub(crate) async fn prepare(cfg: &EnsureConfig) -> Result<Prepared> {
    let started = Instant::now();
    if cfg.install.is_empty() {
        return Err(Error::config("give the install command"));
    }
    let spec = cfg.key_spec()?;
    let target = absolute(&cfg.target)?;
    let inputs = tokio::task::spawn_blocking(move || KeyInputs::gather(&spec))
        .await
        .map_err(|e| Error::task("key inputs", e))??;
    let key = inputs.key();
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io("create directory", parent, e))?;
    }

    let node = NodeState::open(&cfg.cache_dir.join("env"))?;
    let target_lock = node.lock_target(&target).await?;
    let key_lock = node.lock_key(&key).await?;
    remove_leftovers(&target)?;

    let found = match std::fs::symlink_metadata(&target) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Found::Absent,
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            return Err(Error::config(format!(
                "{} is a lazy mount whose process has died; unmount it with `fusermount3 -u {}`",
                target.display(),
                target.display()
            )));
        }
        Err(e) => return Err(Error::io("stat", &target, e)),
        Ok(m) => match node.read(&target) {
            Some(s) if s.describes(&m) && s.holds(&key) => Found::Present,
            Some(s) if s.describes(&m) => Found::Ours,
            _ => Found::Foreign,
        },
    };
    Ok(Prepared {
        started,
        key,
        inputs,
        target,
        node,
        found,
        target_lock,
        _key_lock: key_lock,
    })
}

/// Step 5 of the module documentation: a miss. An environment of this node at the target
/// ([`Found::Ours`]) is removed first.
pub(crate) async fn install_and_capture(
    p: Prepared,
    cfg: &EnsureConfig,
    env: &EnvStore,
) -> Result<Outcome> {
    let target = &p.target;
    if p.found == Found::Ours {
        remove_tree(target);
    }
    p.node.write(&TargetState {
        target: crate::key::path_string(target)?,
        key: p.key.to_hex(),
        phase: Phase::Installing,
        dev: 0,
        ino: 0,
        boot_id: crate::node::boot_id(),
    })?;
    let install_started = Instant::now();
    if let Err(e) = run_install(&cfg.install, target, &p.key, &p.target_lock).await {
        remove_tree(target);
        p.node.clear(target);
        return Err(e);
    }
    let install_seconds = install_started.elapsed().as_secs_f64();
    if !target.is_dir() {
        p.node.clear(target);
        return Err(Error::config(format!(
            "the install command succeeded but {} is not a directory; it must install into the target",
            target.display()
        )));
    }
    p.node.write(&TargetState::ready(target, &p.key)?)?;
    let capture = capture(env, &p.key, &p.inputs, target, cfg.lock_timing)
        .await
        .map_err(|e| {
            tracing::warn!(error = %e, "installed, but could not publish the snapshot");
            e.to_string()
        });
    Ok(p.done(Action::Installed {
        install_seconds,
        capture: Box::new(capture),
    }))
}

/// Runs the install command with our stdout and stderr, holding the target lock for as long as
/// it (or anything it leaves running) lives.
async fn run_install(
    install: &[String],
    target: &std::path::Path,
    key: &Key,
    target_lock: &NodeLock,
) -> Result<()> {
    let command = install.join(" ");
    let held = target_lock.inheritable()?;
    let mut cmd = std::process::Command::new(&install[0]);
    cmd.args(&install[1..])
        .env("HOTSTART_ENV_TARGET", target)
        .env("HOTSTART_ENV_KEY", key.to_hex())
        .stdin(Stdio::null());
    let child = cmd.spawn().map_err(|source| Error::InstallSpawn {
        command: command.clone(),
        source,
    });
    drop(held);
    let mut child = child?;
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .map_err(|e| Error::task("install command", e))?
        .map_err(|source| Error::InstallSpawn {
            command: command.clone(),
            source,
        })?;
    if status.success() {
        return Ok(());
    }
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1);
    Err(Error::InstallFailed { command, code })
}

impl Outcome {
    /// The outcome as `hotstart env ensure --json` prints it: `key`, `target`, `seconds`,
    /// `action` (`present`, `restored` or `installed`) and that action's figures.
    pub fn to_json(&self) -> serde_json::Value {
        let o = self;
        let mut v = json!({
            "key": o.key.to_hex(),
            "target": o.target,
            "seconds": o.seconds,
        });
        match &o.action {
            Action::Present => v["action"] = json!("present"),
            Action::Restored(r) => {
                v["action"] = json!("restored");
                v["files"] = json!(r.files);
                v["bytes"] = json!(r.bytes);
                v["linked"] = json!(r.linked);
                v["fetched_chunks"] = json!(r.fetched_chunks);
                v["fetched_bytes"] = json!(r.fetched_bytes);
                v["cache_hits"] = json!(r.cache_hits);
                v["packed_chunks"] = json!(r.packed_chunks);
                v["packed_bytes"] = json!(r.packed_bytes);
                if let Some(rel) = &r.relocated {
                    v["relocated"] = json!({
                        "rewritten": rel.rewritten,
                        "relinked": rel.relinked,
                        "binary": rel.binary,
                    });
                }
            }
            Action::Installed {
                install_seconds,
                capture,
            } => {
                v["action"] = json!("installed");
                v["install_seconds"] = json!(install_seconds);
                match capture.as_ref() {
                    Ok(c) => {
                        v["published"] = json!(c.won);
                        v["uploaded_chunks"] = json!(c.uploaded_chunks);
                        v["uploaded_bytes"] = json!(c.uploaded_bytes);
                        v["deduplicated_chunks"] = json!(c.deduplicated_chunks);
                    }
                    Err(e) => {
                        v["published"] = json!(false);
                        v["publish_error"] = json!(e);
                    }
                }
            }
        }
        v
    }
}

/// One line for people: what happened, where, how long it took and what it moved.
impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let o = self;
        let (key, target, secs) = (o.key.short(), o.target.display(), o.seconds);
        let line = match &o.action {
            Action::Present => format!("{key} is already in {target} ({secs:.2} s)"),
            Action::Restored(r) => {
                let mut s = format!(
                    "restored {key} into {target} in {secs:.2} s: {} files, {} ({} linked from the \
                     chunk cache; fetched {} chunks, {}",
                    r.files,
                    size(r.bytes),
                    r.linked,
                    r.fetched_chunks,
                    size(r.fetched_bytes)
                );
                if r.packed_chunks > 0 {
                    s += &format!(
                        ", and {} chunks in {} requests of their pack, {} in {:.2} s",
                        r.packed_chunks,
                        r.pack_requests,
                        size(r.packed_bytes),
                        r.pack_seconds
                    );
                }
                s += ")";
                if let Some(rel) = &r.relocated {
                    s += &format!(
                        "; relocated: rewrote {} files, re-pointed {} symlinks",
                        rel.rewritten.len(),
                        rel.relinked.len()
                    );
                    if !rel.binary.is_empty() {
                        s += &format!(
                            " ({} binary files still name the old path, e.g. {})",
                            rel.binary.len(),
                            rel.binary[0]
                        );
                    }
                }
                s
            }
            Action::Installed {
                install_seconds,
                capture,
            } => {
                let head = format!(
                    "installed {key} into {target} in {secs:.2} s (install command {install_seconds:.2} s)"
                );
                match capture.as_ref() {
                    Ok(c) if c.won => format!(
                        "{head}; published in {:.2} s: uploaded {} chunks ({}), reused {}",
                        c.seconds,
                        c.uploaded_chunks,
                        size(c.uploaded_bytes),
                        c.deduplicated_chunks
                    ),
                    Ok(c) => format!(
                        "{head}; another node published this key first (from {}); its snapshot stands",
                        c.record.host
                    ),
                    Err(e) => format!("{head}; WARNING: not published: {e}"),
                }
            }
        };
        f.write_str(&line)
    }
}

fn size(bytes: u64) -> String {
    humansize::format_size(bytes, humansize::BINARY)
}
