//! The object store tier: `<job>/step-<N>/rank-<R>.*` in any `hotstart-store` backend.
//!
//! The safetensors file is uploaded with a [`StripedWriter`] from the staging buffer itself:
//! `Bytes::from_owner` wraps the shared buffer, so whole stripes go out as parts with no copy
//! (only a final partial stripe is copied into the writer's part buffer). The manifest is one
//! PUT after the file's upload completed. Both are atomic in the store (a completed multipart
//! upload or a single PUT), so a reader never sees a torn object.
//!
//! Transient errors ([`hotstart_store::Error::is_transient`]: a short read, a local directory's
//! interrupted I/O) are retried with exponential backoff: `retries` more attempts, `backoff`,
//! `2 * backoff`, ... between them; each attempt of the file starts a fresh upload (the failed
//! one is aborted by the writer). A remote store's failed requests are not among them: its
//! client retried each already, and retrying the whole operation again would multiply the time
//! an outage takes to surface. Reads are ranged
//! GETs through a [`StripedReader`] of known size, parallel by stripe.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hotstart_store::{Store, StripeConfig, StripedReader, StripedWriter};
use tracing::warn;

use super::{Source, Staging, Tier, TierKind, TierReader};
use crate::error::{Error, Result};
use crate::format::{self, MAX_MANIFEST_LEN};

/// A tokio runtime that is shut down without blocking when dropped, so dropping the engine is
/// safe anywhere.
pub struct Runtime(Option<tokio::runtime::Runtime>);

impl Runtime {
    /// A runtime of two I/O threads.
    pub fn new() -> Result<Runtime> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("hotstart-ckpt-io")
            .enable_all()
            .build()
            .map_err(|e| Error::io("start runtime", "tokio", e))?;
        Ok(Runtime(Some(rt)))
    }

    fn block_on<F: Future>(&self, f: F) -> F::Output {
        match &self.0 {
            Some(rt) => rt.block_on(f),
            None => unreachable!("runtime is only taken in drop"),
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// An object store holding checkpoints.
pub struct StoreTier {
    store: Store,
    rt: Arc<Runtime>,
    stripe: StripeConfig,
    retries: u32,
    backoff: Duration,
}

impl StoreTier {
    /// A store tier on `store`, its requests run on `rt`; a transient failure is retried
    /// `retries` times after `backoff`, doubled each time.
    pub fn new(
        store: Store,
        rt: Arc<Runtime>,
        stripe: StripeConfig,
        retries: u32,
        backoff: Duration,
    ) -> StoreTier {
        StoreTier {
            store,
            rt,
            stripe,
            retries,
            backoff,
        }
    }

    /// Runs `op` until it succeeds, fails with a non-transient error, or retries run out.
    async fn retry<T, F, Fut>(&self, what: &'static str, key: &str, mut op: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = hotstart_store::Result<T>>,
    {
        let mut attempt = 0u32;
        loop {
            match op().await {
                Ok(v) => return Ok(v),
                Err(e) if e.is_transient() && attempt < self.retries => {
                    let delay = self.backoff.saturating_mul(1 << attempt.min(16));
                    attempt += 1;
                    warn!(key, error = %e, attempt, ?delay, "transient store error; retrying {what}");
                    tokio::time::sleep(delay).await;
                }
                Err(e) => return Err(Error::store(what, key, e)),
            }
        }
    }
}

impl Source for StoreTier {
    fn kind(&self) -> TierKind {
        TierKind::Store
    }

    fn reader(&self, key: &str, len: u64) -> Result<Box<dyn TierReader + '_>> {
        let r = StripedReader::with_size(&self.store, key, len, self.stripe.clone())
            .map_err(|e| Error::store("open", key, e))?;
        Ok(Box::new(StoreReader { tier: self, r }))
    }
}

impl Tier for StoreTier {
    fn put_file(&self, key: &str, data: &Staging) -> Result<()> {
        // The upload goes at network speed, far below staging's: no point streaming the prefix.
        let data = data.complete()?;
        self.rt.block_on(self.retry("upload", key, || async {
            let mut w = StripedWriter::new(&self.store, key, self.stripe.clone())?;
            w.write_bytes(Bytes::from_owner(data.clone())).await?;
            w.finish().await.map(|_| ())
        }))
    }

    fn put_manifest(&self, key: &str, json: Vec<u8>) -> Result<()> {
        let json = Bytes::from(json);
        self.rt
            .block_on(self.retry("put manifest", key, || self.store.put(key, json.clone())))
    }

    fn get_manifest(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.rt.block_on(async {
            let size = match self
                .retry("stat manifest", key, || self.store.size(key))
                .await
            {
                Ok(s) => s,
                Err(e) if e.is_not_found() => return Ok(None),
                Err(e) => return Err(e),
            };
            if size > MAX_MANIFEST_LEN {
                return Err(Error::format(
                    "manifest",
                    key,
                    format!("{size} bytes exceeds {MAX_MANIFEST_LEN}"),
                ));
            }
            match self
                .retry("get manifest", key, || self.store.get(key))
                .await
            {
                Ok(b) if b.len() as u64 > MAX_MANIFEST_LEN => Err(Error::format(
                    "manifest",
                    key,
                    format!("{} bytes exceeds {MAX_MANIFEST_LEN}", b.len()),
                )),
                Ok(b) => Ok(Some(b.to_vec())),
                Err(e) if e.is_not_found() => Ok(None),
                Err(e) => Err(e),
            }
        })
    }

    fn exists(&self, key: &str) -> Result<bool> {
        self.rt
            .block_on(self.retry("stat", key, || self.store.exists(key)))
    }

    fn list_steps(&self, job: &str) -> Result<Vec<u64>> {
        let prefix = format!("{job}/");
        let objects = self
            .rt
            .block_on(self.retry("list", &prefix, || self.store.list(&prefix)))?;
        let mut steps: Vec<u64> = objects
            .iter()
            .filter_map(|o| o.key.strip_prefix(&prefix))
            .filter_map(|rest| rest.split('/').next())
            .filter_map(format::parse_step_dir)
            .collect();
        steps.sort_unstable();
        steps.dedup();
        Ok(steps)
    }

    fn list_objects(&self, prefix: &str) -> Result<Vec<(String, u64)>> {
        let objects = self
            .rt
            .block_on(self.retry("list", prefix, || self.store.list(prefix)))?;
        Ok(objects.into_iter().map(|o| (o.key, o.size)).collect())
    }

    fn remove_rank(&self, job: &str, step: u64, rank: u32) -> Result<()> {
        for key in [
            format::manifest_key(job, step, rank),
            format::data_key(job, step, rank),
        ] {
            self.rt
                .block_on(self.retry("delete", &key, || self.store.delete(&key)))?;
        }
        Ok(())
    }
}

struct StoreReader<'a> {
    tier: &'a StoreTier,
    r: StripedReader,
}

impl TierReader for StoreReader<'_> {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let (r, tier) = (&self.r, self.tier);
        tier.rt.block_on(async {
            let mut attempt = 0u32;
            loop {
                match r.read_into(offset, buf).await {
                    Ok(()) => return Ok(()),
                    Err(e) if e.is_transient() && attempt < tier.retries => {
                        let delay = tier.backoff.saturating_mul(1 << attempt.min(16));
                        attempt += 1;
                        warn!(key = r.key(), error = %e, attempt, "transient store error; retrying read");
                        tokio::time::sleep(delay).await;
                    }
                    Err(e) => return Err(Error::store("read", r.key(), e)),
                }
            }
        })
    }
}
