//! io_uring local files (`hotstart_store::uring`) against fio on the same disk, in the same run.
//!
//! # What is compared
//!
//! * **Write.** [`AtomicFileWriter`] writes a `--file-mib` file (1 MiB blocks, queue depth 32,
//!   `O_DIRECT`), fed from memory in 1 MiB pieces, and commits it. Against it: `fio
//!   --ioengine=io_uring --direct=1 --rw=write --bs=1M --iodepth=32 --end_fsync=1` writing a fresh
//!   file of the same size in the same directory.
//! * **Read.** [`UringReader::read_at`] reads the committed file, cold, into one file-sized
//!   [`AlignedBuf`] reused by every run. Against it: `fio --rw=read` with the same engine, block
//!   size and depth, reading the very same file. The page cache is dropped before every read.
//!
//! # Why it is fair
//!
//! * Same disk, same file size, same request size and queue depth, same run; the order of the
//!   tools alternates from one repetition to the next, and every figure is a median of `--runs`.
//! * Our time is the wall-clock time of the whole call sequence a user makes: `create`, `reserve`,
//!   `write` (which copies into the writer's aligned pool), `commit` (`ftruncate`, `fdatasync`,
//!   rename, directory fsync); for reads, `open` and `read_at`. fio's figure is `io_bytes /
//!   runtime` from its `--output-format=json`; that runtime includes the `end_fsync` but not fio's
//!   start-up nor its preallocation of the file, so fio is, if anything, favoured.
//! * Memory kind: our [`AlignedBuf`]s of 4 MiB and more (the writer's pool, the read buffer) ask
//!   for transparent huge pages, and a request into huge pages is cheaper to pin and map than one
//!   into 4 KiB pages. fio's buffers are 4 KiB pages unless it runs with `--mem=shmhuge`, which
//!   needs huge pages reserved in `/proc/sys/vm/nr_hugepages`. So fio runs both ways (the
//!   reservation is made for the benchmark and restored afterwards, also on error), each row is
//!   compared with the fio mode that uses the same kind of memory as we do, and a note gives the
//!   other mode's figure.
//!
//! Needs `fio`, and root to drop the page cache and reserve huge pages (without root the cache is
//! not dropped, which matters little with `O_DIRECT`, and fio runs with plain memory only).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use hotstart_store::uring::{AlignedBuf, AtomicFileWriter, UringConfig, UringReader};

use crate::StoreArgs;
use crate::report::{Figure, Report, Row, median, rate};

const MIB: usize = 1 << 20;
/// Request size, for us and for fio.
const BLOCK_SIZE: usize = MIB;
/// Requests in flight, for us and for fio.
const QUEUE_DEPTH: usize = 32;
/// The writer is fed from a source buffer of at most this size, repeated: far larger than any CPU
/// cache, so the copy into the writer's pool runs at memory speed as it would for a real tensor.
const MAX_SOURCE: usize = 256 * MIB;
/// Both rows aim for at least this fraction of fio's throughput.
const TARGET: f64 = 0.9;
const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

/// Where a tool's I/O buffers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Memory {
    /// 4 KiB pages (fio's default `--mem=malloc`).
    Plain,
    /// Huge pages (fio's `--mem=shmhuge`).
    Huge,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Tool {
    Uring,
    Fio(Memory),
}

/// Durations of one tool's writes and reads, one per repetition.
#[derive(Debug, Default)]
struct Samples {
    write: Vec<Duration>,
    read: Vec<Duration>,
}

/// Measures, `args.runs` times each, our write and cold read of a `args.file_mib` MiB file in
/// `args.dir` and fio's, and adds the medians to `report` (see the module documentation).
pub fn run(args: &StoreArgs, report: &mut Report) -> anyhow::Result<()> {
    ensure!(args.runs > 0, "--runs must be at least 1");
    ensure!(args.file_mib > 0, "--file-mib must be at least 1");
    let fio = Fio::find()?;
    let len = args.file_mib * MIB;
    let dir = tempfile::Builder::new()
        .prefix("hotstart-bench-uring-")
        .tempdir_in(&args.dir)
        .with_context(|| format!("create a scratch directory in {}", args.dir.display()))?;
    let ours_path = dir.path().join("uring.dat");
    let fio_path = dir.path().join("fio-write.dat");
    let cfg = UringConfig {
        queue_depth: QUEUE_DEPTH,
        block_size: BLOCK_SIZE,
        direct: true,
    };
    eprintln!(
        "uring vs {}: {} MiB in {}, {} runs",
        fio.version,
        args.file_mib,
        args.dir.display(),
        args.runs
    );

    let source = hotstart_testkit::pattern(len.min(MAX_SOURCE), 1);
    let huge_before = anon_huge_bytes();
    let mut read_buf = AlignedBuf::zeroed(len);
    // Touch every page now, so that no run pays the page faults.
    read_buf.fill(1);
    let ours_huge_share = anon_huge_bytes().saturating_sub(huge_before) as f64 / len as f64;

    let reservation = match HugePages::reserve(fio.huge_pages_needed()) {
        Ok(r) => Some(r),
        Err(e) => {
            report.note(format!(
                "fio ran with plain memory only: no huge pages for --mem=shmhuge ({e:#})"
            ));
            None
        }
    };
    let mut tools = vec![Tool::Uring, Tool::Fio(Memory::Plain)];
    if let Some(r) = &reservation {
        tools.push(Tool::Fio(Memory::Huge));
        eprintln!("  reserved {} huge pages for fio", r.pages);
    }

    let mut samples: BTreeMap<Tool, Samples> = BTreeMap::new();
    let mut cache_note = None;
    for run in 0..args.runs {
        let mut order = tools.clone();
        if run % 2 == 1 {
            order.reverse();
        }
        // Writes first: the reads below read the file our write of this run committed.
        for &tool in &order {
            let took = match tool {
                Tool::Uring => write_uring(&ours_path, &source, len, &cfg)?,
                Tool::Fio(memory) => {
                    let took = fio.run(&fio_path, args.file_mib, Dir::Write, memory)?;
                    remove(&fio_path)?;
                    took
                }
            };
            samples.entry(tool).or_default().write.push(took);
        }
        for &tool in &order {
            if let Err(e) = drop_page_cache() {
                cache_note.get_or_insert(format!("page cache not dropped before reads: {e}"));
            }
            let took = match tool {
                Tool::Uring => {
                    let took = read_uring(&ours_path, &mut read_buf, &cfg)?;
                    check_content(&read_buf, &source)?;
                    took
                }
                Tool::Fio(memory) => fio.run(&ours_path, args.file_mib, Dir::Read, memory)?,
            };
            samples.entry(tool).or_default().read.push(took);
        }
        remove(&ours_path)?;
    }
    drop(reservation);
    add_results(report, args, &samples, ours_huge_share, &fio.version)?;
    if let Some(note) = cache_note {
        report.note(note);
    }
    Ok(())
}

/// Adds the two rows, each against the fio mode whose memory is like ours, and the notes.
fn add_results(
    report: &mut Report,
    args: &StoreArgs,
    samples: &BTreeMap<Tool, Samples>,
    ours_huge_share: f64,
    fio_version: &str,
) -> anyhow::Result<()> {
    let bytes = (args.file_mib * MIB) as u64;
    let rate_of = |tool: Tool, dir: Dir| {
        samples.get(&tool).map(|s| {
            let xs = match dir {
                Dir::Write => &s.write,
                Dir::Read => &s.read,
            };
            rate(bytes, median(xs.clone()))
        })
    };
    let ours_huge = ours_huge_share >= 0.5;
    let peer_memory = if ours_huge && samples.contains_key(&Tool::Fio(Memory::Huge)) {
        Memory::Huge
    } else {
        Memory::Plain
    };
    let other_memory = match peer_memory {
        Memory::Huge => Memory::Plain,
        Memory::Plain => Memory::Huge,
    };
    let mut others = Vec::new();
    for dir in [Dir::Write, Dir::Read] {
        let ours = rate_of(Tool::Uring, dir).context("no uring samples")?;
        let theirs = rate_of(Tool::Fio(peer_memory), dir).context("no fio samples")?;
        report.add(Row {
            what: format!(
                "uring {0} vs fio {0}, {1} MiB in {2}",
                dir.name(),
                args.file_mib,
                args.dir.display()
            ),
            ours: Figure::Rate(ours),
            peer: format!("fio io_uring O_DIRECT {}", fio_memory_flag(peer_memory)),
            theirs: Figure::Rate(theirs),
            target: Some(TARGET),
        });
        if let Some(other) = rate_of(Tool::Fio(other_memory), dir) {
            others.push(format!(
                "{} {:.0} MiB/s (ratio {:.2})",
                dir.name(),
                other / MIB as f64,
                ours / other
            ));
        }
    }
    let mut memory_note = format!(
        "uring vs fio: {:.0}% of our read buffer is on huge pages; both rows compare with fio {}",
        ours_huge_share.min(1.0) * 100.0,
        fio_memory_flag(peer_memory)
    );
    if ours_huge != (peer_memory == Memory::Huge) {
        memory_note.push_str(" (not like for like: fio could not get huge pages)");
    }
    if !others.is_empty() {
        memory_note.push_str(&format!(
            "; fio {}: {}",
            fio_memory_flag(other_memory),
            others.join(", ")
        ));
    }
    report.note(memory_note);
    report.note(format!(
        "uring vs fio: 1 MiB requests, queue depth 32, O_DIRECT, medians of {} runs; ours is the \
         wall time of create+reserve+write+commit (fdatasync, rename) and of open+read_at, fio's \
         is io_bytes/runtime from its JSON output (runtime includes end_fsync); {}",
        args.runs, fio_version
    ));
    Ok(())
}

/// Writes `len` bytes (`source` over and over) to `path` and commits; returns the time taken.
fn write_uring(
    path: &Path,
    source: &[u8],
    len: usize,
    cfg: &UringConfig,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let mut writer = AtomicFileWriter::create(path, cfg)?;
    ensure!(
        writer.is_direct(),
        "{} does not support O_DIRECT; give a --dir on a disk",
        path.display()
    );
    writer.reserve(len as u64)?;
    let mut left = len;
    for piece in source.chunks(BLOCK_SIZE).cycle() {
        if left == 0 {
            break;
        }
        let n = piece.len().min(left);
        writer.write(&piece[..n])?;
        left -= n;
    }
    let written = writer.commit()?;
    let took = start.elapsed();
    ensure!(written == len as u64, "wrote {written} bytes, not {len}");
    Ok(took)
}

/// Reads all of `path` into `buf` (of the file's length); returns the time taken.
fn read_uring(path: &Path, buf: &mut AlignedBuf, cfg: &UringConfig) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let mut reader = UringReader::open(path, cfg)?;
    ensure!(
        reader.is_direct(),
        "{} does not support O_DIRECT; give a --dir on a disk",
        path.display()
    );
    ensure!(
        reader.len() == buf.len() as u64,
        "{} has the wrong length",
        path.display()
    );
    reader.read_at(0, buf)?;
    Ok(start.elapsed())
}

/// The file written is `source` over and over: check that this is what came back.
fn check_content(buf: &[u8], source: &[u8]) -> anyhow::Result<()> {
    for (i, chunk) in buf.chunks(source.len()).enumerate() {
        ensure!(
            chunk == &source[..chunk.len()],
            "read back different bytes in bytes {}.. of the file",
            i * source.len()
        );
    }
    Ok(())
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Dir {
    Write,
    Read,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::Write => "write",
            Dir::Read => "read",
        }
    }
}

fn fio_memory_flag(memory: Memory) -> &'static str {
    match memory {
        Memory::Plain => "--mem=malloc",
        Memory::Huge => "--mem=shmhuge",
    }
}

/// The `fio` binary and the huge page size of this system.
pub(crate) struct Fio {
    pub(crate) version: String,
    /// Bytes per huge page (`Hugepagesize` in /proc/meminfo).
    huge_page: u64,
}

impl Fio {
    pub(crate) fn find() -> anyhow::Result<Fio> {
        let out = match Command::new("fio").arg("--version").output() {
            Ok(out) if out.status.success() => out,
            Ok(out) => bail!(
                "`fio --version` failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                bail!("fio not found; install fio: apt-get install fio, or run scripts/setup.sh")
            }
            Err(e) => return Err(e).context("run fio"),
        };
        let huge_page = meminfo("Hugepagesize").unwrap_or(2048) * 1024;
        Ok(Fio {
            version: String::from_utf8_lossy(&out.stdout).trim().to_string(),
            huge_page,
        })
    }

    /// Huge pages fio's `--mem=shmhuge` needs: its `bs x iodepth` buffers (plus a page of slack,
    /// rounded up to huge pages), and a margin.
    pub(crate) fn huge_pages_needed(&self) -> u64 {
        ((QUEUE_DEPTH * BLOCK_SIZE) as u64 + 4096).div_ceil(self.huge_page) + 4
    }

    /// Runs one fio job on `path`; returns `io_bytes / runtime` as a duration for `mib` MiB.
    pub(crate) fn run(
        &self,
        path: &Path,
        mib: usize,
        dir: Dir,
        memory: Memory,
    ) -> anyhow::Result<Duration> {
        let mut cmd = Command::new("fio");
        cmd.arg("--name=hotstart-bench")
            .arg(format!("--filename={}", path.display()))
            .args([
                "--ioengine=io_uring",
                "--direct=1",
                "--bs=1M",
                "--output-format=json",
            ])
            .arg(format!("--iodepth={QUEUE_DEPTH}"))
            .arg(format!("--size={mib}M"));
        match dir {
            Dir::Write => cmd.args(["--rw=write", "--end_fsync=1"]),
            Dir::Read => cmd.arg("--rw=read"),
        };
        if memory == Memory::Huge {
            cmd.arg("--mem=shmhuge")
                .arg(format!("--hugepage-size={}", self.huge_page));
        }
        let out = cmd.output().context("run fio")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success(),
            "fio {} {} failed ({}): {}{}",
            dir.name(),
            fio_memory_flag(memory),
            out.status,
            String::from_utf8_lossy(&out.stderr),
            stdout
        );
        // fio may print warnings before the JSON document.
        let json = stdout.find('{').map_or("", |at| &stdout[at..]);
        let doc: serde_json::Value = serde_json::from_str(json)
            .with_context(|| format!("parse fio's JSON output: {stdout}"))?;
        let job = &doc["jobs"][0];
        ensure!(
            job["error"].as_i64() == Some(0),
            "fio reported error {}",
            job["error"]
        );
        let stats = &job[dir.name()];
        let io_bytes = stats["io_bytes"]
            .as_u64()
            .context("fio JSON has no io_bytes")?;
        let runtime_ms = stats["runtime"]
            .as_u64()
            .context("fio JSON has no runtime")?;
        let want = (mib * MIB) as u64;
        ensure!(io_bytes == want, "fio moved {io_bytes} bytes, not {want}");
        ensure!(runtime_ms > 0, "fio reported a zero runtime");
        Ok(Duration::from_millis(runtime_ms))
    }
}

/// Huge pages reserved in `/proc/sys/vm/nr_hugepages`; the old count is put back on drop.
pub(crate) struct HugePages {
    original: u64,
    pages: u64,
}

impl HugePages {
    pub(crate) fn reserve(pages: u64) -> anyhow::Result<HugePages> {
        let original = read_nr_hugepages()?;
        fs::write(NR_HUGEPAGES, (original + pages).to_string())
            .with_context(|| format!("write {NR_HUGEPAGES} (needs root)"))?;
        // From here on, dropping `reserved` restores the original count.
        let reserved = HugePages { original, pages };
        let free = meminfo("HugePages_Free").unwrap_or(0);
        ensure!(
            free >= pages,
            "asked for {pages} more huge pages, only {free} are free (memory too fragmented?)"
        );
        Ok(reserved)
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        if let Err(e) = fs::write(NR_HUGEPAGES, self.original.to_string()) {
            eprintln!(
                "warning: could not restore {NR_HUGEPAGES} to {}: {e}",
                self.original
            );
        }
    }
}

fn read_nr_hugepages() -> anyhow::Result<u64> {
    let text = fs::read_to_string(NR_HUGEPAGES).with_context(|| format!("read {NR_HUGEPAGES}"))?;
    text.trim()
        .parse()
        .with_context(|| format!("parse {NR_HUGEPAGES}: {text:?}"))
}

/// A number from /proc/meminfo: KiB for most keys, a count for `HugePages_*`.
fn meminfo(key: &str) -> Option<u64> {
    proc_field("/proc/meminfo", key)
}

/// Bytes of this process's anonymous memory backed by transparent huge pages.
fn anon_huge_bytes() -> u64 {
    proc_field("/proc/self/smaps_rollup", "AnonHugePages").unwrap_or(0) * 1024
}

/// The first number after `key:` in a /proc file of `key: value [kB]` lines.
fn proc_field(file: &str, key: &str) -> Option<u64> {
    let text = fs::read_to_string(file).ok()?;
    text.lines().find_map(|line| {
        let value = line.strip_prefix(key)?.strip_prefix(':')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

/// Flushes dirty pages and empties the page cache (needs root).
pub(crate) fn drop_page_cache() -> io::Result<()> {
    // SAFETY: sync(2) takes no arguments and touches no memory of this process.
    unsafe { libc::sync() };
    fs::write("/proc/sys/vm/drop_caches", "3")
}

fn remove(path: &Path) -> anyhow::Result<()> {
    fs::remove_file(path).with_context(|| format!("remove {}", path.display()))
}
