//! [`Decoder`]: prefetched chunks are decoded on the CPU the job leaves idle.
//!
//! A profile replay keeps dozens of fetches in flight. Decoded on the runtime's blocking pool,
//! their frames were decompressed and hashed by as many threads side by side, and on a small
//! node the job the mount was started for (often single-threaded, like a Python import) got a
//! fraction of a core until the replay was done: it started slower than it would have with the
//! same chunks already in memory. So the frames the prefetcher fetches are decoded by a few
//! threads of their own (one per core, at most [`MAX_THREADS`]) at the lowest CPU priority,
//! which run when the job leaves a core idle, as it does whenever it waits for a read.
//!
//! A chunk a read is waiting for is never left to them: [`Decoder::decode`] decodes at normal
//! priority a frame whose chunk was demanded while it was being fetched, and
//! [`Decoder::expedite`] takes a queued frame out for a read that asks for it later. The
//! queue and those two checks share one lock, so a frame cannot slip into the queue after the
//! read has looked for it.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use bytes::Bytes;
use hotstart_store::{ChunkId, ChunkStore, Error, Result};
use tokio::sync::oneshot;

/// Decoding threads at most, whatever the number of cores.
pub const MAX_THREADS: usize = 8;

struct Job {
    id: ChunkId,
    frame: Bytes,
    done: oneshot::Sender<Result<Bytes>>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

struct Shared {
    chunks: ChunkStore,
    queue: Mutex<Queue>,
    ready: Condvar,
}

/// Low-priority decoding threads for one loader's prefetched frames; they end when it is
/// dropped.
pub struct Decoder {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("queued", &self.lock().jobs.len())
            .finish()
    }
}

impl Decoder {
    /// A decoder for frames of `chunks` with one thread per core (at most [`MAX_THREADS`]);
    /// `None` if no thread could be started, and the caller decodes as it did before.
    pub fn start(chunks: ChunkStore) -> Option<Decoder> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (decoder, started) = Decoder::with_threads(chunks, cores.min(MAX_THREADS));
        (started > 0).then_some(decoder)
    }

    /// A decoder with `threads` threads, and how many of them started.
    fn with_threads(chunks: ChunkStore, threads: usize) -> (Decoder, usize) {
        let shared = Arc::new(Shared {
            chunks,
            queue: Mutex::new(Queue::default()),
            ready: Condvar::new(),
        });
        let mut started = 0;
        for i in 0..threads {
            let shared = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("prefetch-decode-{i}"))
                .spawn(move || {
                    lowest_cpu_priority();
                    while let Some(job) = shared.next() {
                        shared.run(job);
                    }
                });
            match spawned {
                Ok(_) => started += 1,
                Err(e) => tracing::warn!(error = %e, "cannot start a prefetch decoding thread"),
            }
        }
        (Decoder { shared }, started)
    }

    /// The verified plaintext of `frame`, the stored frame of `id`: decoded by the
    /// low-priority threads, or at once at normal priority when `demanded` says a read is
    /// already waiting for it.
    pub async fn decode(
        &self,
        id: ChunkId,
        frame: Bytes,
        demanded: impl FnOnce() -> bool,
    ) -> Result<Bytes> {
        let (done, rx) = oneshot::channel();
        let job = Job { id, frame, done };
        let now = {
            let mut queue = self.lock();
            if demanded() {
                Some(job)
            } else {
                queue.jobs.push_back(job);
                None
            }
        };
        match now {
            Some(job) => self.run_now(job),
            None => self.shared.ready.notify_one(),
        }
        rx.await.map_err(|_| Error::Task {
            what: "prefetch decode",
            message: "the decoding was dropped".into(),
        })?
    }

    /// A read now waits for `id`: if its frame is still queued, it is decoded at once at
    /// normal priority (on the runtime's blocking pool; call from within the runtime).
    pub fn expedite(&self, id: &ChunkId) {
        if let Some(job) = self.take(id) {
            self.run_now(job);
        }
    }

    /// If the frame of `id` is still queued, decodes it on this thread, at this thread's
    /// priority (for a caller that would only wait for it otherwise).
    pub fn decode_here(&self, id: &ChunkId) {
        if let Some(job) = self.take(id) {
            self.shared.run(job);
        }
    }

    fn take(&self, id: &ChunkId) -> Option<Job> {
        let mut queue = self.lock();
        let at = queue.jobs.iter().position(|j| j.id == *id)?;
        queue.jobs.remove(at)
    }

    /// Decodes `job` at normal priority on the runtime's blocking pool.
    fn run_now(&self, job: Job) {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || shared.run(job));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.shared.lock()
    }
}

impl Drop for Decoder {
    fn drop(&mut self) {
        self.lock().closed = true;
        self.shared.ready.notify_all();
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn run(&self, job: Job) {
        let _ = job.done.send(self.chunks.decode(&job.id, &job.frame));
    }

    /// The next queued job, waiting for one; `None` once the decoder is dropped.
    fn next(&self) -> Option<Job> {
        let mut queue = self.lock();
        loop {
            if queue.closed {
                return None;
            }
            if let Some(job) = queue.jobs.pop_front() {
                return Some(job);
            }
            queue = self
                .ready
                .wait(queue)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// Gives the calling thread the lowest CPU priority (nice 19; on Linux the nice value is per
/// thread), so it runs only on CPU that other work leaves idle.
pub(crate) fn lowest_cpu_priority() {
    // SAFETY: plain syscalls on this thread's own id.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use hotstart_store::{ChunkStoreConfig, Store};

    use super::*;

    fn frame_of(chunks: &ChunkStore, data: &[u8]) -> (ChunkId, Bytes) {
        let id = ChunkId::of(data);
        (id, Bytes::from(chunks.encode(&id, data).unwrap()))
    }

    fn chunks() -> ChunkStore {
        ChunkStore::new(
            Store::open("memory://").unwrap(),
            ChunkStoreConfig::default(),
        )
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn decodes_and_verifies_frames_on_its_threads() {
        let chunks = chunks();
        let decoder = Decoder::start(chunks.clone()).expect("decoding threads");
        let data = vec![7u8; 100_000];
        let (id, frame) = frame_of(&chunks, &data);
        let got = decoder.decode(id, frame.clone(), || false).await.unwrap();
        assert_eq!(&got[..], &data[..]);

        // A frame of other bytes is refused, not returned under this id.
        let (_, other) = frame_of(&chunks, b"other bytes");
        let err = decoder.decode(id, other, || false).await.unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_demanded_chunk_does_not_wait_for_the_low_priority_threads() {
        let chunks = chunks();
        // No decoding threads: a queued frame would wait for ever.
        let (decoder, started) = Decoder::with_threads(chunks.clone(), 0);
        assert_eq!(started, 0);
        let decoder = Arc::new(decoder);

        // Demanded before its frame arrived: decoded at once.
        let (id, frame) = frame_of(&chunks, &[1u8; 5000]);
        let got = decoder.decode(id, frame, || true).await.unwrap();
        assert_eq!(&got[..], &[1u8; 5000][..]);

        // Queued, then demanded: expedite takes it out of the queue.
        let data = vec![2u8; 70_000];
        let (id, frame) = frame_of(&chunks, &data);
        let waiting = tokio::spawn({
            let decoder = decoder.clone();
            async move { decoder.decode(id, frame, || false).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "nothing decodes a queued frame");
        decoder.expedite(&ChunkId::of(b"not queued"));
        decoder.expedite(&id);
        let got = waiting.await.unwrap().unwrap();
        assert_eq!(&got[..], &data[..]);
        assert_eq!(decoder.lock().jobs.len(), 0);
    }
}
