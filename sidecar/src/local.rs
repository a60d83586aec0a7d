//! The Unix socket that local training processes use: staging into shared memory, commits,
//! progress events and restores.
//!
//! A connection starts with `Attach` (job, rank, world size) and then carries requests one at
//! a time (see `docs/PROTOCOL.md`):
//!
//! - `Stage{step, len, wait, ahead}`: a segment of `len` bytes, its descriptor sent with
//!   `Segment`. It is the segment of an older step of the same rank when one is free, taken
//!   back from the memory tier (`super::memory`: recycling); else memory is charged to the
//!   budget (evicting, and waiting up to `stage_timeout` when `wait`) and a new [`Segment`]
//!   created with its pages allocated. `ahead` asks for the *next* save's segment right after a
//!   commit, so that the training process can map it before it needs it: when the older step
//!   that may be recycled is still read (its persistence) or not yet superseded (the other
//!   ranks have not completed a newer step), a new segment is made from free memory or from
//!   memory freed by evicting other ranks' (and replicas') older steps, and otherwise it is
//!   waited for (up to `stage_timeout`); with nothing that could be
//!   recycled, a new one is made as for a save, evicting but never waiting. One stage per
//!   connection at a time.
//! - `Filled{manifest}`: every byte of the step is in the segment, laid out as the manifest
//!   says; its chunk hashes are the sidecar's to compute. No answer. From here the step is the
//!   sidecar's to finish: should the connection close before `Commit` (the process was killed
//!   right after `wait_staged`), it is committed all the same ([`commit`]), so a save survives
//!   its process from the moment `wait_staged` returns. A drain waits for it
//!   ([`crate::persist::Owed`]).
//! - `Commit`: the training process has unmapped the filled segment and closed its writable
//!   descriptor (it keeps a read-only one until `Committed`, to hand the step to this sidecar's
//!   next life should this one go away first); the sidecar maps it read-only, hashes it into
//!   the manifest (once: the training process does not hash what goes to a sidecar) and holds
//!   it in memory: `Committed`. Persistence and replication start, and each of their tiers
//!   reports on this connection with `Persisted{tier, error}`.
//! - `Restore{step}`: the step is served from the nearest tier (`super::restore`), sealed for
//!   good, and its descriptor sent with `Restored`; `NotFound` when no tier has it, `Corrupt`
//!   when a chunk of it is damaged or gone in every tier.
//! - `Latest`: the newest step complete for every rank; `LatestBelow{step}`: the newest one
//!   older than `step` (where a job goes back to when a rank cannot restore `step`).
//! - `LatestCheckpoint{below}`: the same whatever world size saved the step, with that world
//!   size; `Manifest{step, rank}`: any rank's manifest of a step. A job that comes back with
//!   another number of ranks finds its checkpoint and learns its layout with them, then
//!   restores the old ranks' shards it needs on connections attached as those ranks.
//!
//! A segment staged but never filled (the training process died mid-copy) is dropped with its
//! connection: a torn save never enters the memory tier.

use hotstart_ckpt::Error as CkptError;
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::Core;
use crate::lifecycle::State;
use crate::memory::{PartValues, Recycled, Shard, ShardKey};
use crate::metrics::Failure;
use crate::persist::Owed;
use crate::restore::ServedBytes;
use hotstart_proto::PROTOCOL_VERSION;
use hotstart_proto::shm::{Committed, Segment};
use hotstart_proto::wire::{Conn, DeviceCopy, FdStream, LocalMsg, Side};

use crate::error::{Error, Result};
use hotstart_ckpt::format::{self, Manifest};
use hotstart_ckpt::parts;

/// A segment handed out and not yet committed.
struct Staged {
    /// The step, unless staged ahead (the manifest names it then).
    step: Option<u64>,
    seg: Segment,
    asked: Instant,
    /// The manifest sent with `Filled` (hashes still to compute), once every byte is in place.
    filled: Option<String>,
    /// From `Filled` on, the save is owed: a drain waits until it is committed.
    owed: Option<Owed>,
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
                    Err(CkptError::Config {
                        reason: format!(
                            "protocol version {version}, this sidecar speaks {PROTOCOL_VERSION}"
                        ),
                    })
                } else if world_size == 0 || rank >= world_size {
                    Err(CkptError::Config {
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
        Ok(LocalMsg::Share { version }) => {
            serve_share(&core, &mut reader, &writer, version);
            return;
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
    // The last step handed over on this connection as a segment: what an `Upload` copies from.
    let mut handed: Option<Arc<Shard>> = None;
    loop {
        let msg = match reader.recv::<LocalMsg>() {
            Ok(m) => m,
            Err(e) => {
                if reader.violated() {
                    core.metrics.failed(Failure::Frame);
                    warn!(job = %who.job, rank = who.rank, error = %e, "local connection dropped");
                } else if let Some(mut s) = staged {
                    match (s.filled.is_some(), s.step) {
                        (true, _) => {
                            let asked = s.asked;
                            let owed = s.owed.take();
                            let _pending = core.adopting.begin(&who.job);
                            // Nobody waits for this commit until the restarted process asks
                            // for its step; until then it hashes out of the way of that
                            // process's start (importing, building its model), and its threads
                            // (hashing, then persistence) inherit the lower priority.
                            hotstart_proto::background_priority();
                            match commit(&core, &who, s) {
                                Ok(shard) => {
                                    info!(shard = %shard.key, "the training process went away after staging; the sidecar committed its save");
                                    core.after_commit(shard, None, asked);
                                    drop(owed);
                                }
                                Err(e) => {
                                    warn!(job = %who.job, rank = who.rank, error = %e, "a filled save whose process went away could not be committed")
                                }
                            }
                        }
                        (false, Some(step)) => {
                            warn!(job = %who.job, rank = who.rank, step, "training process went away mid-save; dropping its staged segment")
                        }
                        (false, None) => {
                            debug!(job = %who.job, rank = who.rank, "the segment prepared for a next save was let go")
                        }
                    }
                }
                return;
            }
        };
        reader.drop_fds();
        let res = match msg {
            LocalMsg::Stage {
                step,
                len,
                wait,
                ahead,
            } => match stage(&core, &who, step, len, wait, ahead, staged.is_some()) {
                Ok(seg) => {
                    let sent = writer
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .send_fd(&LocalMsg::Segment { len }, seg.as_fd());
                    staged = Some(Staged {
                        step: (!ahead).then_some(step),
                        seg,
                        asked: Instant::now(),
                        filled: None,
                        owed: None,
                    });
                    sent
                }
                // Draining: the engine waits for this sidecar's next life instead of failing.
                Err(_) if core.life.get() == State::Draining => send(&LocalMsg::Draining),
                Err(e) => send(&LocalMsg::Failed {
                    reason: e.to_string(),
                }),
            },
            LocalMsg::Filled { manifest } => match &mut staged {
                Some(s) => {
                    s.filled = Some(manifest);
                    s.owed = Some(Owed::new(&core));
                    Ok(())
                }
                None => {
                    core.metrics.failed(Failure::Frame);
                    warn!(job = %who.job, rank = who.rank, "filled without a staged segment");
                    return;
                }
            },
            LocalMsg::Commit => match staged.take() {
                None => send(&LocalMsg::Failed {
                    reason: "commit without a staged segment".into(),
                }),
                Some(mut s) => {
                    // Released once persistence is registered (or the commit refused): a
                    // drain that begins meanwhile waits for this save.
                    let _owed = s.owed.take();
                    // A segment staged ahead was asked for before its save began.
                    let asked = if s.step.is_some() {
                        s.asked
                    } else {
                        Instant::now()
                    };
                    match commit(&core, &who, s) {
                        Ok(shard) => {
                            let sent = send(&LocalMsg::Committed);
                            core.after_commit(shard, Some(writer.clone()), asked);
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
            LocalMsg::Restore {
                step,
                file,
                regions,
            } => {
                core.adopting.wait(&who.job, core.cfg.stage_timeout);
                let asked = regions.as_deref();
                match core.restore(&who.job, who.rank, who.world_size, step, file, asked) {
                    Ok(served) => {
                        let msg = LocalMsg::Restored {
                            step: served.step,
                            source: served.source,
                            manifest: served.manifest_json,
                            chunk_sources: served.chunk_sources,
                            seconds: served.took.as_secs_f64(),
                            file: matches!(served.bytes, ServedBytes::File(_)),
                        };
                        let fd = match &served.bytes {
                            ServedBytes::Shard(shard) => shard.seg.as_fd(),
                            ServedBytes::File(file) => file.as_fd(),
                        };
                        let sent = writer
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .send_fd(&msg, fd);
                        handed = match served.bytes {
                            ServedBytes::Shard(shard) => {
                                // Pinned for the next restore if it stays in memory and is
                                // not pinned yet (restored from elsewhere, a peer's replica).
                                if core
                                    .memory
                                    .get(&shard.key)
                                    .is_some_and(|s| Arc::ptr_eq(&s, &shard))
                                {
                                    core.pins.pin(&shard);
                                }
                                Some(shard)
                            }
                            ServedBytes::File(_) => None,
                        };
                        sent
                    }
                    Err(e) if e.is_not_found() => send(&LocalMsg::NotFound { step }),
                    Err(e) if let Some((step, chunk, reason)) = e.corrupt() => {
                        core.metrics.failed(Failure::Restore);
                        warn!(job = %who.job, rank = who.rank, error = %e, "restore failed");
                        send(&LocalMsg::Corrupt {
                            step,
                            chunk,
                            reason,
                        })
                    }
                    Err(e) => {
                        core.metrics.failed(Failure::Restore);
                        warn!(job = %who.job, rank = who.rank, error = %e, "restore failed");
                        send(&refusal(&e))
                    }
                }
            }
            LocalMsg::Upload { copies } => send(&upload(&core, handed.as_deref(), &copies)),
            LocalMsg::Latest => send(&latest(&core, &who, None)),
            LocalMsg::LatestBelow { step } => send(&latest(&core, &who, Some(step))),
            LocalMsg::LatestCheckpoint { below } => {
                core.adopting.wait(&who.job, core.cfg.stage_timeout);
                send(&match core.latest_checkpoint(&who.job, below) {
                    Ok(found) => LocalMsg::CheckpointIs { found },
                    Err(e) => refusal(&e),
                })
            }
            LocalMsg::Manifest { step, rank } => {
                core.adopting.wait(&who.job, core.cfg.stage_timeout);
                send(&match core.manifest(&who.job, rank, step) {
                    Ok(manifest) => LocalMsg::ManifestIs { manifest },
                    Err(e) if e.is_not_found() => LocalMsg::NotFound { step: Some(step) },
                    Err(e) => refusal(&e),
                })
            }
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

/// The answer to an `Upload` of `copies` from `shard`, the step last handed over on the
/// connection as a segment: the sidecar copies them into the process's device memory from its
/// pinned mapping of the segment, or says why not (see `super::pin`).
fn upload(core: &Core, shard: Option<&Shard>, copies: &[DeviceCopy]) -> LocalMsg {
    let Some(shard) = shard else {
        core.metrics.uploaded(None);
        return LocalMsg::Failed {
            reason: "an upload before any step was handed over as a segment on this \
                     connection: restore first"
                .into(),
        };
    };
    let started = Instant::now();
    match core.pins.upload(shard, copies) {
        Ok(done) => {
            core.metrics.uploaded(Some(&done));
            let seconds = started.elapsed().as_secs_f64();
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            info!(
                shard = %shard.key,
                bytes = done.bytes,
                seconds,
                handles = done.handles,
                open_ms = ms(done.open),
                copy_ms = ms(done.copy),
                close_ms = ms(done.close),
                "copied into the process's device memory"
            );
            LocalMsg::Uploaded {
                bytes: done.bytes,
                seconds,
            }
        }
        Err(reason) => {
            core.metrics.uploaded(None);
            debug!(shard = %shard.key, %reason, "no upload");
            LocalMsg::Failed { reason }
        }
    }
}

/// The answer to `Latest` (`below` None) or `LatestBelow`, once the job's pending commits are
/// in.
/// A connection of a process that asks for shared pieces (`super::share`): one request at a
/// time, until it closes.
fn serve_share(
    core: &Core,
    reader: &mut Conn<FdStream>,
    writer: &Mutex<Conn<FdStream>>,
    version: u32,
) {
    let mut writer = writer
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let refused = if !core.cfg.share {
        Some("this sidecar does not share (--no-share)".to_string())
    } else if version != PROTOCOL_VERSION {
        Some(format!(
            "protocol version {version}, this sidecar speaks {PROTOCOL_VERSION}"
        ))
    } else {
        None
    };
    let hello = match refused {
        Some(reason) => LocalMsg::Failed { reason },
        None => LocalMsg::Sharing {
            node: core.me.node.clone(),
        },
    };
    if writer.send(&hello).is_err() || !matches!(hello, LocalMsg::Sharing { .. }) {
        return;
    }
    loop {
        let piece = match reader.recv::<LocalMsg>() {
            Ok(LocalMsg::Piece { piece }) => piece,
            Ok(other) => {
                warn!(?other, "unexpected request on a sharing connection");
                return;
            }
            Err(e) => {
                if reader.violated() {
                    core.metrics.failed(Failure::Frame);
                    warn!(error = %e, "sharing connection dropped");
                }
                return;
            }
        };
        if core.members.counts().0 == 0 && !core.share_holds(&piece) {
            if writer.send(&LocalMsg::NotShared).is_err() {
                return;
            }
            continue;
        }
        // A range of a frame cannot be checked alone: only between sidecars, which check its
        // chunk whole before they use or keep it.
        let answer = match piece.within {
            Some(_) => Err("a process asks for whole frames, not ranges of one".to_string()),
            None => core.piece(&piece, false),
        };
        let sent = match answer {
            Ok(got) => {
                core.metrics
                    .shared(&piece.artifact, got.source.as_str(), got.bytes.len() as u64);
                writer
                    .send(&LocalMsg::PieceIs {
                        len: got.bytes.len() as u64,
                        source: got.source,
                        peer: got.peer,
                    })
                    .and_then(|()| writer.send_data(&got.bytes))
            }
            Err(reason) => writer.send(&LocalMsg::Failed { reason }),
        };
        if sent.is_err() {
            return;
        }
    }
}

fn latest(core: &Core, who: &Rank, below: Option<u64>) -> LocalMsg {
    core.adopting.wait(&who.job, core.cfg.stage_timeout);
    match core.latest(&who.job, who.rank, who.world_size, below) {
        Ok(step) => LocalMsg::LatestIs { step },
        Err(e) => refusal(&e),
    }
}

/// The answer to a request that failed with `e`: a tier that cannot be read says which.
fn refusal(e: &Error) -> LocalMsg {
    match e {
        Error::Ckpt(CkptError::Unavailable { tier, source, .. }) => LocalMsg::Unavailable {
            tier: *tier,
            reason: source.to_string(),
        },
        e => LocalMsg::Failed {
            reason: e.to_string(),
        },
    }
}

/// A segment of `len` bytes for `step` (or the save after it, `ahead`); see the module docs.
fn stage(
    core: &Core,
    who: &Rank,
    step: u64,
    len: u64,
    wait: bool,
    ahead: bool,
    busy: bool,
) -> Result<Segment> {
    if busy {
        return Err(CkptError::Sidecar {
            socket: core.cfg.socket.display().to_string(),
            reason: "a segment is already staged on this connection".into(),
        }
        .into());
    }
    let what = format!("{} step {step} rank {}", who.job, who.rank);
    let name = format!("hotstart-{}-{}", who.job, who.rank);
    let size = usize::try_from(len).map_err(|_| CkptError::Input {
        step,
        reason: "checkpoint larger than the address space".into(),
    })?;
    let deadline = Instant::now() + core.cfg.stage_timeout;
    let charge = loop {
        if core.life.get() == State::Draining {
            return Err(CkptError::Sidecar {
                socket: core.cfg.socket.display().to_string(),
                reason: "the sidecar is shutting down; no new saves".into(),
            }
            .into());
        }
        // Asked again while waiting: the others' commits move it on.
        let complete = core.latest_seen(&who.job, who.world_size, None);
        match core.memory.recycle(&who.job, who.rank, size, complete) {
            Recycled::Taken(seg) => return Ok(seg),
            Recycled::Busy if ahead => {
                // New memory (free, or freed from other ranks' older steps) rather than a wait
                // that the next save might share.
                if let Some(c) = core.memory.reserve_sparing(len, &who.job, who.rank) {
                    break c;
                }
                if Instant::now() >= deadline {
                    return Err(CkptError::Sidecar {
                        socket: core.cfg.socket.display().to_string(),
                        reason: format!("{what}: no segment free for the next save in time"),
                    }
                    .into());
                }
                // Until an older step's persistence lets go of it, or the other ranks complete
                // a newer step, neither of which signals.
                core.memory.wait_freed(Duration::from_millis(50));
            }
            _ => {
                let wait = if wait && !ahead {
                    core.cfg.stage_timeout
                } else {
                    Duration::ZERO
                };
                break core.memory.reserve(len, wait, &what).inspect_err(|e| {
                    if !ahead {
                        core.metrics.failed(Failure::Budget);
                        warn!(error = %e, "stage refused");
                    }
                })?;
            }
        }
    };
    // Made ahead too at training's own priority: the next save waits for it, and on cores that
    // training keeps busy a lower priority only postpones the zeroing until that save blocks.
    let seg = Segment::create(&name, size, Some(Box::new(charge)))
        .and_then(Segment::allocate)
        .map_err(|e| Error::io("create shared memory", &name, e))?;
    core.memory.count_created();
    Ok(seg)
}

/// Seals a filled segment, hashes it into the manifest that came with `Filled` and holds it in
/// memory: the committed shard. The same whether the training process asked (`Commit`) or went
/// away after `Filled`.
fn commit(core: &Core, who: &Rank, mut s: Staged) -> Result<Arc<Shard>> {
    let Some(manifest) = s.filled.take() else {
        return Err(CkptError::Sidecar {
            socket: core.cfg.socket.display().to_string(),
            reason: "commit before filled: the training process must say its segment is filled \
                     first (local protocol 2)"
                .into(),
        }
        .into());
    };
    let step = match s.step {
        Some(step) => step,
        None => Manifest::parse(manifest.as_bytes(), "manifest (filled)")?.step,
    };
    let location = format!(
        "{} (filled)",
        format::manifest_key(&who.job, step, who.rank)
    );
    let mut m = Manifest::parse_for(
        manifest.as_bytes(),
        &location,
        &who.job,
        step,
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
    let asked = s.asked;
    let held = s
        .seg
        .commit()
        .map_err(|e| Error::io("map shared memory", &location, e))?;
    // The chunks' ids, and their parts' values for a peer's reader that reshards, in one pass.
    let (ids, values): (Vec<_>, Vec<_>) = hotstart_ckpt::map_chunks(
        &held.bytes()[..len],
        m.chunk_size as usize,
        core.threads,
        parts::id_and_values,
    )
    .into_iter()
    .unzip();
    m.chunks = ids.iter().map(|h| h.to_hex().to_string()).collect();
    let manifest = String::from_utf8_lossy(&m.to_json()).into_owned();
    let parts = PartValues::made(values);
    Ok(install(core, who, asked, m, manifest, held, parts))
}

/// Holds a verified step in the memory tier.
fn install(
    core: &Core,
    who: &Rank,
    asked: Instant,
    m: Manifest,
    manifest: String,
    held: Committed,
    parts: PartValues,
) -> Arc<Shard> {
    let len = m.file_len;
    let shard = Arc::new(Shard {
        key: ShardKey {
            job: who.job.clone(),
            rank: who.rank,
            step: m.step,
        },
        world_size: who.world_size,
        origin: core.me.node.clone(),
        manifest: m,
        manifest_json: manifest,
        seg: Arc::new(held),
        committed: Instant::now(),
        parts,
    });
    info!(shard = %shard.key, bytes = len, "committed to memory");
    core.memory.insert(shard.clone());
    core.metrics
        .saved(hotstart_ckpt::TierKind::Memory, len, asked.elapsed());
    shard
}

/// Saves being committed for training processes that went away after `Filled`, per job. A
/// restarted process asks for the newest step (`Latest`, `Restore`) a moment after its
/// predecessor died, while the sidecar may still be hashing what that one staged: those
/// requests wait for the job's pending commits, so the restart finds the step.
#[derive(Debug, Default)]
pub(crate) struct Adopting {
    jobs: Mutex<HashMap<String, usize>>,
    done: Condvar,
}

/// One pending commit, ended on drop.
pub(crate) struct Pending<'a> {
    adopting: &'a Adopting,
    job: String,
}

impl Adopting {
    pub(crate) fn begin(&self, job: &str) -> Pending<'_> {
        *self
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(job.to_string())
            .or_default() += 1;
        Pending {
            adopting: self,
            job: job.to_string(),
        }
    }

    /// Waits, at most `limit`, until `job` has no pending commit.
    pub(crate) fn wait(&self, job: &str, limit: Duration) {
        let jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        let (_jobs, waited) = self
            .done
            .wait_timeout_while(jobs, limit, |j| j.get(job).is_some_and(|n| *n > 0))
            .unwrap_or_else(PoisonError::into_inner);
        if waited.timed_out() {
            warn!(
                job,
                "still committing a save of a process that went away; answering without it"
            );
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let mut jobs = self
            .adopting
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = jobs.get_mut(&self.job) {
            *n -= 1;
            if *n == 0 {
                jobs.remove(&self.job);
            }
        }
        self.adopting.done.notify_all();
    }
}
