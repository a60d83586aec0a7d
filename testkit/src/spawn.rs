//! Spawning child processes that die with this process, even when it is SIGKILLed.
//!
//! Every child is spawned with `prctl(PR_SET_PDEATHSIG, SIGKILL)`. The kernel sends that signal
//! when the child's parent *thread* exits, not the parent process, so a child spawned from a
//! short-lived test thread would be killed as soon as that test returned. All spawns therefore
//! go through one dedicated thread that lives as long as the process: the child dies exactly
//! when the process does. After setting the signal the child checks `getppid()`, closing the
//! race where the parent died before `prctl` ran.
//!
//! A child may also be moved into a named network namespace (`ip netns add NAME`, i.e.
//! `/var/run/netns/NAME`) with `setns` before `exec`, the way `ip netns exec` does it.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::thread;

type Job = Box<dyn FnOnce() -> io::Result<Child> + Send>;

struct Request {
    job: Job,
    reply: mpsc::Sender<io::Result<Child>>,
}

/// The channel to the spawner thread; the thread is started on first use and never exits.
fn spawner() -> io::Result<&'static mpsc::Sender<Request>> {
    static SPAWNER: OnceLock<io::Result<mpsc::Sender<Request>>> = OnceLock::new();
    SPAWNER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Request>();
            thread::Builder::new()
                .name("testkit-spawner".into())
                .spawn(move || {
                    for req in rx.iter() {
                        // The requester may have gone; nothing to do then.
                        let _ = req.reply.send((req.job)());
                    }
                    // Unreachable while the static sender lives; never return regardless, since
                    // returning would SIGKILL every child this thread spawned.
                    loop {
                        thread::park();
                    }
                })
                .map(|_| tx)
        })
        .as_ref()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot start the spawner thread: {e}")))
}

/// Spawns `cmd` so that it is SIGKILLed when this process exits for any reason; with `netns`,
/// inside that network namespace.
pub fn spawn_tied(mut cmd: Command, netns: Option<&str>) -> io::Result<Child> {
    let ns_file = netns
        .map(|name| {
            let path = format!("/var/run/netns/{name}");
            File::open(&path).map_err(|e| {
                io::Error::new(e.kind(), format!("network namespace {name} ({path}): {e}"))
            })
        })
        .transpose()?;
    let ns_fd = ns_file.as_ref().map(|f| f.as_raw_fd());
    let parent = libc::pid_t::try_from(std::process::id())
        .map_err(|_| io::Error::other("process id does not fit pid_t"))?;
    // SAFETY: the closure runs in the forked child before exec and only makes async-signal-safe
    // system calls (prctl, getppid, setns) on plain integers; it allocates nothing and takes no
    // locks. `ns_fd` stays open until the spawn returns because the job below owns `ns_file`.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(io::Error::other("parent exited before the child started"));
            }
            if let Some(fd) = ns_fd
                && libc::setns(fd, libc::CLONE_NEWNET) != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let (reply, result) = mpsc::channel();
    let job: Job = Box::new(move || {
        let child = cmd.spawn();
        drop(ns_file);
        child
    });
    spawner()?
        .send(Request { job, reply })
        .map_err(|_| io::Error::other("the spawner thread is gone"))?;
    result
        .recv()
        .map_err(|_| io::Error::other("the spawner thread dropped the request"))?
}

/// Stops `child`: SIGTERM, up to `grace` for it to exit, then SIGKILL; reaped either way.
pub fn terminate(child: &mut Child, grace: std::time::Duration) {
    // SAFETY: kill(2) of a child this caller owns and has not reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = std::time::Instant::now() + grace;
    while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
        thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Runs `cmd` to completion and returns its stdout; panics with both outputs when it fails.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run the command");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
