//! Restores: which step, and from where.
//!
//! **Which step.** `Latest` is the newest step for which every rank `0..world_size` has a
//! committed shard somewhere this sidecar can see: in its own memory, in a peer's memory, on
//! its own disk or a peer's disk (each peer's inventory lists both). Only when no step is
//! complete there is the object store listed (with a deadline, so a store that is down cannot
//! stall a restart): memory never evicts a rank's newest step (but that of a rank a job went
//! on without, see `super::memory`), so the store holds a newer
//! complete step than the peers only when nodes lost memory they had not yet replicated. Every
//! sidecar asks every peer that answered its last probe (a dead peer is not waited for), so
//! sidecars that can reach each other agree on the step.
//!
//! **From where.** The shard of the asked rank is served from the nearest tier that holds it:
//! this node's memory; else a peer's memory (fetched, verified chunk by chunk as it arrives);
//! else this node's disk, else the store (read with the persistence core's verified reader, which falls
//! back from disk to store chunk by chunk). Whatever was not in memory is put there, so the
//! next restore of the same step is served from memory. The training process receives the
//! sealed segment and maps it: the restore itself copies nothing more.
//!
//! **Regions.** A process that reads only byte ranges of the shard (a load that reshards)
//! names them. A peer then sends only the 64 KiB parts of chunks that hold them and the
//! file's header, each verified as it arrives against its chunk's id
//! ([`hotstart_ckpt::parts`]); the segment handed over holds those bytes (its other bytes are
//! zero), and it does not enter this node's memory tier, which holds only whole shards. A
//! shard in this node's memory, on its disk or in the store is served as without regions (the
//! process reads its ranges from it), and one read back from disk or store stays in memory for
//! the node's other ranks.
//!
//! **A file instead of a segment.** A shard in no memory whose nearest tier is a file on this
//! node (the disk tier, or a store that is a local directory) is handed over as that file,
//! opened read-only, when the process says it can take one: it reads the file straight into
//! its own buffers and verifies every chunk, as from a disk tier of its own, and asks again for
//! a segment (read back as above) only when a chunk does not match. Reading the step into a
//! segment first would cost every byte a copy into memory new to this process, which the
//! kernel must zero first: several times the disk's own time on a node that has just
//! restarted (2 × 2 GiB: 7.3 s against 1.3 s).

use hotstart_ckpt::Error as CkptError;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::{error, info, warn};

use crate::Core;
use crate::error::{Error, Result};
use crate::memory::{Shard, ShardKey};
use crate::metrics::Failure;
use crate::wire::{Held, ShardInfo};
use hotstart_ckpt::Persistence;
use hotstart_ckpt::format::{self, Region};
use hotstart_ckpt::index::StepIndex;
use hotstart_ckpt::tier::{Tier, TierKind};
use hotstart_proto::shm::Segment;

/// How long a restore waits for the object store to list a job.
const STORE_LIST_DEADLINE: Duration = Duration::from_secs(10);

/// How long a restore waits for a process that still maps a committed segment writable (see
/// `Core::seal_to_hand_out`).
const SEAL_WAIT: Duration = Duration::from_secs(5);

/// A restore's answer.
#[derive(Debug)]
pub(crate) struct Served {
    pub step: u64,
    pub manifest_json: String,
    pub bytes: ServedBytes,
    pub source: TierKind,
    pub chunk_sources: Vec<TierKind>,
    pub took: Duration,
}

/// How a restore hands the step over.
#[derive(Debug)]
pub(crate) enum ServedBytes {
    /// A sealed segment of memory, verified.
    Shard(Arc<Shard>),
    /// The step's file on this node's disk, opened read-only, for a process that verifies it
    /// as it reads (it asks again for a segment if a chunk does not match).
    File(std::fs::File),
}

impl Core {
    /// What this node holds: shards in memory, and rank manifests on its disk. A job name that
    /// is not one (a peer asking for `../x`) holds nothing.
    pub(crate) fn inventory(&self, job: Option<&str>) -> Vec<ShardInfo> {
        if job.is_some_and(|j| format::check_job(j).is_err()) {
            return Vec::new();
        }
        let mut out: Vec<ShardInfo> = self.memory.shards(job).iter().map(|s| s.info()).collect();
        let disk = self.tiers.get(TierKind::Disk);
        if let (Some(disk), Some(job)) = (disk, job) {
            match StepIndex::list(disk, job, None) {
                Ok(index) => {
                    for (step, entry) in index.steps() {
                        for (&rank, files) in &entry.ranks {
                            // Committed: its data file and its manifest (see `index`).
                            let Some(len) = files.data_len.filter(|_| files.manifest) else {
                                continue;
                            };
                            out.push(ShardInfo {
                                job: job.to_string(),
                                rank,
                                step,
                                world_size: saved_world_size(disk, job, step, rank),
                                len,
                                origin: self.me.node.clone(),
                                held: Held::Disk,
                            });
                        }
                    }
                }
                Err(e) => warn!(job, error = %e, "cannot list the disk tier"),
            }
        }
        out
    }

    /// The newest step of `job` complete for every rank of `world_size` (older than `below`,
    /// if given); see the module docs.
    pub(crate) fn latest(
        &self,
        job: &str,
        rank: u32,
        world_size: u32,
        below: Option<u64>,
    ) -> Result<Option<u64>> {
        match self.latest_seen(job, world_size, below) {
            Some(step) => Ok(Some(step)),
            None => self.latest_in_store(job, rank, world_size, below),
        }
    }

    /// The newest step of `job` complete for every rank of `world_size` (older than `below`,
    /// if given) in this node's memory and disk and those of the peers that answered their
    /// last probe (the store not asked).
    pub(crate) fn latest_seen(
        &self,
        job: &str,
        world_size: u32,
        below: Option<u64>,
    ) -> Option<u64> {
        newest_for(&self.seen(job), job, world_size, below)
    }

    /// The newest checkpoint of `job` (older than `below`, if given), whatever world size saved
    /// it, and that world size: as [`Core::latest`] finds steps, for each world size that a
    /// shard in memory or a manifest on a disk names. Of two world sizes complete at the same
    /// step (a job that saved it twice), the larger: it is the one whose every rank was seen.
    pub(crate) fn latest_checkpoint(
        &self,
        job: &str,
        below: Option<u64>,
    ) -> Result<Option<(u64, u32)>> {
        let seen = self.seen(job);
        let mut sizes: Vec<u32> = seen
            .iter()
            .filter(|s| s.job == job && s.world_size > 0)
            .map(|s| s.world_size)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        let newest = sizes
            .iter()
            .filter_map(|&ws| newest_for(&seen, job, ws, below).map(|step| (step, ws)))
            .max();
        if newest.is_some() {
            return Ok(newest);
        }
        // Any rank's view lists the store's steps; rank 0 of 1 stands for it.
        self.in_store(job, 0, 1, move |p| {
            p.latest_checkpoint_in(TierKind::Store, below)
        })
    }

    /// What this node and the peers that answered their last probe hold of `job` (see
    /// [`Core::inventory`]). Only those peers: a dead peer whose address swallows packets
    /// would hold every restart for a connect timeout.
    fn seen(&self, job: &str) -> Vec<ShardInfo> {
        let mut seen = self.inventory(Some(job));
        let members = self.members.up();
        let listed = Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for m in &members {
                let listed = &listed;
                scope.spawn(move || {
                    match self.connect(m).and_then(|mut c| c.inventory(Some(job))) {
                        Ok(v) => listed
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .extend(v),
                        Err(e) => warn!(peer = %m.id.node, error = %e, "no inventory from a peer"),
                    }
                });
            }
        });
        seen.extend(listed.into_inner().unwrap_or_else(PoisonError::into_inner));
        seen
    }

    /// `rank`'s manifest of `step`, whatever world size saved it, from the nearest holder:
    /// this node's memory, a peer's memory, this node's disk, the store. Its chunks are not
    /// verified here: the restore that reads them does. [`CkptError::NotFound`] when none
    /// holds it; a tier that cannot be read, when no nearer one held it, is an error.
    pub(crate) fn manifest(&self, job: &str, rank: u32, step: u64) -> Result<String> {
        let key = ShardKey {
            job: job.to_string(),
            rank,
            step,
        };
        if let Some(s) = self.memory.get(&key) {
            return Ok(s.manifest_json.clone());
        }
        for m in self.members.up() {
            match self.connect(&m).and_then(|mut c| c.describe(&key)) {
                Ok(Some(json)) => return Ok(json),
                Ok(None) => {}
                Err(e) => {
                    warn!(peer = %m.id.node, shard = %key, error = %e, "no manifest from a peer")
                }
            }
        }
        // Any rank's view reads any rank's manifest; rank 0 of 1 stands for it.
        let m = self.tiers.rank(job, 0, 1)?.manifest(step, rank)?;
        Ok(String::from_utf8(m.to_json()).unwrap_or_default())
    }

    /// The newest step complete in the store, or `None`; [`CkptError::Unavailable`] when the
    /// store cannot be listed or does not answer in time.
    fn latest_in_store(
        &self,
        job: &str,
        rank: u32,
        world_size: u32,
        below: Option<u64>,
    ) -> Result<Option<u64>> {
        self.in_store(job, rank, world_size, move |p| {
            let steps = p.complete_steps(TierKind::Store)?;
            Ok(steps
                .into_iter()
                .rev()
                .find(|s| below.is_none_or(|b| *s < b)))
        })
    }

    /// `list` (given `rank`'s persistence over this node's tiers) on a thread of its own,
    /// given [`STORE_LIST_DEADLINE`] to answer; `None` without a store tier. A store that
    /// cannot be listed, or not in time, is [`CkptError::Unavailable`]: nothing nearer holds a
    /// step (see `latest`), and an empty answer would send the job back to step 0 while the
    /// store may hold its checkpoints.
    fn in_store<T: Send + 'static>(
        &self,
        job: &str,
        rank: u32,
        world_size: u32,
        list: impl FnOnce(&Persistence) -> hotstart_ckpt::Result<Option<T>> + Send + 'static,
    ) -> Result<Option<T>> {
        if self.tiers.get(TierKind::Store).is_none() {
            return Ok(None);
        }
        let persistence = self.tiers.rank(job, rank, world_size)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("hotstart-store-list".into())
            .spawn(move || {
                let _ = tx.send(list(&persistence));
            });
        if let Err(e) = spawned {
            return Err(Error::io("spawn store listing", "", e));
        }
        match rx.recv_timeout(STORE_LIST_DEADLINE) {
            Ok(Ok(found)) => Ok(found),
            Ok(Err(e)) => {
                warn!(job, error = %e, "cannot list the store");
                Err(CkptError::unavailable(TierKind::Store, job, e).into())
            }
            Err(_) => {
                warn!(job, deadline = ?STORE_LIST_DEADLINE, "the store did not list the job in time");
                let late = CkptError::Task {
                    what: "listing the store",
                    message: format!("no answer within {STORE_LIST_DEADLINE:?}"),
                };
                Err(CkptError::unavailable(TierKind::Store, job, late).into())
            }
        }
    }

    /// Serves `step` (or the latest) of `job`'s `rank` from the nearest tier; see the module
    /// docs. [`CkptError::NotFound`] when no tier has it. `file`: the asking process can take
    /// a file of this node's disk instead of a segment. `regions`: the process reads only
    /// these byte ranges (see the module docs).
    pub(crate) fn restore(
        &self,
        job: &str,
        rank: u32,
        world_size: u32,
        step: Option<u64>,
        file: bool,
        regions: Option<&[Region]>,
    ) -> Result<Served> {
        let started = Instant::now();
        let not_found = |step| CkptError::NotFound {
            job: job.to_string(),
            step,
            rank,
        };
        let step = match step {
            Some(s) => s,
            None => self
                .latest(job, rank, world_size, None)?
                .ok_or_else(|| not_found(None))?,
        };
        let key = ShardKey {
            job: job.to_string(),
            rank,
            step,
        };
        let in_memory = self.memory.get(&key).filter(|s| self.seal_to_hand_out(s));
        let (shard, source, chunk_sources) = if let Some(s) = in_memory {
            let n = s.manifest.chunks.len();
            (s, TierKind::Memory, vec![TierKind::Memory; n])
        } else if let Some((s, from, part)) =
            self.fetch_from_peers(&key, &self.members.up(), regions)
        {
            let n = part.as_ref().map_or(s.manifest.chunks.len(), Vec::len);
            info!(shard = %key, peer = %from, chunks = n, "fetched from a peer");
            if part.is_none() {
                // Whole: the next restore of it on this node is served from memory.
                self.memory.insert(s.clone());
            }
            (s, TierKind::Peer, vec![TierKind::Peer; n])
        } else if self.tiers.is_empty() {
            return Err(not_found(Some(step)).into());
        } else if let Some(served) = file
            .then(|| self.hand_file(&key, world_size, started))
            .flatten()
        {
            return Ok(served);
        } else {
            let (s, sources) = self.read_back(&key, world_size)?;
            self.memory.insert(s.clone());
            let source = if sources.iter().all(|t| *t == TierKind::Disk) {
                TierKind::Disk
            } else {
                TierKind::Store
            };
            (s, source, sources)
        };
        if shard.world_size != world_size {
            return Err(Error::format(
                "shard",
                key.to_string(),
                format!(
                    "saved by a world of {}, asked by a world of {world_size}",
                    shard.world_size
                ),
            ));
        }
        let took = started.elapsed();
        self.metrics.restored(source, took);
        info!(shard = %key, %source, seconds = took.as_secs_f64(), "restore served");
        Ok(Served {
            step,
            manifest_json: shard.manifest_json.clone(),
            bytes: ServedBytes::Shard(shard),
            source,
            chunk_sources,
            took,
        })
    }

    /// `key`'s file where this node keeps it on disk (its disk tier, or a store that is a local
    /// directory) and that tier would be read first, opened for the asking process to read
    /// and verify itself: at the disk's speed straight into its own memory, with no copy into
    /// memory new to this sidecar first. None where the step is not on this node's disk, or
    /// its file cannot be opened (the restore then goes on as before).
    fn hand_file(&self, key: &ShardKey, world_size: u32, started: Instant) -> Option<Served> {
        let opened = self
            .tiers
            .rank(&key.job, key.rank, world_size)
            .and_then(|p| p.open_local_file(key.step));
        let (manifest, file, source) = match opened {
            // Another world's step: the restore below says so.
            Ok(Some(found)) if found.0.world_size == world_size => found,
            Ok(_) => return None,
            Err(e) => {
                warn!(shard = %key, error = %e, "cannot hand over the step's file; reading it into memory");
                return None;
            }
        };
        let took = started.elapsed();
        self.metrics.restored(source, took);
        info!(shard = %key, %source, seconds = took.as_secs_f64(), "restore handed over the file");
        Some(Served {
            step: key.step,
            manifest_json: String::from_utf8(manifest.to_json()).unwrap_or_default(),
            bytes: ServedBytes::File(file),
            source,
            chunk_sources: vec![source; manifest.chunks.len()],
            took,
        })
    }

    /// Seals a shard in memory for good before its segment is handed to a training process
    /// (see `super::shm`). The seal fails (`EBUSY`) while a process maps the segment writable
    /// (a trainer killed right after its commit, until the kernel has torn it down: its
    /// replacement often asks sooner) or I/O in flight pins its pages (this sidecar's own
    /// `O_DIRECT` persistence of the step). So a restore waits: [`SEAL_WAIT`] for the first,
    /// and for as long as this sidecar's persistence or replication still reads the shard (up
    /// to `--stage-timeout`). One that keeps a writable mapping (it committed without
    /// unmapping) cannot be trusted: the shard leaves the memory tier, and the restore goes on
    /// to the next tier.
    fn seal_to_hand_out(&self, shard: &Arc<Shard>) -> bool {
        let started = Instant::now();
        // Held besides by the index and this restore: read by a persistence or a replication.
        let read_here = || Arc::strong_count(shard) > 2 || Arc::strong_count(&shard.seg) > 1;
        let sealed = loop {
            match shard.seg.seal_within(SEAL_WAIT) {
                Err(e)
                    if e.raw_os_error() == Some(libc::EBUSY)
                        && read_here()
                        && started.elapsed() < self.cfg.stage_timeout => {}
                done => break done,
            }
        };
        if started.elapsed() > Duration::from_millis(100) {
            info!(shard = %shard.key, seconds = started.elapsed().as_secs_f64(),
                "the restore waited for the step's segment to be sealed");
        }
        match sealed {
            Ok(()) => true,
            Err(e) => {
                self.metrics.failed(Failure::Restore);
                error!(
                    shard = %shard.key,
                    error = %e,
                    "a process still maps this step's segment writable; not served from memory"
                );
                self.memory.remove(&shard.key);
                false
            }
        }
    }

    /// Reads `key` back from disk or store into a new sealed segment, verified chunk by chunk.
    fn read_back(&self, key: &ShardKey, world_size: u32) -> Result<(Arc<Shard>, Vec<TierKind>)> {
        let persistence = self.tiers.rank(&key.job, key.rank, world_size)?;
        let name = format!("hotstart-{}-{}-{}", key.job, key.step, key.rank);
        let prefill = |m: &format::Manifest, nearest, buf: &mut [u8]| {
            self.prefill_shared(key, m, nearest, buf)
        };
        let (manifest, seg, sources) = persistence.read_into_prefilled(
            key.step,
            |len, nearest| {
                let what = format!("{key} from {nearest}");
                let charge = self
                    .memory
                    .reserve(len as u64, self.cfg.stage_timeout, &what)
                    .inspect_err(|_| {
                        self.metrics.failed(Failure::Budget);
                    })?;
                Segment::create_to_fill(&name, len, Some(Box::new(charge)))
                    .map_err(|e| Error::io("create shared memory", &name, e))
            },
            prefill,
        )?;
        let sealed = seg
            .seal()
            .map_err(|e| Error::io("seal shared memory", &name, e))?;
        let json = String::from_utf8(manifest.to_json()).unwrap_or_default();
        let shard = Arc::new(Shard {
            key: key.clone(),
            world_size,
            origin: self.me.node.clone(),
            manifest,
            manifest_json: json,
            seg: Arc::new(sealed.into()),
            committed: Instant::now(),
            parts: Default::default(),
        });
        Ok((shard, sources))
    }
}

/// The newest step of `job` complete for every rank of `world_size` (older than `below`) among
/// `seen`: shards in memory of that world size, and disk manifests of it (or of an unknown
/// one: a manifest that could not be read, or a peer that does not say).
fn newest_for(seen: &[ShardInfo], job: &str, world_size: u32, below: Option<u64>) -> Option<u64> {
    // `index`'s rule over what the inventories list as committed; the restore reads the asked
    // rank's manifest.
    let mut present = StepIndex::default();
    for s in seen {
        let fits = s.world_size == world_size || (s.held == Held::Disk && s.world_size == 0);
        if s.job == job && fits {
            present.insert_committed(s.step, s.rank, s.len);
        }
    }
    present.newest_committed(world_size, below)
}

/// The world size that wrote `rank`'s manifest of `step` on `disk`, or 0 when it cannot be
/// read (the entry then counts for any world size, as a peer that does not say).
fn saved_world_size(disk: &dyn Tier, job: &str, step: u64, rank: u32) -> u32 {
    let key = format::manifest_key(job, step, rank);
    match disk.get_manifest(&key) {
        Ok(Some(bytes)) => format::Manifest::parse(&bytes, &key)
            .ok()
            .filter(|m| m.job == job && m.step == step && m.rank == rank)
            .map_or(0, |m| m.world_size),
        _ => 0,
    }
}
