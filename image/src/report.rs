//! [`MountReport`]: what one lazy mount did, as logged at unmount, stored beside the image
//! (`runs/<run>.json`), shown by `hotstart image stats` and exported as metrics.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::loader::LoaderStats;
use crate::metrics;
use crate::prefetch::ReplayStats;

/// One mount's figures. Chunk counts are distinct chunks; bytes are plaintext.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MountReport {
    pub run: String,
    /// What was mounted (`name:tag` for an image).
    pub tree: String,
    /// Milliseconds since the Unix epoch when the mount started.
    pub started_ms: u64,
    /// How long it was mounted.
    pub seconds: f64,
    /// Read calls and the bytes they returned.
    pub reads: u64,
    pub bytes_read: u64,
    /// Distinct chunks read, and their bytes.
    pub chunks_read: u64,
    pub chunk_bytes_read: u64,
    /// Distinct chunks that were local when first read.
    pub hits: u64,
    /// `hits / chunks_read` (1 when nothing was read).
    pub hit_rate: f64,
    /// Total time reads waited for chunks from the store.
    pub stall_seconds: f64,
    /// Chunks reads had to fetch themselves, and their bytes.
    pub demand_fetches: u64,
    pub demand_fetch_bytes: u64,
    /// Chunks the profile planned, and the prefetcher brought in.
    pub planned_chunks: u64,
    pub planned_bytes: u64,
    pub prefetched_chunks: u64,
    pub prefetched_bytes: u64,
    /// Prefetched and never read.
    pub wasted_chunks: u64,
    pub wasted_bytes: u64,
    pub prefetch_errors: u64,
    /// Files whose prefetched pages were stored in the kernel's page cache ahead of the job,
    /// and those pages' bytes.
    #[serde(default)]
    pub warmed_files: u64,
    #[serde(default)]
    pub warmed_bytes: u64,
    /// The prefetch window at the end and at its largest.
    pub final_window: u64,
    pub peak_window: u64,
}

impl MountReport {
    /// A report from a loader's counters and (if it ran) the prefetcher's.
    pub fn new(
        run: &str,
        tree: &str,
        started_ms: u64,
        seconds: f64,
        s: &LoaderStats,
        replay: Option<&ReplayStats>,
    ) -> MountReport {
        let replay = replay.copied().unwrap_or_default();
        MountReport {
            run: run.to_string(),
            tree: tree.to_string(),
            started_ms,
            seconds,
            reads: s.reads,
            bytes_read: s.bytes_read,
            chunks_read: s.chunks_read,
            chunk_bytes_read: s.chunk_bytes_read,
            hits: s.hits,
            hit_rate: if s.chunks_read == 0 {
                1.0
            } else {
                s.hits as f64 / s.chunks_read as f64
            },
            stall_seconds: s.stall.as_secs_f64(),
            demand_fetches: s.demand_fetches,
            demand_fetch_bytes: s.demand_fetch_bytes,
            planned_chunks: replay.planned,
            planned_bytes: replay.planned_bytes,
            prefetched_chunks: s.prefetched,
            prefetched_bytes: s.prefetched_bytes,
            wasted_chunks: s.wasted,
            wasted_bytes: s.wasted_bytes,
            prefetch_errors: s.prefetch_errors,
            warmed_files: s.warmed_files,
            warmed_bytes: s.warmed_bytes,
            final_window: replay.final_window as u64,
            peak_window: replay.peak_window as u64,
        }
    }

    /// Wasted bytes as a fraction of the chunk bytes read.
    pub fn waste_ratio(&self) -> f64 {
        if self.chunk_bytes_read == 0 {
            0.0
        } else {
            self.wasted_bytes as f64 / self.chunk_bytes_read as f64
        }
    }

    /// One line for the log. Ratios to what was read are left out when nothing was read.
    pub fn summary(&self) -> String {
        let (hit_rate, waste) = if self.chunk_bytes_read == 0 {
            (String::new(), String::new())
        } else {
            (
                format!(", hit rate {:.1}%", self.hit_rate * 100.0),
                format!(", {:.1}% of read", self.waste_ratio() * 100.0),
            )
        };
        format!(
            "{} chunks read ({} bytes) in {} reads{hit_rate}, stall {:.3} s, \
             {} demand fetches, {} prefetched ({} bytes), {} wasted ({} bytes{waste}), \
             {} files warmed ({} bytes)",
            self.chunks_read,
            self.chunk_bytes_read,
            self.reads,
            self.stall_seconds,
            self.demand_fetches,
            self.prefetched_chunks,
            self.prefetched_bytes,
            self.wasted_chunks,
            self.wasted_bytes,
            self.warmed_files,
            self.warmed_bytes,
        )
    }

    /// The report in Prometheus text format, labelled with the tree and run.
    pub fn prometheus(&self) -> String {
        let labels = format!(
            "tree=\"{}\",run=\"{}\"",
            escape(&self.tree),
            escape(&self.run)
        );
        let mut out = String::new();
        let mut put = |name: &str, kind: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        };
        for (name, kind, help, v) in [
            (
                metrics::READS_TOTAL,
                "counter",
                "Read calls served by the image mount.",
                self.reads as f64,
            ),
            (
                metrics::READ_BYTES_TOTAL,
                "counter",
                "Bytes returned by reads.",
                self.bytes_read as f64,
            ),
            (
                metrics::CHUNKS_READ_TOTAL,
                "counter",
                "Distinct chunks read.",
                self.chunks_read as f64,
            ),
            (
                metrics::CHUNK_BYTES_READ_TOTAL,
                "counter",
                "Plaintext bytes of the distinct chunks read.",
                self.chunk_bytes_read as f64,
            ),
            (
                metrics::HITS_TOTAL,
                "counter",
                "Distinct chunks that were local when first read.",
                self.hits as f64,
            ),
            (
                metrics::HIT_RATIO,
                "gauge",
                "Hits over distinct chunks read.",
                self.hit_rate,
            ),
            (
                metrics::STALL_SECONDS_TOTAL,
                "counter",
                "Time reads waited for chunks from the store.",
                self.stall_seconds,
            ),
            (
                metrics::DEMAND_FETCHES_TOTAL,
                "counter",
                "Chunks reads fetched from the store themselves.",
                self.demand_fetches as f64,
            ),
            (
                metrics::PREFETCHED_CHUNKS_TOTAL,
                "counter",
                "Chunks the prefetcher fetched.",
                self.prefetched_chunks as f64,
            ),
            (
                metrics::PREFETCHED_BYTES_TOTAL,
                "counter",
                "Plaintext bytes the prefetcher fetched.",
                self.prefetched_bytes as f64,
            ),
            (
                metrics::WASTED_BYTES_TOTAL,
                "counter",
                "Prefetched bytes never read.",
                self.wasted_bytes as f64,
            ),
            (
                metrics::WARMED_FILES_TOTAL,
                "counter",
                "Files whose prefetched pages were stored in the kernel's page cache.",
                self.warmed_files as f64,
            ),
            (
                metrics::WARMED_BYTES_TOTAL,
                "counter",
                "Bytes of pages stored in the kernel's page cache ahead of reads.",
                self.warmed_bytes as f64,
            ),
            (
                metrics::PREFETCH_WINDOW,
                "gauge",
                "Prefetch fetches allowed in flight.",
                self.final_window as f64,
            ),
        ] {
            put(name, kind, help, v);
        }
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
