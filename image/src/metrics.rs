//! Metric names of lazy image mounts (listed in docs/METRICS.md). Every one is labelled with
//! `tree` (the image `name:tag`) and `run` (the mount's run id).

/// Read calls served (counter).
pub const READS_TOTAL: &str = "hotstart_image_reads_total";
/// Bytes returned by reads (counter).
pub const READ_BYTES_TOTAL: &str = "hotstart_image_read_bytes_total";
/// Distinct chunks read (counter).
pub const CHUNKS_READ_TOTAL: &str = "hotstart_image_chunks_read_total";
/// Plaintext bytes of the distinct chunks read (counter).
pub const CHUNK_BYTES_READ_TOTAL: &str = "hotstart_image_chunk_bytes_read_total";
/// Distinct chunks that were local when first read (counter).
pub const HITS_TOTAL: &str = "hotstart_image_hits_total";
/// Hits over distinct chunks read (gauge, 0 to 1).
pub const HIT_RATIO: &str = "hotstart_image_hit_ratio";
/// Time reads waited for chunks from the store (counter, seconds).
pub const STALL_SECONDS_TOTAL: &str = "hotstart_image_stall_seconds_total";
/// Chunks reads had to fetch themselves (counter).
pub const DEMAND_FETCHES_TOTAL: &str = "hotstart_image_demand_fetches_total";
/// Chunks the prefetcher fetched (counter).
pub const PREFETCHED_CHUNKS_TOTAL: &str = "hotstart_image_prefetched_chunks_total";
/// Plaintext bytes the prefetcher fetched (counter).
pub const PREFETCHED_BYTES_TOTAL: &str = "hotstart_image_prefetched_bytes_total";
/// Prefetched bytes never read (counter).
pub const WASTED_BYTES_TOTAL: &str = "hotstart_image_wasted_bytes_total";
/// Files whose prefetched pages were stored in the kernel's page cache ahead of the job
/// (counter).
pub const WARMED_FILES_TOTAL: &str = "hotstart_image_warmed_files_total";
/// Bytes of those pages (counter).
pub const WARMED_BYTES_TOTAL: &str = "hotstart_image_warmed_bytes_total";
/// Prefetch fetches allowed in flight (gauge).
pub const PREFETCH_WINDOW: &str = "hotstart_image_prefetch_window";
