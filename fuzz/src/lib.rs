//! What every fuzz target shares: an allocator that refuses any single allocation above the
//! target's stated bound (so "allocates without limit" is a crash, like a panic), a stream that
//! replays the fuzzer's bytes as a peer or a training process would send them, and a scratch
//! directory in memory for targets whose parser reads files.
//!
//! The targets are in `fuzz_targets/`; `scripts/fuzz.sh` builds and runs them, and
//! docs/SECURITY.md lists them with their bounds and the campaign's figures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The allocation bound a target runs with unless it sets its own: what a parser of small
/// inputs may need, with room.
pub const DEFAULT_BOUND: usize = 64 << 20;

static BOUND: AtomicUsize = AtomicUsize::new(DEFAULT_BOUND);

/// Sets the largest single allocation the target may make (its parser's documented bound).
pub fn set_bound(bytes: usize) {
    BOUND.store(bytes, Ordering::Relaxed);
}

struct Bounded;

fn check(size: usize) {
    if size > BOUND.load(Ordering::Relaxed) {
        // No formatting here: this runs inside the allocator.
        let msg = b"hotstart-fuzz: an allocation exceeds the target's bound\n";
        // SAFETY: writes a static buffer to stderr.
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
        std::process::abort();
    }
}

// SAFETY: forwards to the system allocator after the size check.
unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Bounded = Bounded;

/// A connection whose other end sends `data` and then hangs up; what this end writes is
/// dropped.
pub struct Replay<'a>(pub &'a [u8]);

impl Read for Replay<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Replay<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Splits the input into a selector byte and the rest (0 for an empty input).
pub fn split(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((&b, rest)) => (b, rest),
        None => (0, data),
    }
}

/// A directory of this process's own under /dev/shm (memory, so a target that reads files
/// stays fast), created on first use.
pub fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(format!(
        "/dev/shm/hotstart-fuzz-{}-{name}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("create the scratch directory under /dev/shm");
    dir
}
