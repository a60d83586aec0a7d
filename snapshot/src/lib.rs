//! hotstart-snapshot: dependency snapshots.
//!
//! This crate will own the snapshot key (lock files, interpreter, platform, install command and
//! target), capture of an installed environment as a tree of content-addressed chunks, and its
//! atomic restore, eager or lazily mounted through the image format of `hotstart-prefetch`.
