//! Writing one new file: memory head, then a parallel multipart stream or a local spill file.
//!
//! A write handle starts in **Head**: bytes are kept in memory (holding their budget) until they
//! fill one stripe. While writes stay sequential (each starts where the last ended) the head
//! becomes a [`StripedWriter`] once it is full, and every later write streams into it: parts of
//! `stripe_size` upload in parallel while the application keeps writing. A forward gap while
//! streaming is filled with zeros, as a sparse file reads.
//!
//! **Seeking back.** Objects cannot be modified in place, so a write before the end (a zip writer
//! patching a member's header, `torch.save`) moves the file to a local [`SpillFile`]: from then on
//! writes land anywhere in it, and the whole file is uploaded, striped, at commit. In Head the
//! spill file is filled from memory. While streaming, every byte sent is also written to a spill
//! file as it goes (the **tee**: plain positioned writes that stay in the page cache and vanish at
//! close), so a seek back at any point aborts the multipart upload and carries on from the tee.
//! The tee draws from the mount's spill limit ([`SpillSpace`]); a file whose tee no longer fits
//! drops it and keeps streaming, and a later seek back is then refused with ENOSPC. A refused
//! write aborts the upload and poisons the handle, so nothing torn ever becomes visible.
//!
//! **Commit** (at flush, fsync or release) makes the object visible atomically: a head is one PUT,
//! a stream completes its multipart upload, a spill file is uploaded as a multipart stream. Any
//! store error aborts the upload and poisons the handle: the caller gets EIO and the previous
//! version of the object (if any) is untouched. A handle whose file was unlinked while open aborts
//! instead of committing.
//!
//! **Writing on after a commit.** Every close of a descriptor is a flush, including the close of
//! a copy the application never uses: a child forked while the file was being written closes its
//! copy when it execs or exits. So a commit does not end the file: the handle keeps its bytes (the
//! head in memory, a stream's tee or the spill file on disk) until release, writes may go on, and
//! the next commit publishes the whole file again. Only a streamed file whose tee was dropped
//! keeps nothing; writing to it after a commit is refused like a seek back.

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use bytes::{Bytes, BytesMut};
use hotstart_store::budget::BudgetPermit;
use hotstart_store::{Store, StripeConfig, StripedWriter};

use crate::error::{FsError, FsResult};
use crate::inode::Writing;
use crate::spill::{SpillError, SpillFile, SpillSpace};

enum Sink {
    Head(BytesMut, Option<BudgetPermit>),
    /// Streaming, with the tee while it fits the spill limit.
    Stream(Box<StripedWriter>, Option<SpillFile>),
    Spill(SpillFile),
    /// Committed, with no copy of the bytes kept (streamed without a tee, or unlinked).
    Sealed,
    Poisoned,
}

/// The write state of one file open for writing.
pub struct WriteHandle {
    store: Store,
    key: String,
    cfg: StripeConfig,
    spill: SpillSpace,
    sink: Sink,
    len: u64,
    /// The store holds bytes `0..len` as written: a commit published them and nothing changed
    /// since.
    committed: bool,
    shared: Writing,
    /// Why the tee was dropped, reported by a later seek back.
    tee_lost: Option<SpillError>,
}

impl WriteHandle {
    pub fn new(
        store: Store,
        key: String,
        cfg: StripeConfig,
        spill: SpillSpace,
        shared: Writing,
    ) -> WriteHandle {
        WriteHandle {
            store,
            key,
            cfg,
            spill,
            sink: Sink::Head(BytesMut::new(), None),
            len: 0,
            committed: false,
            shared,
            tee_lost: None,
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// The state shared with the inode while the file is being written.
    pub fn shared(&self) -> &Writing {
        &self.shared
    }

    pub fn is_committed(&self) -> bool {
        self.committed
    }

    /// Records a change: the file is `len` bytes long and differs from what was committed.
    fn set_len(&mut self, len: u64) {
        self.committed = false;
        self.len = len;
        self.shared.len.store(len, Ordering::Relaxed);
    }

    fn spill_err(&self, source: impl Into<SpillError>) -> FsError {
        FsError::Spill {
            path: self.key.clone(),
            source: source.into(),
        }
    }

    async fn poison(&mut self, e: FsError) -> FsError {
        tracing::warn!(path = %self.key, error = %e, "write failed; upload aborted, this version of the file will not be published");
        // Whatever an earlier commit published, the file as written cannot be: close says so.
        self.committed = false;
        if let Sink::Stream(w, _) = std::mem::replace(&mut self.sink, Sink::Poisoned) {
            let _ = w.abort().await;
        }
        e
    }

    /// Writes `data` at `offset`; returns the bytes written (all of them).
    pub async fn write(&mut self, offset: u64, data: &[u8]) -> FsResult<usize> {
        match &mut self.sink {
            Sink::Poisoned => {
                return Err(FsError::Poisoned {
                    path: self.key.clone(),
                });
            }
            Sink::Head(buf, permit) if offset == self.len => {
                if permit.is_none() {
                    *permit = Some(self.cfg.budget.acquire(self.cfg.stripe_size).await);
                }
                buf.extend_from_slice(data);
                let full = buf.len() >= self.cfg.effective_stripe();
                self.set_len(offset + data.len() as u64);
                if full {
                    self.start_stream().await?;
                }
            }
            Sink::Head(..) => {
                self.spill()?;
                return Box::pin(self.write(offset, data)).await;
            }
            Sink::Stream(w, tee) if offset >= self.len => {
                if let Some(t) = tee
                    && let Err(e) = t.write_at(data, offset)
                {
                    tracing::warn!(path = %self.key, error = %e,
                        "dropping the local copy of a streamed file: a seek back will be refused");
                    *tee = None;
                    self.tee_lost = Some(e);
                }
                let mut res = Ok(());
                let mut gap = offset - self.len;
                while gap > 0 && res.is_ok() {
                    let n = gap.min(1 << 20) as usize;
                    res = w.write(&vec![0u8; n]).await;
                    gap -= n as u64;
                }
                if res.is_ok() {
                    res = w.write(data).await;
                }
                if let Err(e) = res {
                    return Err(self.poison(FsError::store(&self.key, e)).await);
                }
                self.set_len(offset + data.len() as u64);
            }
            Sink::Stream(_, Some(_)) => {
                self.restart_in_spill().await;
                return Box::pin(self.write(offset, data)).await;
            }
            Sink::Stream(_, None) | Sink::Sealed => {
                let e = match self.tee_lost.take() {
                    Some(source) => self.spill_err(source),
                    None => FsError::Invalid {
                        path: self.key.clone(),
                        reason: format!(
                            "write at offset {offset} after {} bytes were streamed without a \
                             local copy",
                            self.len
                        ),
                    },
                };
                return Err(self.poison(e).await);
            }
            Sink::Spill(f) => {
                if let Err(e) = f.write_at(data, offset) {
                    let e = self.spill_err(e);
                    return Err(self.poison(e).await);
                }
                self.set_len(self.len.max(offset + data.len() as u64));
            }
        }
        Ok(data.len())
    }

    async fn start_stream(&mut self) -> FsResult<()> {
        let Sink::Head(buf, permit) = std::mem::replace(&mut self.sink, Sink::Poisoned) else {
            return Ok(());
        };
        drop(permit);
        let tee = self
            .spill
            .create()
            .and_then(|mut t| t.write_at(&buf, 0).map(|()| t));
        let tee = match tee {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(path = %self.key, error = %e,
                    "streaming without a local copy: a seek back will be refused");
                self.tee_lost = Some(e);
                None
            }
        };
        let mut w = match StripedWriter::new(&self.store, &self.key, self.cfg.clone()) {
            Ok(w) => w,
            Err(e) => return Err(self.poison(FsError::store(&self.key, e)).await),
        };
        if let Err(e) = w.write_bytes(buf.freeze()).await {
            let _ = w.abort().await;
            return Err(self.poison(FsError::store(&self.key, e)).await);
        }
        self.sink = Sink::Stream(Box::new(w), tee);
        Ok(())
    }

    /// A seek back while streaming: aborts the multipart upload (nothing of it was visible) and
    /// goes on in the tee, which holds every byte written so far.
    async fn restart_in_spill(&mut self) {
        let (w, tee) = match std::mem::replace(&mut self.sink, Sink::Poisoned) {
            Sink::Stream(w, Some(tee)) => (w, tee),
            other => {
                self.sink = other;
                return;
            }
        };
        tracing::debug!(path = %self.key, bytes = self.len,
            "seek back after streaming: aborting the upload, continuing in the local copy");
        if let Err(e) = w.abort().await {
            tracing::debug!(path = %self.key, error = %e, "abort of the streamed upload failed");
        }
        self.sink = Sink::Spill(tee);
    }

    /// Moves the in-memory head into a fresh spill file.
    fn spill(&mut self) -> FsResult<()> {
        let mut file = self.spill.create().map_err(|e| self.spill_err(e))?;
        if let Sink::Head(buf, _) = &self.sink {
            file.write_at(buf, 0).map_err(|e| self.spill_err(e))?;
        }
        tracing::debug!(path = %self.key, bytes = self.len, "out-of-order write: spilling to a local file");
        self.sink = Sink::Spill(file);
        Ok(())
    }

    /// Bytes written so far, readable back through this handle (from memory or local disk).
    pub fn read(&self, offset: u64, len: usize) -> FsResult<Bytes> {
        let end = (offset + len as u64).min(self.len);
        if offset >= end {
            return Ok(Bytes::new());
        }
        match &self.sink {
            Sink::Head(buf, _) => Ok(Bytes::copy_from_slice(&buf[offset as usize..end as usize])),
            Sink::Spill(f) | Sink::Stream(_, Some(f)) => {
                let mut out = vec![0u8; (end - offset) as usize];
                f.read_at(&mut out, offset).map_err(|e| self.spill_err(e))?;
                Ok(Bytes::from(out))
            }
            _ => Err(FsError::Refused {
                path: self.key.clone(),
                reason: "reading back a file while it is streamed to the store",
            }),
        }
    }

    /// Changes the length (ftruncate). Shrinking a streamed file restarts it in its local copy.
    pub async fn truncate(&mut self, size: u64) -> FsResult<()> {
        if size == self.len {
            return Ok(());
        }
        if size < self.len && matches!(self.sink, Sink::Stream(_, Some(_))) {
            self.restart_in_spill().await;
        }
        match &mut self.sink {
            Sink::Head(buf, _) if size < self.len => buf.truncate(size as usize),
            Sink::Head(..) | Sink::Stream(..) if size > self.len => {
                let pad = vec![0u8; (size - self.len) as usize];
                let at = self.len;
                self.write(at, &pad).await?;
            }
            Sink::Spill(f) => {
                if let Err(e) = f.set_len(size) {
                    let e = self.spill_err(e);
                    return Err(self.poison(e).await);
                }
            }
            _ => {
                return Err(FsError::Refused {
                    path: self.key.clone(),
                    reason: "shrinking a file after its bytes were streamed without a local copy",
                });
            }
        }
        self.set_len(size);
        Ok(())
    }

    /// Publishes the file as written so far (the whole of it, atomically) and returns its length.
    /// A commit with nothing written since the last one returns at once. The bytes are kept, so
    /// writes may go on and be published by a later commit.
    pub async fn commit(&mut self) -> FsResult<u64> {
        if self.committed {
            return Ok(self.len);
        }
        if self.shared.cancelled.load(Ordering::Relaxed) {
            // Unlinked while open: nothing is published.
            self.sink = match std::mem::replace(&mut self.sink, Sink::Poisoned) {
                Sink::Stream(w, tee) => {
                    let _ = w.abort().await;
                    tee.map_or(Sink::Sealed, Sink::Spill)
                }
                other => other,
            };
            self.committed = true;
            return Ok(self.len);
        }
        let kept: FsResult<Sink> = match std::mem::replace(&mut self.sink, Sink::Poisoned) {
            Sink::Sealed => Ok(Sink::Sealed),
            Sink::Poisoned => Err(FsError::Poisoned {
                path: self.key.clone(),
            }),
            Sink::Head(buf, permit) => {
                let bytes = buf.freeze();
                self.store
                    .put(&self.key, bytes.clone())
                    .await
                    .map(|_| Sink::Head(BytesMut::from(bytes), permit))
                    .map_err(|e| FsError::store(&self.key, e))
            }
            Sink::Stream(w, tee) => w
                .finish()
                .await
                .map(|_| tee.map_or(Sink::Sealed, Sink::Spill))
                .map_err(|e| FsError::store(&self.key, e)),
            Sink::Spill(f) => {
                let (store, key, cfg) = (self.store.clone(), self.key.clone(), self.cfg.clone());
                upload_spill(store, key, cfg, self.len, &f)
                    .await
                    .map(|()| Sink::Spill(f))
                    .map_err(|e| FsError::store(&self.key, e))
            }
        };
        match kept {
            Ok(kept) => {
                self.sink = kept;
                self.committed = true;
                Ok(self.len)
            }
            Err(e) => Err(self.poison(e).await),
        }
    }
}

/// Uploads a spill file's first `len` bytes as one striped (multipart) object.
async fn upload_spill(
    store: Store,
    key: String,
    cfg: StripeConfig,
    len: u64,
    f: &SpillFile,
) -> hotstart_store::Result<()> {
    let mut w = StripedWriter::new(&store, &key, cfg.clone())?;
    let stripe = cfg.effective_stripe();
    let mut off = 0u64;
    while off < len {
        let n = (len - off).min(stripe as u64) as usize;
        let mut buf = vec![0u8; n];
        if let Err(e) = f.read_at(&mut buf, off) {
            let _ = w.abort().await;
            return Err(hotstart_store::Error::Io {
                op: "read spill file",
                path: PathBuf::from(&key),
                source: e,
            });
        }
        if let Err(e) = w.write_bytes(Bytes::from(buf)).await {
            let _ = w.abort().await;
            return Err(e);
        }
        off += n as u64;
    }
    w.finish().await.map(|_| ())
}
