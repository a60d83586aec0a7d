//! Steps held in memory, pinned for the GPU (`gpu_pin`, on by default where it can be).
//!
//! A restore into device tensors needs its bytes in pinned (page-locked) host memory before the
//! device can copy them at full speed. The restarted training process has none: the sidecar's
//! segment is new to it, and pinning it there (or copying it into pinned buffers) is the cost
//! of every such restore. The sidecar's process is not new, so it pins each step once, when the
//! step is committed (or first restored from elsewhere), in the background on a thread of its
//! own (`cuMemHostRegister`, read-only and portable to every device, about as fast as a copy
//! of the bytes); the registration lives exactly as long as the segment's mapping (it is the
//! segment's attachment, see [`Committed::attach`]), and so goes when the step is evicted. The
//! step is sealed for good first: the kernel refuses to seal a segment whose pages are pinned,
//! and a step must be sealed to be handed to a process. So the seal waits for the step's
//! persistence to disk (whose `O_DIRECT` writes pin its pages while they run), and a pinned
//! step's segment is never staged into again (each save gets a new one).
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

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use hotstart_ckpt::cuda::{self, SharedCopy};
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
    /// Why the last pin failed: what a refused upload says beside "not pinned".
    last_failure: Mutex<Option<String>>,
}

/// How long the pinning thread tries to seal a step before it gives up on pinning it: the seal
/// waits for this sidecar's `O_DIRECT` persistence of the step to disk (which pins its pages
/// while it writes them) and for a killed training process's writable mapping to go.
const SEAL_PATIENCE: Duration = Duration::from_secs(300);

/// Registers a mapping as pinned memory: the registration, kept attached to the segment (and
/// so dropped before the mapping is unmapped), or why not.
type Register = Box<dyn Fn(&[u8]) -> Result<Box<dyn Any + Send + Sync>, String> + Send>;

/// A segment's registration as pinned memory, counted in the metrics while it lasts.
struct Held {
    _pin: Box<dyn Any + Send + Sync>,
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
        let (devices, device) =
            match cuda::available().and_then(|n| Ok((n, cuda::sharing_device()?))) {
                Ok(found) => found,
                Err(e) => {
                    info!(reason = %e, "steps in memory are not pinned for the GPU");
                    return Pins::Off(e.to_string());
                }
            };
        let register: Register = Box::new(|bytes: &[u8]| {
            // SAFETY: `pin` attaches the registration to the segment whose mapping `bytes` is,
            // so it is dropped before the mapping is unmapped (`Committed`'s field order); copies
            // from it are made only by `Pins::upload`, whose caller holds the segment until they
            // are done.
            match unsafe { cuda::pin_read_only(bytes.as_ptr(), bytes.len()) } {
                Ok(p) => Ok(Box::new(p)),
                Err(e) => Err(e.to_string()),
            }
        });
        let pins = Pins::spawn(register);
        if let Pins::On { .. } = pins {
            info!(
                devices,
                device, "steps in memory are pinned for the GPU as they are committed"
            );
        }
        pins
    }

    /// Starts the pinning thread, which registers segments with `register`.
    fn spawn(register: Register) -> Pins {
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
                    for (_, seg) in newest.into_values() {
                        pin(&seg, &register, &mine, &mut warned);
                    }
                    // Release: whoever reads the fewer waiting sees the counts of these pins.
                    mine.waiting.fetch_sub(taken, Ordering::Release);
                }
            });
        match spawned {
            Ok(_) => Pins::On {
                tx: Mutex::new(tx),
                counters,
            },
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
    /// mapping; what was copied and where the time went, or why not.
    pub(crate) fn upload(
        &self,
        shard: &Shard,
        copies: &[DeviceCopy],
    ) -> Result<SharedCopy, String> {
        if let Pins::Off(why) = self {
            return Err(why.clone());
        }
        let seg = &shard.seg;
        if !seg.attached().is_some_and(|a| a.is::<Held>()) {
            let mut why = "the step is not pinned for the GPU yet (steps are sealed and pinned \
                           in the background once committed, and written to the disk tier if \
                           there is one)"
                .to_string();
            if let Pins::On { counters, .. } = self
                && let Some(last) = &*counters
                    .last_failure
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
            {
                why.push_str(&format!("; the last pin failed: {last}"));
            }
            return Err(why);
        }
        let file = &seg.bytes()[..shard.len() as usize];
        cuda::copy_to_shared(file, copies).map_err(|e| e.to_string())
    }
}

/// Seals `seg` for good, then registers its mapping as pinned memory and attaches the
/// registration to it. The seal comes first because the kernel refuses to seal a segment whose
/// pages are pinned (`F_SEAL_WRITE` fails with `EBUSY`), and a step is sealed before it is
/// handed to a process: pinned first, it could never be restored from memory again. A sealed
/// segment is never staged into again (see `hotstart_proto::shm`), so with pinning on, each
/// save gets a new segment.
fn pin(seg: &Weak<Committed>, register: &Register, counters: &Arc<Counters>, warned: &mut bool) {
    let mut failed = |why: String| {
        counters.failed.fetch_add(1, Ordering::Relaxed);
        *counters
            .last_failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(why.clone());
        if !*warned {
            *warned = true;
            warn!(error = %why, "cannot pin a step for the GPU; restores into device tensors copy through the process's own pinned buffers");
        }
    };
    let deadline = Instant::now() + SEAL_PATIENCE;
    let seg = loop {
        // A segment recycled or freed meanwhile needs nothing.
        let Some(seg) = seg.upgrade() else { return };
        if seg.attached().is_some() {
            return;
        }
        match seg.seal() {
            Ok(()) => break seg,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                drop(seg);
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return failed(format!("seal the step's segment: {e}")),
        }
    };
    let started = Instant::now();
    let bytes = seg.bytes();
    let pinned = register(bytes);
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
        Err(e) => failed(e),
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{FromRawFd, OwnedFd};

    use super::*;
    use crate::memory::Memory;
    use crate::memory::tests::shard;

    /// Holds references to the pages of `bytes` the way a driver's registration does
    /// (`vmsplice` into a pipe: the pipe keeps them until it is closed; a 64 KiB pipe, so at
    /// most 64 KiB).
    fn hold_pages(bytes: &[u8]) -> Result<(OwnedFd, OwnedFd), String> {
        let mut fds = [0; 2];
        // SAFETY: `fds` is a valid place for two descriptors.
        if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        // SAFETY: both were just opened by `pipe` and are owned by nothing else.
        let pipe = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let iov = libc::iovec {
            iov_base: bytes.as_ptr().cast_mut().cast(),
            iov_len: bytes.len(),
        };
        // SAFETY: `iov` describes readable memory that outlives the call; without
        // SPLICE_F_GIFT the pages are only referenced, never written.
        let n = unsafe { libc::vmsplice(fds[1], &iov, 1, 0) };
        if n != bytes.len() as isize {
            return Err(format!(
                "vmsplice: {n}: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(pipe)
    }

    /// Waits until no step waits for the pinning thread.
    fn settled(pins: &Pins) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while pins.counts().waiting > 0 {
            assert!(
                Instant::now() < deadline,
                "the pinning thread did not get to the step"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The pinning thread seals a step before it pins it: the kernel refuses to seal a segment
    /// whose pages something holds (a driver's registration; here a pipe's references), and a
    /// step must be sealed to be handed to a process, so a step pinned first could never be
    /// restored from memory. The registration is counted while it lasts, and goes with the
    /// segment.
    #[test]
    fn a_step_is_sealed_before_it_is_pinned_so_it_can_still_be_handed_out() {
        let len = 1 << 16;
        let mem = Memory::new(4 * len as u64, "me");

        // The kernel's rule: pages held before the seal make it fail.
        let early = shard(&mem, "j", 0, 1, len).unwrap();
        let held = hold_pages(early.seg.bytes()).unwrap();
        let err = early.seg.seal().unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EBUSY), "{err}");
        drop((held, early));

        let pins = Pins::spawn(Box::new(|bytes: &[u8]| {
            Ok(Box::new(hold_pages(bytes)?) as Box<dyn Any + Send + Sync>)
        }));
        let sh = shard(&mem, "j", 0, 2, len).unwrap();
        assert!(!sh.seg.is_sealed());
        pins.pin(&sh);
        settled(&pins);
        let c = pins.counts();
        assert_eq!((c.pinned, c.failed, c.held_bytes), (1, 0, len as u64));
        assert!(sh.seg.is_sealed(), "sealed before it was pinned");
        assert!(sh.seg.attached().is_some_and(|a| a.is::<Held>()));
        // What a restore does before it hands the segment over: sealed already, so it is fine.
        sh.seg.seal().unwrap();
        // Pinned once: asked again, nothing more is done.
        pins.pin(&sh);
        assert_eq!(pins.counts().pinned, 1);

        // The registration goes with the segment.
        drop(sh);
        assert_eq!(pins.counts().held_bytes, 0);
    }

    /// A pin that fails is counted, and a restore that asks the sidecar to copy is refused
    /// naming why (the process then copies).
    #[test]
    fn a_failed_pin_is_counted_and_named_when_an_upload_is_refused() {
        let len = 1 << 16;
        let mem = Memory::new(2 * len as u64, "me");
        let pins = Pins::spawn(Box::new(|_: &[u8]| Err("the driver said no".to_string())));
        let sh = shard(&mem, "j", 0, 1, len).unwrap();
        pins.pin(&sh);
        settled(&pins);
        let c = pins.counts();
        assert_eq!((c.pinned, c.failed, c.held_bytes), (0, 1, 0));
        let why = pins.upload(&sh, &[]).unwrap_err();
        assert!(why.contains("not pinned"), "{why}");
        assert!(
            why.contains("the last pin failed: the driver said no"),
            "{why}"
        );
    }
}
