//! This node's disk and store tiers, and the persistence core (`hotstart_ckpt::Persistence`)
//! of each job and rank held here over them: what persists a committed step, reads one back
//! into memory, and opens a step's file to hand to a restarted process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use hotstart_ckpt::Persistence;
use hotstart_ckpt::tier::disk::DiskTier;
use hotstart_ckpt::tier::store::{Runtime, StoreTier};
use hotstart_ckpt::tier::{Tier, TierKind};
use hotstart_store::uring::UringConfig;
use hotstart_store::wrap::{Counter, Interceptor};
use hotstart_store::{Store, StripeConfig};

use crate::config::SidecarConfig;
use crate::error::{Error, Result};

/// The tiers and the persistence of every rank held here.
pub(crate) struct Tiers {
    /// Disk, then store, as configured.
    list: Vec<Arc<dyn Tier>>,
    /// Counts the store's requests, for `/metrics` (a store that is a local directory has none).
    pub(crate) store_counter: Option<Arc<Counter>>,
    /// The remote store, seen through that counter.
    pub(crate) remote: Option<Store>,
    /// Complete steps kept per tier by retention.
    keep: usize,
    threads: usize,
    /// Each job, rank and world size's persistence, made on first use.
    ranks: Mutex<HashMap<(String, u32, u32), Arc<Persistence>>>,
}

impl Tiers {
    /// Opens the disk and store tiers `cfg` names (none, one or both).
    pub(crate) fn open(cfg: &SidecarConfig) -> Result<Tiers> {
        let mut list: Vec<Arc<dyn Tier>> = Vec::new();
        if let Some(dir) = &cfg.disk_dir {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("create disk tier", dir, e))?;
            list.push(Arc::new(DiskTier::new(dir.clone(), UringConfig::default())));
        }
        let mut store_counter = None;
        let mut remote = None;
        if let Some(url) = &cfg.store {
            let store = Store::open(url).map_err(|e| Error::store("open", url.clone(), e))?;
            if let Some(dir) = store.local_dir() {
                // A local directory, as the engine opens it: written and read at the disk's
                // speed, and its files handed to training processes as the disk tier's are.
                list.push(Arc::new(DiskTier::for_local_store(
                    dir,
                    UringConfig::default(),
                )));
            } else {
                let counter = Arc::new(Counter::default());
                let store = store.wrap(|inner| counter.clone().wrap(inner));
                store_counter = Some(counter);
                remote = Some(store.clone());
                list.push(Arc::new(StoreTier::new(
                    store,
                    Arc::new(Runtime::new()?),
                    StripeConfig::default(),
                    4,
                    Duration::from_millis(100),
                )));
            }
        }
        Ok(Tiers {
            list,
            store_counter,
            remote,
            keep: cfg.keep,
            threads: cfg.threads,
            ranks: Mutex::new(HashMap::new()),
        })
    }

    /// The kinds of the tiers, nearest first.
    pub(crate) fn kinds(&self) -> impl Iterator<Item = TierKind> + '_ {
        self.list.iter().map(|t| t.kind())
    }

    /// Whether no disk or store tier is configured.
    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The tier of `kind`, when configured.
    pub(crate) fn get(&self, kind: TierKind) -> Option<&dyn Tier> {
        self.list
            .iter()
            .find(|t| t.kind() == kind)
            .map(|t| t.as_ref())
    }

    /// What persists and reads back `job`'s `rank` over these tiers (made on first use).
    /// Retention on the disk looks at that rank's files only: a node's disk holds its own
    /// ranks' files and no others.
    pub(crate) fn rank(
        &self,
        job: &str,
        rank: u32,
        world_size: u32,
    ) -> hotstart_ckpt::Result<Arc<Persistence>> {
        let mut ranks = self.ranks.lock().unwrap_or_else(PoisonError::into_inner);
        let k = (job.to_string(), rank, world_size);
        if let Some(p) = ranks.get(&k) {
            return Ok(p.clone());
        }
        let mut cfg = hotstart_ckpt::EngineConfig::new(job, rank, world_size);
        cfg.keep = self.keep;
        cfg.threads = self.threads;
        let p = Arc::new(Persistence::new(&cfg, self.list.clone(), true)?);
        ranks.insert(k, p.clone());
        Ok(p)
    }
}
