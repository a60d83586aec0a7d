//! Steps held in memory, pinned for the GPU (`gpu_pin`, on by default where it can be).
//!
//! A restore into device tensors needs its bytes in pinned (page-locked) host memory before the
//! device can copy them at full speed. The restarted training process has none: the sidecar's
//! segment is new to it, and pinning it there (or copying it into pinned buffers) is the cost
//! of every such restore. The sidecar's process is not new, so it pins each step once, when the
//! step is committed (or first restored from elsewhere), in the background on a thread of its
//! own (`cuMemHostRegister`, read-only and portable to every device, about as fast as a copy
//! of the bytes); the registration lives exactly as long as the segment's mapping (it is the
//! segment's attachment, see [`Committed::attach`]), and so goes when the step is evicted or its
//! segment recycled.
//!
//! A restore then asks the sidecar, on the connection the segment came on, to copy the device
//! tensors' ranges itself (`LocalMsg::Upload`): the process shares each destination's device
//! allocation with a CUDA IPC handle, and the sidecar opens them, copies from its pinned
//! mapping on a copy stream per device, waits, and closes them. The bytes copied are the
//! segment's, which the sidecar verified against the manifest when it took them and which
//! cannot change since (sealed). Whenever that cannot be done (this build has no GPU support,
//! no driver or device, pinning is off or has not reached the step yet, the memory cannot be
//! shared) the answer says why, and the process copies the bytes through its own pinned
//! buffers as before.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Instant;

use hotstart_ckpt::cuda::{self, HostPin};
use hotstart_proto::shm::Committed;
use hotstart_proto::wire::DeviceCopy;
use tracing::{info, warn};

use crate::memory::{Shard, ShardKey};
use crate::metrics::PinCounts;

/// Pins steps held in memory for the GPU, or says why it does not.
pub(crate) enum Pins {
    /// Not pinning, and why (the answer to every upload).
    Off(String),
    /// Steps to pin, to the pinning thread, and what it has done.
    On {
        tx: Mutex<Sender<(ShardKey, Weak<Committed>)>>,
        counters: Arc<Counters>,
    },
}

/// What the pinning thread has done, for the metrics.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pinned: AtomicU64,
    failed: AtomicU64,
    micros: AtomicU64,
    held_bytes: AtomicU64,
    waiting: AtomicU64,
}

/// A segment's registration as pinned memory, counted in the metrics while it lasts.
struct Held {
    _pin: HostPin,
    bytes: u64,
    counters: Arc<Counters>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.counters
            .held_bytes
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl Pins {
    /// Pins when `enabled` and the GPU path can run here (its thread started now); otherwise
    /// says why not, once, in the log.
    pub(crate) fn start(enabled: bool) -> Pins {
        if !enabled {
            return Pins::Off("pinning for the GPU is off (--no-gpu-pin)".into());
        }
        let devices = match cuda::available() {
            Ok(n) => n,
            Err(e) => {
                info!(reason = %e, "steps in memory are not pinned for the GPU");
                return Pins::Off(e.to_string());
            }
        };
        let (tx, rx) = channel::<(ShardKey, Weak<Committed>)>();
        let counters = Arc::new(Counters::default());
        let mine = counters.clone();
        let spawned = std::thread::Builder::new()
            .name("hotstart-pin".into())
            .spawn(move || {
                let mut warned = false;
                while let Ok(first) = rx.recv() {
                    // Saves can come faster than pins: of the steps waiting, each rank's newest
                    // only (a restart restores that one).
                    let mut taken = 0;
                    let mut newest: BTreeMap<(String, u32), (u64, Weak<Committed>)> =
                        BTreeMap::new();
                    for (key, seg) in std::iter::once(first).chain(rx.try_iter()) {
                        taken += 1;
                        let at = newest
                            .entry((key.job, key.rank))
                            .or_insert((key.step, Weak::new()));
                        if key.step >= at.0 {
                            *at = (key.step, seg);
                        }
                    }
                    // A segment recycled or freed meanwhile needs nothing.
                    for seg in newest.into_values().filter_map(|(_, seg)| seg.upgrade()) {
                        pin(&seg, &mine, &mut warned);
                    }
                    // Release: whoever reads the fewer waiting sees the counts of these pins.
                    mine.waiting.fetch_sub(taken, Ordering::Release);
                }
            });
        match spawned {
            Ok(_) => {
                info!(
                    devices,
                    "steps in memory are pinned for the GPU as they are committed"
                );
                Pins::On {
                    tx: Mutex::new(tx),
                    counters,
                }
            }
            Err(e) => Pins::Off(format!("cannot start the pinning thread: {e}")),
        }
    }

    /// Pins `shard`'s segment in the background, unless it is pinned already.
    pub(crate) fn pin(&self, shard: &Shard) {
        if let Pins::On { tx, counters } = self
            && shard.seg.attached().is_none()
        {
            let tx = tx.lock().unwrap_or_else(PoisonError::into_inner);
            counters.waiting.fetch_add(1, Ordering::Relaxed);
            if tx
                .send((shard.key.clone(), Arc::downgrade(&shard.seg)))
                .is_err()
            {
                counters.waiting.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// What pinning has done so far, for the metrics.
    pub(crate) fn counts(&self) -> PinCounts {
        let Pins::On { counters: c, .. } = self else {
            return PinCounts::default();
        };
        // Waiting first (acquire): the pins it no longer counts are in the counts read after.
        let waiting = c.waiting.load(Ordering::Acquire);
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PinCounts {
            pinned: n(&c.pinned),
            failed: n(&c.failed),
            seconds: n(&c.micros) as f64 / 1e6,
            held_bytes: n(&c.held_bytes),
            waiting,
        }
    }

    /// Copies `copies` of `shard`'s file into the device memory they name, from its pinned
    /// mapping; the bytes copied, or why not.
    pub(crate) fn upload(&self, shard: &Shard, copies: &[DeviceCopy]) -> Result<u64, String> {
        if let Pins::Off(why) = self {
            return Err(why.clone());
        }
        let seg = &shard.seg;
        if !seg.attached().is_some_and(|a| a.is::<Held>()) {
            return Err(
                "the step is not pinned for the GPU yet (steps are pinned in the \
                        background once committed)"
                    .into(),
            );
        }
        let file = &seg.bytes()[..shard.len() as usize];
        cuda::copy_to_shared(file, copies).map_err(|e| e.to_string())
    }
}

/// Registers `seg`'s mapping as pinned memory and attaches the registration to it.
fn pin(seg: &Committed, counters: &Arc<Counters>, warned: &mut bool) {
    if seg.attached().is_some() {
        return;
    }
    let started = Instant::now();
    let bytes = seg.bytes();
    // SAFETY: the registration is attached to `seg`, so it is dropped before the mapping is
    // unmapped (`Committed`'s field order, and `recycle`); copies from it are made only by
    // `Pins::upload`, whose caller holds the segment until they are done.
    let pinned = unsafe { cuda::pin_read_only(bytes.as_ptr(), bytes.len()) };
    let took = started.elapsed();
    counters
        .micros
        .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    match pinned {
        Ok(p) => {
            counters.pinned.fetch_add(1, Ordering::Relaxed);
            let len = bytes.len() as u64;
            counters.held_bytes.fetch_add(len, Ordering::Relaxed);
            let held = Held {
                _pin: p,
                bytes: len,
                counters: counters.clone(),
            };
            if seg.attach(Box::new(held)) {
                info!(
                    bytes = len,
                    seconds = took.as_secs_f64(),
                    "pinned for the GPU"
                );
            }
        }
        Err(e) => {
            counters.failed.fetch_add(1, Ordering::Relaxed);
            if !*warned {
                *warned = true;
                warn!(error = %e, "cannot pin a step for the GPU; restores into device tensors copy through the process's own pinned buffers");
            }
        }
    }
}
