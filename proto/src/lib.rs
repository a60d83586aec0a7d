//! hotstart-proto: what a training process and the node's sidecar (`hotstart serve`, the
//! `hotstart-sidecar` crate) both speak: the framed, versioned messages of the Unix socket and the peer links
//! ([`wire`]), and the shared memory a checkpoint is staged into, with its file descriptors
//! passed over the socket ([`shm`]). The engine's client of the sidecar (`hotstart-ckpt`'s `client`
//! module) and the daemon both build on these, and this crate depends on neither; the messages
//! sidecars exchange with each other are the daemon's own. [`memcopy`] has the copy that both
//! use to read shared memory out.

mod kind;
pub mod memcopy;
pub mod share;
pub mod shm;
pub mod wire;

pub use kind::TierKind;

/// Version of the local socket's protocol, checked in `Attach` (2: `Filled`).
pub const PROTOCOL_VERSION: u32 = 2;

/// Gives the calling thread (and the threads it starts from now on) a lower CPU priority
/// (nice 10): for work nobody waits for yet (committing a save whose training process went
/// away, out of the way of that process's restart). Busy threads of normal priority keep
/// about nine tenths of the cores' time from it. Not for the next save's segment: on a node
/// whose cores training keeps busy, a save came before its segment was ready and waited for
/// the rest (the demo's steady-state stall was 1.4 s against a 0.16 s copy; at training's
/// priority it is the copy).
pub fn background_priority() {
    // SAFETY: setpriority on this thread alone (its id); no memory is involved. A failure
    // leaves the priority as it was, which is only slower for others.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10);
    }
}
