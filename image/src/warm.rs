//! Page-cache warming: a replayed profile's file pages go into the kernel's page cache before
//! the job reads them, so those reads (and page faults of mapped libraries) never leave the
//! kernel.
//!
//! **Why.** A prefetched chunk already saves the job the fetch, but each read of it still took
//! a round trip through the daemon: a Python import of numpy and pandas sent 1,158 reads and
//! 705 lookups, at 30–50 µs each, and the job's thread copied every page into the page cache
//! itself. On a small node that was most of the gap to a local directory.
//!
//! **How.** A thread of its own walks the runs of adjacent planned chunks of every file that
//! holds some, in the order of their first chunk in the plan (the order the job first read
//! them). Before a file's first run it lists the file's directory through the mount, once per
//! directory (one READDIRPLUS makes the kernel know every inode in it). It waits for each
//! chunk to be prefetched (it never fetches one itself; a frame still queued for the
//! low-priority decoders it decodes on its own thread) and stores the chunk's whole pages as
//! soon as it has them, with FUSE's store notification ([`PageCache::store`]); a page that
//! straddles two chunks goes in with the second. Pages the job reads first, and a run's partial
//! edge pages, are read as usual, and a file the job is already using is skipped without
//! waiting for its chunks.
//!
//! **What the job read is still recorded.** Reads served by the page cache never reach the
//! filesystem, so the profile would lose them. Every file the warmer takes on is therefore
//! given to the kernel with no TTL (in lookups and listings, see [`ImageFs::plan_warming`])
//! until the job uses it: its first lookup or attribute request (the warmer only lists
//! directories) counts its stored chunks as read, and from then on the usual TTL is given.
//! A file the job never opens is not counted, and its chunks leave the profile as any unread
//! chunk does. A file used before the warmer got to it is left to its reads.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hotstart_fuse::PageCache;
use hotstart_store::ChunkId;

use crate::fs::{ImageFs, WarmFile, WarmRun};

/// Runs the warmer over `files` (from [`ImageFs::plan_warming`]) on this thread, until it is
/// through them or `stop` fires; `replaying` turns false when the prefetcher is done, after
/// which a chunk that is not in memory or in flight will not come.
fn warm(
    fs: &ImageFs,
    files: Vec<WarmFile>,
    mountpoint: &Path,
    cache: &PageCache,
    rt: &tokio::runtime::Handle,
    stop: &tokio::sync::watch::Receiver<bool>,
    replaying: &tokio::sync::watch::Receiver<bool>,
) {
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
    'runs: for (file, run) in runs {
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
        // Each chunk's pages go in as it arrives (a large run does not wait for its last
        // chunk), claimed first, so that a use of the file from then on counts it as read.
        let mut pages = Pages::new(run.offset, file.size, page);
        for &(id, len) in &run.chunks {
            if !fs.warming(file.ino) {
                // The job got there first: on to what it has not reached yet.
                continue 'runs;
            }
            let Some(data) = rt.block_on(fetch_chunk(fs, &id, stop, replaying)) else {
                continue 'runs;
            };
            let stores = pages.push(data);
            if !fs.claim_for_warming(file.ino, &[(id, len)]) {
                continue 'runs;
            }
            for (at, bytes) in stores {
                if !store(fs, cache, file, at, &bytes, &mut warmed) {
                    break 'runs;
                }
            }
        }
        if let Some((at, bytes)) = pages.finish()
            && !store(fs, cache, file, at, &bytes, &mut warmed)
        {
            break;
        }
    }
    fs.end_warming();
}

/// Stores `bytes` at `at` in `file`'s page cache; false if the mount is gone.
fn store(
    fs: &ImageFs,
    cache: &PageCache,
    file: &WarmFile,
    at: u64,
    bytes: &[u8],
    warmed: &mut HashSet<u64>,
) -> bool {
    if let Err(e) = cache.store(file.ino, at, bytes) {
        tracing::debug!(path = %file.path, error = %e, "page cache store failed; warming ends");
        return false;
    }
    fs.loader()
        .count_warmed(warmed.insert(file.ino), bytes.len() as u64);
    true
}

/// The bytes of chunk `id` once the prefetcher has brought them; `None` when they will not
/// come (the prefetcher is done without them, or the fetch failed) or `stop` fired.
async fn fetch_chunk(
    fs: &ImageFs,
    id: &ChunkId,
    stop: &tokio::sync::watch::Receiver<bool>,
    replaying: &tokio::sync::watch::Receiver<bool>,
) -> Option<Bytes> {
    let loader = fs.loader();
    let mut stop = stop.clone();
    loop {
        if *stop.borrow() {
            return None;
        }
        tokio::select! {
            got = loader.fetched(id) => if let Some(d) = got {
                return Some(d);
            },
            _ = stop.changed() => return None,
        }
        if !*replaying.borrow() {
            return None;
        }
        // Not started yet: the prefetcher gets to it in plan order.
        loader.wait_change(Duration::from_millis(5)).await;
    }
}

/// A run's bytes, given chunk by chunk, cut into stores of whole pages: the page-aligned
/// middle of each chunk is stored as it is (no copy), and a page that straddles two chunks is
/// put together in a buffer of its own. The run's partial first page is left out, and so is
/// its partial last page unless it ends the file (where the kernel takes a partial page).
struct Pages {
    page: u64,
    /// The file's size.
    size: u64,
    /// Where the next byte given goes in the file.
    at: u64,
    /// The first page boundary of the run: bytes before it are left out.
    from: u64,
    /// The start of the page being put together, ending at `at`.
    partial: Vec<u8>,
}

impl Pages {
    fn new(offset: u64, size: u64, page: u64) -> Pages {
        Pages {
            page,
            size,
            at: offset,
            from: offset.div_ceil(page) * page,
            partial: Vec::new(),
        }
    }

    /// The stores (file offset, bytes) that the next chunk's bytes complete.
    fn push(&mut self, mut data: Bytes) -> Vec<(u64, Bytes)> {
        let page = self.page as usize;
        let mut pos = self.at;
        self.at += data.len() as u64;
        if pos < self.from {
            let skip = ((self.from - pos) as usize).min(data.len());
            data = data.slice(skip..);
            pos += skip as u64;
        }
        let mut out = Vec::new();
        if !self.partial.is_empty() {
            let take = (page - self.partial.len()).min(data.len());
            self.partial.extend_from_slice(&data[..take]);
            data = data.slice(take..);
            pos += take as u64;
            if self.partial.len() < page {
                return out;
            }
            out.push((
                pos - page as u64,
                Bytes::from(std::mem::take(&mut self.partial)),
            ));
        }
        let whole = data.len() / page * page;
        if whole > 0 {
            out.push((pos, data.slice(..whole)));
        }
        self.partial = data[whole..].to_vec();
        out
    }

    /// The last partial page, if the run ends the file.
    fn finish(self) -> Option<(u64, Bytes)> {
        (self.at == self.size && !self.partial.is_empty()).then(|| {
            (
                self.at - self.partial.len() as u64,
                Bytes::from(self.partial),
            )
        })
    }
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
    let warmer_fs = fs.clone();
    let spawned = std::thread::Builder::new()
        .name("page-warmer".into())
        .spawn(move || {
            warm(
                &warmer_fs,
                files,
                &mountpoint,
                &cache,
                &rt,
                &stop,
                &replaying,
            )
        });
    match spawned {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the page-cache warmer");
            fs.end_warming();
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `chunks` (lengths) of a run at `offset` in a file of `size` through [`Pages`];
    /// returns the stores, checked to be whole pages (but a last one at the end of the file)
    /// holding the file's bytes.
    fn stores(offset: u64, chunks: &[usize], size: u64) -> Vec<(u64, usize)> {
        let file: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
        let mut pages = Pages::new(offset, size, 4096);
        let mut at = offset as usize;
        let mut out = Vec::new();
        for &len in chunks {
            out.extend(pages.push(Bytes::copy_from_slice(&file[at..at + len])));
            at += len;
        }
        out.extend(pages.finish());
        for (o, b) in &out {
            assert_eq!(o % 4096, 0, "store at {o}");
            let end = *o as usize + b.len();
            assert!(
                b.len() % 4096 == 0 || end == size as usize,
                "store {o}+{}",
                b.len()
            );
            assert_eq!(&b[..], &file[*o as usize..end], "bytes at {o}");
        }
        out.iter().map(|(o, b)| (*o, b.len())).collect()
    }

    #[test]
    fn pages_are_stored_whole_and_straddling_pages_put_together() {
        // From 100: the partial first page is left out; 10,000 bytes end at 10,100, so the
        // run ends mid-page in a larger file: only 4096..8192.
        assert_eq!(stores(100, &[10_000], 20_000), [(4096, 4096)]);
        // At 0 in two chunks of 5,000: page 0 from the first, the page straddling both put
        // together, nothing after 8,192 (mid-file).
        assert_eq!(
            stores(0, &[5_000, 5_000], 20_000),
            [(0, 4096), (4096, 4096)]
        );
        // The same run ending the file: its partial last page is stored.
        assert_eq!(
            stores(0, &[5_000, 5_000], 10_000),
            [(0, 4096), (4096, 4096), (8192, 1808)]
        );
        // Chunks smaller than a page: pages are put together across several.
        assert_eq!(
            stores(4096, &[1_000, 1_000, 3_000, 4_000], 30_000),
            [(4096, 4096), (8192, 4096)]
        );
        // A file of one partial page.
        assert_eq!(stores(0, &[700], 700), [(0, 700)]);
        // Inside one page, mid-file: nothing.
        assert_eq!(stores(100, &[3_000], 20_000), []);
    }
}
