//! Store-side locks that keep `hotstart env gc` from deleting chunks a capture is reusing.
//!
//! A capture deduplicates against chunks already in the store: a chunk it finds there is not
//! uploaded again. If gc deleted such a chunk between that check and the capture's commit, the
//! committed snapshot would name a missing chunk. So both take a lock object in
//! `envs/locks/`: a capture a *shared* one (`capture-...`), gc an *exclusive* one (`gc-...`).
//!
//! Each side first writes its own lock object and then lists the others (S3 and local disk list
//! what was written before, so of two that race at least one sees the other): a capture that sees
//! a gc lock withdraws and waits; gc that sees any other lock withdraws and fails with
//! [`Error::Locked`]. A lock older than `stale_after` (its holder died without removing it) is
//! ignored.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use hotstart_store::Store;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

const LOCKS: &str = "locks";

/// What a lock is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockKind {
    /// Shared: any number of captures at once, no gc.
    Capture,
    /// Exclusive: no capture and no other gc.
    Gc,
}

impl LockKind {
    fn prefix(self) -> &'static str {
        match self {
            LockKind::Capture => "capture-",
            LockKind::Gc => "gc-",
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct LockBody {
    host: String,
    pid: u32,
    created_unix: u64,
}

/// A held store lock; [`StoreLock::release`] removes it.
#[derive(Debug)]
pub struct StoreLock {
    store: Store,
    name: String,
}

/// How captures wait for gc, and when a lock counts as abandoned.
#[derive(Debug, Clone, Copy)]
pub struct LockTiming {
    pub stale_after: Duration,
    pub capture_wait: Duration,
    pub poll: Duration,
}

impl Default for LockTiming {
    fn default() -> Self {
        LockTiming {
            stale_after: Duration::from_secs(6 * 3600),
            capture_wait: Duration::from_secs(30 * 60),
            poll: Duration::from_secs(2),
        }
    }
}

impl StoreLock {
    /// Takes a lock of `kind` in `store` (the `envs/` store).
    pub async fn acquire(store: &Store, kind: LockKind, timing: LockTiming) -> Result<StoreLock> {
        let started = std::time::Instant::now();
        loop {
            let lock = Self::write(store, kind).await?;
            let blockers = lock.blockers(kind, timing.stale_after).await;
            let blockers = match blockers {
                Ok(b) => b,
                Err(e) => {
                    lock.release().await;
                    return Err(e);
                }
            };
            if blockers.is_empty() {
                return Ok(lock);
            }
            lock.release().await;
            let holder = blockers.join(", ");
            if kind == LockKind::Gc || started.elapsed() >= timing.capture_wait {
                let what = match kind {
                    LockKind::Gc => "the environment store",
                    LockKind::Capture => "publishing a snapshot",
                };
                return Err(Error::Locked {
                    what: what.to_string(),
                    holder,
                });
            }
            tracing::info!(%holder, "waiting for gc of the environment store to finish");
            tokio::time::sleep(timing.poll).await;
        }
    }

    async fn write(store: &Store, kind: LockKind) -> Result<StoreLock> {
        let host = crate::util::hostname();
        let pid = std::process::id();
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let name = format!(
            "{LOCKS}/{}{}-{pid}-{}",
            kind.prefix(),
            sanitize(&host),
            now.as_nanos()
        );
        let body = LockBody {
            host,
            pid,
            created_unix: now.as_secs(),
        };
        let json = serde_json::to_vec(&body).unwrap_or_default();
        store.put(&name, Bytes::from(json)).await?;
        Ok(StoreLock {
            store: store.clone(),
            name,
        })
    }

    /// The live locks, other than this one, that `kind` must wait for.
    async fn blockers(&self, kind: LockKind, stale_after: Duration) -> Result<Vec<String>> {
        let now = SystemTime::now();
        let mut out = Vec::new();
        for o in self.store.list(LOCKS).await? {
            if o.key == self.name {
                continue;
            }
            let age = now.duration_since(o.last_modified).unwrap_or_default();
            if age > stale_after {
                tracing::warn!(lock = %o.key, ?age, "ignoring an abandoned lock");
                continue;
            }
            let file = o.key.rsplit('/').next().unwrap_or_default();
            let blocks = match kind {
                LockKind::Capture => file.starts_with(LockKind::Gc.prefix()),
                LockKind::Gc => true,
            };
            if blocks {
                out.push(file.to_string());
            }
        }
        Ok(out)
    }

    /// Removes the lock. A lock that cannot be removed goes stale after `stale_after`; that is
    /// logged, not returned, since the work it guarded is done.
    pub async fn release(self) {
        if let Err(e) = self.store.delete(&self.name).await {
            tracing::warn!(lock = %self.name, error = %e, "could not remove a store lock");
        }
    }
}

/// A host name safe inside an object key.
fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fast() -> LockTiming {
        LockTiming {
            stale_after: Duration::from_secs(3600),
            capture_wait: Duration::from_millis(300),
            poll: Duration::from_millis(50),
        }
    }

    #[tokio::test]
    async fn gc_excludes_captures_and_captures_exclude_gc() {
        let store = Store::open("memory://").unwrap();
        let a = StoreLock::acquire(&store, LockKind::Capture, fast())
            .await
            .unwrap();
        let b = StoreLock::acquire(&store, LockKind::Capture, fast())
            .await
            .unwrap();
        let err = StoreLock::acquire(&store, LockKind::Gc, fast())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Locked { .. }), "{err}");
        assert!(err.to_string().contains("capture-"), "{err}");
        a.release().await;
        b.release().await;
        let gc = StoreLock::acquire(&store, LockKind::Gc, fast())
            .await
            .unwrap();
        let err = StoreLock::acquire(&store, LockKind::Capture, fast())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("gc-"), "{err}");
        gc.release().await;
        // Every withdrawn attempt removed its own object.
        assert!(store.list(LOCKS).await.unwrap().is_empty());
    }
}
