//! The one save pipeline: **admit → stage → hash → sink**, for every save of an engine and for
//! the sidecar's persistence of a step it already holds.
//!
//! 1. *Admit* (`crate::admission`): at most `max_inflight` saves are in flight; the next one waits
//!    (`WhenFull::Block`) or is skipped (`WhenFull::Skip`). A save holds its `Ticket` until its
//!    memory is free again: the pool buffer once every tier wrote it, the sidecar's segment once
//!    the sidecar took it.
//! 2. *Stage* into the save's [`Target`]: a buffer of the engine's pool (`crate::staging`), or a
//!    segment of the sidecar's shared memory that the client prepared and mapped ahead
//!    (`crate::client`). The header and every tensor are copied in file order over the engine's
//!    threads, device tensors by the GPU on its own stream at the same time (`crate::cuda`); the
//!    caller's tensors are dropped and the handle is marked staged (the caller may now change
//!    them). A step the sidecar already holds ([`Input::Staged`]) is not staged again.
//! 3. *Hash* every `chunk_size` chunk with blake3 over the same threads, after staging, so it
//!    never slows the copy that training waits for; the manifest follows. A sidecar's segment is
//!    not hashed here: before the handle says staged, the sidecar is told the segment is filled
//!    (with the manifest, its hashes left to the sidecar, which hashes what it keeps anyway), and
//!    from then on the step survives this process.
//! 4. *Sink*: the engine's own tiers (disk and store) start writing the file as soon as its first
//!    bytes are staged (the disk tier in pieces behind the copies, the store tier once the whole
//!    file is there) and write the manifest, the commit, after it; retention follows each tier
//!    that succeeded. Or the sidecar: the segment is unmapped and committed over the socket, and
//!    the sidecar reports every later tier on the same connection.
//!
//! Each save runs on one thread of its own under one guard: a panic anywhere in it is caught and
//! reported on the handle. A failed tier never has a manifest for the step, so the step never
//! looks complete there.
//!
//! A step is written by one save at a time: a second save of a step still in flight in the
//! same engine is refused (`Inner::claim`), a second process saving the same job and rank is
//! refused (`crate::owner`), and a step saved again later replaces the old copy manifest first
//! (`Keys::clear_old`), so no manifest ever describes bytes of another save.

use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use tracing::{error, info, warn};

use crate::admission::Ticket;
use crate::client::Lease;
use crate::cuda::Gpu;
use crate::cuda::Pinned;
use crate::error::{Error, Result};
use crate::format::{self, Layout, Manifest};
use crate::handle::{Phase, SaveHandle, Shared};
use crate::persistence::Persistence;
use crate::staging::{self, FailUnlessComplete, Region, Staging};
use crate::tensor::{Extras, Source, Tensor};
use crate::tier::Tier;

/// What a save writes.
pub(crate) enum Input {
    /// Tensors to stage, laid out by `layout`; device tensors are copied through `gpu`.
    Tensors {
        layout: Layout,
        tensors: Vec<Tensor>,
        extras: Extras,
        gpu: Arc<Gpu>,
    },
    /// A file of `len` bytes already staged and hashed (a sidecar's committed segment), and its
    /// manifest.
    Staged { len: usize, manifest: Vec<u8> },
}

impl Input {
    fn len(&self) -> usize {
        match self {
            Input::Tensors { layout, .. } => layout.file_len as usize,
            Input::Staged { len, .. } => *len,
        }
    }
}

/// The memory a save stages into, which also decides where it goes.
pub(crate) enum Target {
    /// A buffer of the engine's pool, written to the engine's tiers.
    Pool(staging::Slot),
    /// Memory that already holds the file, written to the engine's tiers.
    Filled(Arc<dyn Region>),
    /// A segment of the sidecar's shared memory, committed to the sidecar.
    Sidecar(Box<Lease>),
}

/// One save: everything its thread needs.
pub(crate) struct Save {
    /// The rank's tiers, where the file goes (unless it goes to the sidecar).
    pub(crate) core: Arc<Persistence>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) step: u64,
    /// `None` for the sidecar's persistence, which its own budget bounds.
    pub(crate) ticket: Option<Ticket>,
    pub(crate) input: Input,
}

impl Save {
    /// Runs the save to its end on the calling thread (see the module docs); the step is no
    /// longer "persisting" afterwards, whatever happened.
    pub(crate) fn run(self, target: Target) {
        let (core, shared, step) = (self.core.clone(), self.shared.clone(), self.step);
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.work(target)));
        if let Err(panic) = res {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic".into());
            error!(step, %message, "checkpoint save thread panicked");
            shared.fail_pending(Arc::new(Error::Task {
                what: "save thread",
                message,
            }));
        }
        core.done_persisting(step);
    }

    fn work(self, target: Target) {
        let Save {
            core,
            shared,
            step,
            ticket,
            input,
        } = self;
        let len = input.len();
        let (region, pool_slot) = match target {
            Target::Sidecar(lease) => {
                let mut lease = *lease;
                let filled = {
                    let image = Staging::new(lease.region(), len);
                    let (at, mut pin) = lease.staging();
                    let manifest = stage_and_hash(
                        &core,
                        &shared,
                        step,
                        &image,
                        at,
                        &mut pin,
                        input,
                        Some(&mut |m| lease.filled(m)),
                    );
                    lease.set_pin(pin);
                    manifest
                };
                // The image is gone: nothing of this process refers to the segment's bytes
                // but the lease, which unmaps it before it commits.
                let Some(committed) = filled.and_then(|_| lease.commit(&shared)) else {
                    return;
                };
                // The sidecar holds the step: its memory, not this save's, bounds what follows.
                drop(ticket);
                committed.follow(&shared);
                return;
            }
            Target::Pool(slot) => (slot.shared().map(|b| b as Arc<dyn Region>), Some(slot)),
            Target::Filled(region) => (Some(region), None),
        };
        let Some(region) = region else { return };
        let image = match &input {
            Input::Tensors { .. } => Staging::new(region, len),
            Input::Staged { .. } => Staging::filled(region, len),
        };
        let keys = Keys::new(&core, step);
        let mut slot = pool_slot;
        let persisted: Vec<&dyn Tier> = std::thread::scope(|scope| {
            // Every tier starts at once, writing what is staged while the rest is copied.
            let writers = start_writers(scope, &core, &shared, &image, &keys);
            let (at, mut pin) = match &mut slot {
                Some(s) => (s.region(), s.take_pin()),
                None => (None, None),
            };
            let manifest = stage_and_hash(&core, &shared, step, &image, at, &mut pin, input, None);
            if let (Some(s), Some(p)) = (&mut slot, pin) {
                s.set_pin(p);
            }
            if manifest.is_none() {
                image.fail();
            }
            join_writers(&core, writers, manifest.as_deref())
        });
        // The bytes are no longer needed: free the memory (and admit the next save) before
        // retention.
        drop(image);
        drop(slot);
        drop(ticket);
        core.retention(step, persisted);
    }
}

/// Stage and hash: fills `image` from the input's tensors, marks the handle staged and returns
/// the manifest; the manifest at once for a file already staged. `None` after a failure, which
/// is then on the handle. `at` is the memory under the image, for `pin` (see [`stage`]).
/// `filled` (a sidecar's segment) is told, before the handle says staged, that every byte is in
/// place, with the manifest whose hashes the sidecar computes (it hashes what it commits
/// anyway, so this process does not): from then on the step survives this process. That
/// manifest, unhashed, is what is returned then.
#[allow(clippy::too_many_arguments)]
fn stage_and_hash(
    core: &Persistence,
    shared: &Shared,
    step: u64,
    image: &Staging,
    at: Option<(*const u8, usize)>,
    pin: &mut Option<Pinned>,
    input: Input,
    filled: Option<&mut dyn FnMut(Vec<u8>) -> Result<()>>,
) -> Option<Vec<u8>> {
    let (layout, tensors, extras, gpu) = match input {
        Input::Staged { manifest, .. } => return Some(manifest),
        Input::Tensors {
            layout,
            tensors,
            extras,
            gpu,
        } => (layout, tensors, extras, gpu),
    };
    // Fails the image if staging stops early, a panic included, so tiers stop waiting.
    let _abandon = FailUnlessComplete(image);
    let res = stage(&gpu, core.threads, at, pin, image, &layout, &tensors);
    drop(tensors);
    let manifest = res
        .and_then(|()| image.complete())
        .and_then(|staged| match filled {
            Some(tell) => {
                let chunks = staged.len.div_ceil(core.chunk_size.max(1));
                let unhashed = vec![blake3::Hash::from_bytes([0; 32]); chunks];
                let m = manifest_with(core, step, &layout, &unhashed, &extras);
                tell(m.clone()).map(|()| (m, None))
            }
            None => Ok((Vec::new(), Some(staged))),
        });
    match manifest {
        Ok((told, staged)) => {
            shared.set_staged(Phase::Done);
            let Some(staged) = staged else {
                return Some(told);
            };
            let hashes = staging::hash_chunks(staged.as_ref(), core.chunk_size, core.threads);
            Some(manifest_with(core, step, &layout, &hashes, &extras))
        }
        Err(e) => {
            error!(step, error = %e, "checkpoint staging failed");
            shared.fail_pending(Arc::new(e));
            None
        }
    }
}

/// Fills `image` from `tensors`: device tensors on the GPU's copy stream (into pinned memory
/// where `region`, the memory under the image, could be registered: `pin` keeps the
/// registration, made on first use), host tensors over the engine's threads at the same time.
/// Returns once every byte is in place.
fn stage(
    gpu: &Gpu,
    threads: usize,
    region: Option<(*const u8, usize)>,
    pin: &mut Option<Pinned>,
    image: &Staging,
    layout: &Layout,
    tensors: &[Tensor],
) -> Result<()> {
    let sources: Vec<Source<'_>> = tensors.iter().map(Tensor::source).collect();
    let first_device = sources.iter().find_map(|s| match s {
        Source::Device(d) => Some(d.ordinal),
        Source::Host(_) => None,
    });
    if let (Some(ordinal), Some((ptr, buf_len))) = (first_device, region)
        && pin.is_none()
    {
        match gpu.pin(ordinal, ptr, buf_len) {
            Ok(p) => *pin = Some(p),
            Err(e) => {
                warn!(error = %e, "cannot pin the staging buffer; copying to pageable memory")
            }
        }
    }
    image.fill(&layout.header, &sources, threads, gpu)
}

/// The manifest (JSON) of a staged file: its layout, the blake3 of every chunk and the extras.
fn manifest_with(
    core: &Persistence,
    step: u64,
    layout: &Layout,
    hashes: &[blake3::Hash],
    extras: &Extras,
) -> Vec<u8> {
    Manifest::new(
        &core.job,
        step,
        core.rank,
        core.world_size,
        layout,
        core.chunk_size as u64,
        hashes,
        extras,
    )
    .to_json()
}

/// The keys of one rank's step.
struct Keys<'a> {
    job: &'a str,
    rank: u32,
    step: u64,
    data: String,
    manifest: String,
}

impl<'a> Keys<'a> {
    fn new(core: &'a Persistence, step: u64) -> Keys<'a> {
        Keys {
            job: &core.job,
            rank: core.rank,
            step,
            data: format::data_key(&core.job, step, core.rank),
            manifest: format::manifest_key(&core.job, step, core.rank),
        }
    }

    /// A step saved again (a job that went back and trains the step anew) replaces the old
    /// copy: its manifest, the commit, goes first, so no reader ever pairs the old manifest
    /// with the new bytes, then its data.
    fn clear_old(&self, tier: &dyn Tier) -> Result<()> {
        if tier.exists(&self.manifest)? {
            warn!(step = self.step, tier = %tier.kind(), "step saved again; its old copy is replaced");
            tier.remove_rank(self.job, self.step, self.rank)?;
        }
        Ok(())
    }
}

/// A tier's writer: the channel its manifest goes to, and whether it persisted the step.
type Writer<'scope> = (
    mpsc::Sender<Vec<u8>>,
    std::thread::ScopedJoinHandle<'scope, bool>,
);

/// Starts one writer thread per tier: each writes the data file from `image` (as it is staged,
/// or at once when it is complete), then waits for the manifest on its channel and writes it,
/// the commit. Each tier's outcome is set on `shared` as soon as it is known.
fn start_writers<'scope, 'env>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    core: &'env Persistence,
    shared: &'env Shared,
    image: &'env Staging,
    keys: &'env Keys<'env>,
) -> Vec<Writer<'scope>> {
    let step = keys.step;
    core.tiers
        .iter()
        .map(|tier| {
            let (tx, rx) = mpsc::channel::<Vec<u8>>();
            let persist = scope.spawn(move || {
                let kind = tier.kind();
                let res = keys
                    .clear_old(tier.as_ref())
                    .and_then(|()| tier.put_file(&keys.data, image))
                    .and_then(|()| {
                        // Sent once every chunk is hashed; never sent if the save failed.
                        let manifest = rx.recv().map_err(|_| Error::Task {
                            what: "checksums",
                            message: "no manifest for the staged file".into(),
                        })?;
                        tier.put_manifest(&keys.manifest, manifest)
                    });
                match res {
                    Ok(()) => {
                        info!(step, tier = %kind, bytes = image.len(), "checkpoint persisted");
                        shared.set_tier(kind, Phase::Done);
                        true
                    }
                    // Staging's own error is on the handle already.
                    Err(_) if image.failed() => false,
                    Err(e) => {
                        error!(step, tier = %kind, error = %e, "checkpoint not persisted");
                        shared.set_tier(kind, Phase::Failed(Arc::new(e)));
                        false
                    }
                }
            });
            (tx, persist)
        })
        .collect()
}

/// Hands `manifest` to every writer (none: the save failed, so they give up) and waits for
/// them; the tiers that persisted the step. The commits go in tier order: a tier gets the
/// manifest once the nearer one has written it (or failed), while the data of every tier was
/// written at once. So a farther tier never holds a step newer than a nearer one that persists
/// (the rule `Persistence::newest_in_own_tiers` answers by when a tier cannot be read); a manifest is
/// a few kilobytes, and waiting for one costs a save next to nothing.
fn join_writers<'a>(
    core: &'a Persistence,
    writers: Vec<Writer<'_>>,
    manifest: Option<&[u8]>,
) -> Vec<&'a dyn Tier> {
    let mut persisted = Vec::new();
    for (tier, (tx, running)) in core.tiers.iter().zip(writers) {
        if let Some(m) = manifest {
            // A tier that failed already has hung up.
            let _ = tx.send(m.to_vec());
        }
        drop(tx);
        if running.join().unwrap_or(false) {
            persisted.push(tier.as_ref());
        }
    }
    persisted
}

impl Persistence {
    /// Persists a file that is already staged and hashed (a sidecar's committed segment) to
    /// this rank's tiers in the background, through the same sinks as every save, then applies
    /// retention. The handle reports each tier; the thread returned ends once retention is done
    /// too (the caller joins it). `manifest` must describe the first `len` bytes of `region`.
    pub fn persist_staged(
        self: &Arc<Self>,
        step: u64,
        region: Arc<dyn Region>,
        len: usize,
        manifest: Vec<u8>,
    ) -> Result<(SaveHandle, JoinHandle<()>)> {
        let shared = Shared::new(step, &self.own_tiers());
        shared.set_staged(Phase::Done);
        self.start_persisting(step);
        let save = Save {
            core: self.clone(),
            shared: shared.clone(),
            step,
            ticket: None,
            input: Input::Staged { len, manifest },
        };
        let spawned = std::thread::Builder::new()
            .name(format!("hotstart-ckpt-persist-{step}"))
            .spawn(move || save.run(Target::Filled(region)));
        match spawned {
            Ok(t) => Ok((
                SaveHandle {
                    shared,
                    step,
                    rank: self.rank,
                    // Never skipped: the sidecar's own budget bounds what it persists.
                    inflight: 0,
                },
                t,
            )),
            Err(e) => {
                self.done_persisting(step);
                Err(Error::io("spawn persist thread", "", e))
            }
        }
    }
}
