//! hotstart-fuse: a striped FUSE filesystem that mounts an object store as a directory.
//!
//! This crate will own the filesystem logic as a plain type (lookup, read, write, rename, ...)
//! tested without FUSE, and a thin multi-threaded `fuser` adapter. Large files are read with a
//! growing read-ahead window of parallel stripe reads and written as parallel multipart uploads,
//! both through `hotstart-store`'s striped reader and writer.
