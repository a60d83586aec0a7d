//! Reused buffers for stripe bodies.
//!
//! A stripe read whole ([`StripedReader::stream`](super::StripedReader::stream), `read_at`) has
//! its HTTP body copied, piece by piece as it arrives, into one contiguous buffer. A fresh buffer
//! of several MiB costs more than the copy: the allocator maps new memory for it and the kernel
//! faults in and zeroes every page on first write, then unmaps it on free; on a FUSE mount
//! streaming at hundreds of MiB/s that was a sixth of the daemon's CPU. So stripe buffers come
//! from a process-wide free list: a [`Bytes`] made by [`filled`] owns its buffer and hands it
//! back when the last clone is dropped, and the next stripe of a similar size reuses it,
//! already faulted in. Pooled buffers are [`AlignedBuf`]s, backed by transparent huge pages
//! where the system allows, which also makes them cheaper for the kernel to pin when a FUSE
//! reply is written from them. Buffers below [`MIN_POOLED`] are not kept; at most
//! [`MAX_IDLE_BYTES`] wait in the list (beyond that a freed buffer is simply freed).

use std::sync::Mutex;

use bytes::Bytes;

use crate::uring::AlignedBuf;

/// Bodies smaller than this are not worth pooling.
pub(crate) const MIN_POOLED: usize = 1 << 20;
/// Idle buffers the pool keeps, in bytes.
pub(crate) const MAX_IDLE_BYTES: usize = 128 << 20;

struct Pool {
    free: Vec<AlignedBuf>,
    idle: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    free: Vec::new(),
    idle: 0,
});

fn lock() -> std::sync::MutexGuard<'static, Pool> {
    POOL.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A buffer of at least `len` initialised bytes: an idle one of `len..=2 * len` bytes if the
/// pool has one, else a new one of exactly `len`.
fn take(len: usize) -> AlignedBuf {
    if len >= MIN_POOLED {
        let mut pool = lock();
        if let Some(i) = pool
            .free
            .iter()
            .position(|b| (len..=len.saturating_mul(2)).contains(&b.len()))
        {
            let buf = pool.free.swap_remove(i);
            pool.idle -= buf.len();
            return buf;
        }
    }
    AlignedBuf::zeroed(len)
}

fn give(buf: AlignedBuf) {
    if buf.len() < MIN_POOLED {
        return;
    }
    let mut pool = lock();
    if pool.idle + buf.len() <= MAX_IDLE_BYTES {
        pool.idle += buf.len();
        pool.free.push(buf);
    }
}

/// The first `len` bytes of a pooled buffer; the buffer goes back to the pool on drop.
struct Pooled {
    buf: Option<AlignedBuf>,
    len: usize,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_deref().map_or(&[], |b| &b[..self.len])
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            give(buf);
        }
    }
}

/// `len` bytes filled by `fill` (which gets exactly `len` bytes to write) in a pooled buffer.
pub(crate) async fn filled<E>(
    len: usize,
    fill: impl AsyncFnOnce(&mut [u8]) -> Result<(), E>,
) -> Result<Bytes, E> {
    let mut buf = take(len);
    match fill(&mut buf[..len]).await {
        Ok(()) => Ok(Bytes::from_owner(Pooled {
            buf: Some(buf),
            len,
        })),
        Err(e) => {
            give(buf);
            Err(e)
        }
    }
}

/// Bytes idle in the pool now (for tests).
#[cfg(test)]
pub(crate) fn idle_bytes() -> usize {
    lock().idle
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn buffers_come_back_and_are_reused() {
        let len = MIN_POOLED + 4096;
        let a = filled::<()>(len, async |b: &mut [u8]| {
            b.fill(7);
            Ok(())
        })
        .await
        .unwrap();
        let addr = a.as_ptr();
        assert_eq!(a.len(), len);
        assert!(a.iter().all(|&x| x == 7));
        let clone = a.slice(10..20);
        drop(a);
        let before = idle_bytes();
        drop(clone);
        assert!(
            idle_bytes() >= before + len,
            "back in the pool with the last clone"
        );
        // A slightly smaller stripe reuses it, and sees exactly its own length.
        let b = filled::<()>(len - 100, async |b: &mut [u8]| {
            b.fill(9);
            Ok(())
        })
        .await
        .unwrap();
        assert_eq!(b.len(), len - 100);
        assert!(b.iter().all(|&x| x == 9));
        assert_eq!(b.as_ptr(), addr, "the idle buffer was reused");
        // An error hands the buffer back too.
        drop(b);
        let idle = idle_bytes();
        let err = filled(len, async |_b: &mut [u8]| Err("short body")).await;
        assert_eq!(err.unwrap_err(), "short body");
        assert_eq!(idle_bytes(), idle);
    }
}
