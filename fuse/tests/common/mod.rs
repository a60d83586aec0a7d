//! Helpers shared by the filesystem's integration tests.

use hotstart_fuse::FsConfig;

/// Small stripes and windows, so a few hundred KiB exercise multipart uploads and read-ahead.
pub fn small_config() -> FsConfig {
    FsConfig {
        stripe_size: 64 << 10,
        max_in_flight: 4,
        initial_read_ahead: 16 << 10,
        max_read_ahead: 128 << 10,
        memory_budget: 8 << 20,
        ..FsConfig::default()
    }
}
