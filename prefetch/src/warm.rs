//! Page-cache warming: a replayed profile's file pages go into the kernel's page cache before
//! the job reads them, so those reads (and page faults of mapped libraries) never leave the
//! kernel.
//!
//! **Why.** A prefetched chunk already saves the job the fetch, but each read of it still took
//! a round trip through the daemon: a Python import of numpy and pandas sent 1,158 reads and
//! 705 lookups, at 30–50 µs each, and the job's thread copied every page into the page cache
//! itself. On a small node that was most of the gap to a local directory.
//!
//! **How.** A thread of its own walks the files holding the plan's chunks, in the order of
//! their first chunk in the plan (the order the job first read them). For each file it lists
//! the file's directory through the mount once (one READDIRPLUS per directory makes the kernel
//! know every inode in it), waits for the file's planned chunks to be prefetched (it never
//! fetches one itself, nor takes one off the queue), and stores each run of adjacent planned
//! chunks, cut to whole pages, with FUSE's store notification ([`PageCache::store`]). Pages
//! the job reads first, and a run's partial edge pages, are read as usual.
//!
//! **What the job read is still recorded.** Reads served by the page cache never reach the
//! filesystem, so the profile would lose them. Every file the warmer takes on is therefore
//! given to the kernel with no TTL (in lookups and listings, see [`ImageFs::plan_warming`])
//! until the job uses it: its first lookup or attribute request from a thread other than the
//! warmer's counts its stored chunks as read, then (and from then on) the usual TTL is given.
//! A file the job never opens is not counted, and its chunks leave the profile as any unread
//! chunk does. A file used before the warmer got to it is left to its reads.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use hotstart_fuse::PageCache;

use crate::fs::{ImageFs, WarmFile, WarmRun};

/// Runs the warmer over `files` (from [`ImageFs::plan_warming`]) on this thread, until it is
/// through them or `stop` fires; `replaying` turns false when the prefetcher is done, after
/// which a chunk that is not in memory or in flight will not come.
pub fn warm(
    fs: &ImageFs,
    files: Vec<WarmFile>,
    mountpoint: &Path,
    cache: &PageCache,
    rt: &tokio::runtime::Handle,
    stop: &tokio::sync::watch::Receiver<bool>,
    replaying: &tokio::sync::watch::Receiver<bool>,
) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() } as u32;
    fs.set_warmer_thread(tid);
    let page = page_size();
    // Runs in the order the plan brings their first chunk, so a large file's later runs do
    // not hold up the files read before them.
    let mut runs: Vec<(&WarmFile, &WarmRun)> = files
        .iter()
        .flat_map(|f| f.runs.iter().map(move |r| (f, r)))
        .collect();
    runs.sort_by_key(|(f, r)| (r.rank, f.ino, r.offset));
    let mut listed: HashSet<PathBuf> = HashSet::new();
    let mut warmed: HashSet<u64> = HashSet::new();
    for (file, run) in runs {
        if *stop.borrow() {
            break;
        }
        let dir = match file.path.rsplit_once('/') {
            Some((d, _)) => mountpoint.join(d),
            None => mountpoint.to_path_buf(),
        };
        if !listed.contains(&dir) {
            let listing = std::fs::read_dir(&dir).and_then(|mut d| d.try_for_each(|e| e.map(drop)));
            if let Err(e) = listing {
                tracing::debug!(dir = %dir.display(), error = %e, "cannot list; not warming");
                continue;
            }
            listed.insert(dir);
        }
        let Some(data) = rt.block_on(fetch_run(fs, run, stop, replaying)) else {
            continue;
        };
        let Some((at, pages)) = whole_pages(run.offset, &data, file.size, page) else {
            continue;
        };
        if !fs.claim_for_warming(file.ino, &run.chunks) {
            continue;
        }
        if let Err(e) = cache.store(file.ino, at, pages) {
            tracing::debug!(path = %file.path, error = %e, "page cache store failed");
            break;
        }
        fs.loader()
            .count_warmed(warmed.insert(file.ino), pages.len() as u64);
    }
    fs.end_warming();
}

/// The bytes of `run`, once the prefetcher has brought all its chunks; `None` when one will
/// not come (the prefetcher is done without it, or it failed) or `stop` fired.
async fn fetch_run(
    fs: &ImageFs,
    run: &WarmRun,
    stop: &tokio::sync::watch::Receiver<bool>,
    replaying: &tokio::sync::watch::Receiver<bool>,
) -> Option<bytes::Bytes> {
    let loader = fs.loader();
    let mut buf = BytesMut::with_capacity(run.chunks.iter().map(|c| c.1 as usize).sum());
    for (id, _) in &run.chunks {
        let data = loop {
            if let Some(d) = loader.fetched(id).await {
                break d;
            }
            if *stop.borrow() || !*replaying.borrow() {
                return None;
            }
            // Not started yet: the prefetcher gets to it in plan order.
            loader.wait_change(Duration::from_millis(5)).await;
        };
        buf.extend_from_slice(&data);
    }
    Some(buf.freeze())
}

/// The part of `data` (the file's bytes from `offset`) that covers whole pages: its start
/// rounded up to a page, its end down, except at the end of the file (`size`), where the
/// kernel takes the last partial page. `None` if no whole page is covered.
fn whole_pages(offset: u64, data: &[u8], size: u64, page: u64) -> Option<(u64, &[u8])> {
    let end = offset + data.len() as u64;
    let from = offset.div_ceil(page) * page;
    let to = if end >= size { end } else { end / page * page };
    (to > from).then(|| {
        (
            from,
            &data[(from - offset) as usize..(to - offset) as usize],
        )
    })
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as u64 } else { 4096 }
}

/// Starts [`warm`] on a thread of its own.
pub(crate) fn spawn(
    fs: Arc<ImageFs>,
    files: Vec<WarmFile>,
    mountpoint: PathBuf,
    cache: PageCache,
    stop: tokio::sync::watch::Receiver<bool>,
    replaying: tokio::sync::watch::Receiver<bool>,
) -> Option<std::thread::JoinHandle<()>> {
    let rt = tokio::runtime::Handle::current();
    let spawned = std::thread::Builder::new()
        .name("page-warmer".into())
        .spawn(move || warm(&fs, files, &mountpoint, &cache, &rt, &stop, &replaying));
    match spawned {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the page-cache warmer");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_only_whole_pages_except_at_the_end_of_the_file() {
        let data = vec![7u8; 10_000];
        // From 100 to 10,100 in a 20,000-byte file: pages 4096..8192 only.
        let (at, part) = whole_pages(100, &data, 20_000, 4096).unwrap();
        assert_eq!((at, part.len()), (4096, 4096));
        // The same bytes at the start of a file: 0..8192.
        let (at, part) = whole_pages(0, &data, 20_000, 4096).unwrap();
        assert_eq!((at, part.len()), (0, 8192));
        // Ending the file: its partial last page is kept.
        let (at, part) = whole_pages(100, &data, 10_100, 4096).unwrap();
        assert_eq!((at, part.len()), (4096, 10_100 - 4096));
        // Inside one page: nothing.
        assert_eq!(whole_pages(100, &data[..3000], 20_000, 4096), None);
    }
}
