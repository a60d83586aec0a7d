//! The Unix socket that local training processes use: staging into shared memory, commits,
//! progress events and restores.
//!
//! A connection starts with `Attach` (job, rank, world size) and then carries requests one at
//! a time (see `docs/PROTOCOL.md`):
//!
//! - `Stage{step, len, wait}`: the rank's spare segment when it has one of that size (made
//!   after its previous commit, see `super::memory`), else memory is charged to the budget
//!   (evicting, or waiting up to `stage_timeout` when `wait`) and a [`Segment`] created with its
//!   pages allocated; its descriptor is sent with `Segment`. One stage per connection at a
//!   time.
//! - `Commit{manifest}`: the staged segment is sealed (refused while the training process still
//!   has it mapped writable), checked against the manifest's chunk hashes, and held in memory:
//!   `Committed`. Persistence and replication start, and each of their tiers reports on this
//!   connection with `Persisted{tier, error}`.
//! - `Restore{step}`: the step is served from the nearest tier (`super::restore`) and the
//!   sealed segment's descriptor sent with `Restored`.
//! - `Latest`: the newest step complete for every rank.
//!
//! A segment staged but never committed (the training process died mid-copy) is dropped with
//! its connection: a torn save never enters the memory tier.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::Core;
use super::lifecycle::State;
use super::memory::{Shard, ShardKey};
use super::metrics::Failure;
use super::shm::Segment;
use super::wire::{Conn, FdStream, LocalMsg, Side};
use crate::error::{Error, Result};
use crate::format::{self, Manifest};
use crate::staging;

/// Version of the local protocol, checked in `Attach`.
pub const PROTOCOL_VERSION: u32 = 1;

/// A segment handed out and not yet committed.
struct Staged {
    step: u64,
    seg: Segment,
    asked: Instant,
}

/// Who is on the other end.
struct Rank {
    job: String,
    rank: u32,
    world_size: u32,
}

/// Serves one training-process connection until it closes.
pub(crate) fn serve(core: Arc<Core>, sock: UnixStream) {
    let label = core.cfg.socket.display().to_string();
    let writer = match sock.try_clone() {
        Ok(w) => Arc::new(Mutex::new(Conn::new(
            FdStream::new(w),
            label.clone(),
            Side::Local,
        ))),
        Err(e) => {
            warn!(error = %e, "cannot clone a local connection");
            return;
        }
    };
    let mut reader = Conn::new(FdStream::new(sock), label, Side::Local);
    let send = |msg: &LocalMsg| {
        writer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .send(msg)
    };
    let who = match reader.recv::<LocalMsg>() {
        Ok(LocalMsg::Attach {
            version,
            job,
            rank,
            world_size,
        }) => {
            let checked = format::check_job(&job).and_then(|()| {
                if version != PROTOCOL_VERSION {
                    Err(Error::Config {
                        reason: format!(
                            "protocol version {version}, this sidecar speaks {PROTOCOL_VERSION}"
                        ),
                    })
                } else if world_size == 0 || rank >= world_size {
                    Err(Error::Config {
                        reason: format!("rank {rank} of world size {world_size}"),
                    })
                } else {
                    Ok(())
                }
            });
            if let Err(e) = checked {
                let _ = send(&LocalMsg::Failed {
                    reason: e.to_string(),
                });
                return;
            }
            Rank {
                job,
                rank,
                world_size,
            }
        }
        Ok(other) => {
            warn!(?other, "local connection did not attach first");
            return;
        }
        Err(e) => {
            debug!(error = %e, "local connection closed before attaching");
            return;
        }
    };
    let attached = LocalMsg::Attached {
        node: core.me.node.clone(),
        tiers: core.save_tiers(),
    };
    if send(&attached).is_err() {
        return;
    }
    let mut staged: Option<Staged> = None;
    loop {
        let msg = match reader.recv::<LocalMsg>() {
            Ok(m) => m,
            Err(e) => {
                if reader.violated() {
                    core.metrics.failed(Failure::Frame);
                    warn!(job = %who.job, rank = who.rank, error = %e, "local connection dropped");
                } else if let Some(s) = &staged {
                    warn!(job = %who.job, rank = who.rank, step = s.step, "training process went away mid-save; dropping its staged segment");
                }
                return;
            }
        };
        reader.drop_fds();
        let res = match msg {
            LocalMsg::Stage { step, len, wait } => {
                match stage(&core, &who, step, len, wait, staged.is_some()) {
                    Ok(seg) => {
                        let sent = writer
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .send_fd(&LocalMsg::Segment { len }, seg.as_fd());
                        staged = Some(Staged {
                            step,
                            seg,
                            asked: Instant::now(),
                        });
                        sent
                    }
                    Err(e) => send(&LocalMsg::Failed {
                        reason: e.to_string(),
                    }),
                }
            }
            LocalMsg::Commit { manifest } => match staged.take() {
                None => send(&LocalMsg::Failed {
                    reason: "commit without a staged segment".into(),
                }),
                Some(s) => {
                    let (asked, len) = (s.asked, s.seg.len() as u64);
                    match commit(&core, &who, s, manifest) {
                        Ok(shard) => {
                            let sent = send(&LocalMsg::Committed);
                            core.after_commit(shard, Some(writer.clone()), asked);
                            prepare_spare(&core, &who, len);
                            sent
                        }
                        Err(e) => {
                            warn!(job = %who.job, rank = who.rank, error = %e, "commit refused");
                            send(&LocalMsg::Failed {
                                reason: e.to_string(),
                            })
                        }
                    }
                }
            },
            LocalMsg::Restore { step } => {
                match core.restore(&who.job, who.rank, who.world_size, step) {
                    Ok(served) => {
                        let msg = LocalMsg::Restored {
                            step: served.shard.key.step,
                            source: served.source,
                            manifest: served.shard.manifest_json.clone(),
                            chunk_sources: served.chunk_sources,
                            seconds: served.took.as_secs_f64(),
                        };
                        writer
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .send_fd(&msg, served.shard.seg.as_fd())
                    }
                    Err(e) if e.is_not_found() => send(&LocalMsg::NotFound { step }),
                    Err(e) => {
                        core.metrics.failed(Failure::Restore);
                        warn!(job = %who.job, rank = who.rank, error = %e, "restore failed");
                        send(&LocalMsg::Failed {
                            reason: e.to_string(),
                        })
                    }
                }
            }
            LocalMsg::Latest => match core.latest(&who.job, who.rank, who.world_size) {
                Ok(step) => send(&LocalMsg::LatestIs { step }),
                Err(e) => send(&LocalMsg::Failed {
                    reason: e.to_string(),
                }),
            },
            other => {
                core.metrics.failed(Failure::Frame);
                warn!(?other, "unexpected message on a local connection");
                return;
            }
        };
        if let Err(e) = res {
            debug!(error = %e, "local connection closed");
            return;
        }
    }
}

/// A segment of `len` bytes for `step`, charged to the budget.
fn stage(core: &Core, who: &Rank, step: u64, len: u64, wait: bool, busy: bool) -> Result<Segment> {
    if busy {
        return Err(Error::Sidecar {
            socket: core.cfg.socket.display().to_string(),
            reason: "a segment is already staged on this connection".into(),
        });
    }
    if core.life.get() == State::Draining {
        return Err(Error::Sidecar {
            socket: core.cfg.socket.display().to_string(),
            reason: "the sidecar is shutting down; no new saves".into(),
        });
    }
    if let Some(seg) = core.memory.take_spare(&who.job, who.rank, len) {
        return Ok(seg);
    }
    let what = format!("{} step {step} rank {}", who.job, who.rank);
    let wait = if wait {
        core.cfg.stage_timeout
    } else {
        Duration::ZERO
    };
    let charge = core.memory.reserve(len, wait, &what).inspect_err(|e| {
        core.metrics.failed(Failure::Budget);
        warn!(error = %e, "stage refused");
    })?;
    let name = format!("hotstart-{}-{step}-{}", who.job, who.rank);
    let len = usize::try_from(len).map_err(|_| Error::Input {
        step,
        reason: "checkpoint larger than the address space".into(),
    })?;
    Segment::create(&name, len, Some(charge))
        .and_then(Segment::allocate)
        .map_err(|e| Error::io("create shared memory", &name, e))
}

/// Prepares the next segment of `who` (`len` bytes) in the background, with free memory only.
fn prepare_spare(core: &Arc<Core>, who: &Rank, len: u64) {
    let (core, job, rank) = (core.clone(), who.job.clone(), who.rank);
    let _ = std::thread::Builder::new()
        .name("hotstart-spare".into())
        .spawn(move || {
            if core.life.get() != State::Ready {
                return;
            }
            let Some(charge) = core.memory.reserve_free(len) else {
                return;
            };
            let name = format!("hotstart-{job}-next-{rank}");
            match Segment::create(&name, len as usize, Some(charge)).and_then(Segment::allocate) {
                Ok(seg) => core.memory.put_spare(&job, rank, seg),
                Err(e) => debug!(error = %e, "no spare segment"),
            }
        });
}

/// Seals a staged segment and checks it against its manifest: the committed shard.
fn commit(core: &Core, who: &Rank, s: Staged, manifest: String) -> Result<Arc<Shard>> {
    let location = format!(
        "{} (commit)",
        format::manifest_key(&who.job, s.step, who.rank)
    );
    let m = Manifest::parse_for(
        manifest.as_bytes(),
        &location,
        &who.job,
        s.step,
        who.rank,
        who.world_size,
    )?;
    let len = m.file_len as usize;
    if m.file_len > s.seg.len() as u64 {
        return Err(Error::format(
            "manifest",
            location,
            format!(
                "a {}-byte file in a {}-byte segment",
                m.file_len,
                s.seg.len()
            ),
        ));
    }
    let sealed = s.seg.seal().map_err(|e| {
        if e.raw_os_error() == Some(libc::EBUSY) {
            Error::Sidecar {
                socket: core.cfg.socket.display().to_string(),
                reason: "the segment is still mapped writable; unmap it before committing".into(),
            }
        } else {
            Error::io("seal shared memory", &location, e)
        }
    })?;
    let hashes = staging::hash_chunks(&sealed.bytes()[..len], m.chunk_size as usize, core.threads);
    if let Some(i) = hashes
        .iter()
        .zip(m.chunk_hashes())
        .position(|(a, b)| *a != b)
    {
        core.metrics.failed(Failure::Checksum);
        return Err(Error::Corrupt {
            step: s.step,
            rank: who.rank,
            chunk: i,
            reason: "the staged bytes do not match the manifest".into(),
        });
    }
    let shard = Arc::new(Shard {
        key: ShardKey {
            job: who.job.clone(),
            rank: who.rank,
            step: s.step,
        },
        world_size: who.world_size,
        origin: core.me.node.clone(),
        manifest: m,
        manifest_json: manifest,
        seg: Arc::new(sealed),
        committed: Instant::now(),
    });
    info!(shard = %shard.key, bytes = len, "committed to memory");
    core.memory.insert(shard.clone());
    core.metrics
        .saved(crate::tier::TierKind::Memory, len as u64, s.asked.elapsed());
    Ok(shard)
}
