//! hotstart-prefetch: lazy images with hot-block record and replay.
//!
//! This crate will own image building (from a directory, a layer tarball or an OCI layout) into
//! `hotstart-store`'s chunk store and tree manifests, the lazy read-only mount, the recording of
//! which chunks a job reads while it starts, and the prefetcher that replays that profile ahead of
//! the job on the next start.
