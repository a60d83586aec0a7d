//! CUDA device tensors. Everywhere: a device tensor is refused with a clear `Error::Cuda` (no
//! `cuda` feature, or no driver), nothing panics, and host saves keep working. On a machine with
//! a driver and a `--features cuda` build: device tensors round-trip bit-exact through save and
//! load, into host memory and back into device memory.

mod common;

use std::collections::HashMap;

use common::*;
use hotstart_ckpt::{
    Destination, DeviceBuffer, Dtype, Error, Extras, StepSel, Tensor, TierKind, cuda,
};

#[test]
fn device_tensors_without_driver_are_a_clear_error() {
    if let Ok(n) = cuda::available() {
        println!(
            "a CUDA driver with {n} device(s) is present: the no-driver path is tested on \
             machines without one; checking a device that does not exist instead"
        );
        let dir = tempfile::tempdir().unwrap();
        let engine = engine(config("nodev").disk(dir.path()));
        // SAFETY: never read: the save is refused because device `n` does not exist.
        let t = unsafe { Tensor::from_device("w", Dtype::F32, vec![4], n, 0x1000, 16) }.unwrap();
        let err = engine.save(1, vec![t], Extras::new()).unwrap_err();
        assert!(matches!(err, Error::Cuda { .. }), "{err}");
        assert!(err.to_string().contains("no CUDA device"), "{err}");
        return;
    }
    let err = cuda::available().unwrap_err();
    let expect = if cuda::ENABLED {
        "driver"
    } else {
        "--features cuda"
    };
    assert!(matches!(err, Error::Cuda { .. }), "{err}");
    assert!(err.to_string().contains(expect), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let engine = engine(config("nodriver").disk(dir.path()));
    let host = Tensor::new("bias", Dtype::U8, vec![3], vec![1u8, 2, 3]).unwrap();
    // SAFETY: the address is never dereferenced: without a driver (or without the `cuda`
    // feature) `save` refuses device tensors before reading anything.
    let dev = unsafe { Tensor::from_device("weight", Dtype::F32, vec![4], 0, 0x1000, 16) }.unwrap();
    assert_eq!(dev.device(), Some(0));
    for _ in 0..2 {
        let err = engine
            .save(1, vec![host.clone(), dev.clone()], Extras::new())
            .unwrap_err();
        assert!(matches!(err, Error::Cuda { .. }), "{err}");
        assert!(err.to_string().contains(expect), "{err}");
    }
    engine.wait_idle();
    assert!(engine.complete_steps(TierKind::Disk).unwrap().is_empty());

    // Host tensors still save and load as always.
    engine
        .save(2, vec![host.clone()], Extras::new())
        .unwrap()
        .wait()
        .unwrap();
    let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_eq!(l.step, 2);
    assert_eq!(&l.tensors[0].data[..], &[1, 2, 3]);

    // Loading into device memory is refused the same way, before anything is read.
    let mut dst = HashMap::new();
    // SAFETY: never written: the load is refused before reading.
    dst.insert("bias".to_string(), unsafe {
        DeviceBuffer::new(0, 0x1000, 3)
    });
    let err = engine
        .load(StepSel::Latest, Destination::Device(dst))
        .unwrap_err();
    assert!(matches!(err, Error::Cuda { .. }), "{err}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_roundtrip() {
    println!(
        "skipping: built without the `cuda` feature (run `cargo test --features cuda` on a GPU machine)"
    );
}

#[cfg(feature = "cuda")]
#[test]
fn gpu_roundtrip() {
    if cuda::available().is_err() {
        println!("skipping: no CUDA driver (needs a GPU machine)");
        return;
    }
    gpu::roundtrip();
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_sidecar_copies_into_another_process() {
    println!(
        "skipping: built without the `cuda` feature (run `cargo test --features cuda` on a GPU machine)"
    );
}

/// What a sidecar does for a restarted process: seals a committed segment, pins it read-only
/// (`cuda::pin_read_only`), and copies ranges of it into device memory that another process
/// shares with CUDA IPC handles (`cuda::copy_to_shared`). The other process is this test binary
/// again (`HOTSTART_IPC_CHILD`), which allocates, exports, and checks its memory afterwards.
#[cfg(feature = "cuda")]
#[test]
fn gpu_sidecar_copies_into_another_process() {
    if std::env::var_os(gpu::IPC_CHILD).is_some() {
        return gpu::ipc_child();
    }
    if cuda::available().is_err() {
        println!("skipping: no CUDA driver (needs a GPU machine)");
        return;
    }
    gpu::ipc_parent();
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use cudarc::driver::{CudaContext, result, sys};
    use std::io::{BufRead, Write};

    /// Device memory holding `bytes`, freed on drop.
    struct DevMem {
        ptr: u64,
        len: usize,
    }

    impl DevMem {
        fn with(bytes: &[u8]) -> DevMem {
            // SAFETY: the test thread's current context is device 0's primary context (made
            // current in `roundtrip`); `malloc_sync` returns a fresh allocation of `len` bytes
            // (at least 1 so the pointer is real), and the copy writes exactly `bytes.len()`.
            unsafe {
                let ptr = result::malloc_sync(bytes.len().max(1)).unwrap();
                result::memcpy_htod_sync(ptr, bytes).unwrap();
                DevMem {
                    ptr,
                    len: bytes.len(),
                }
            }
        }

        fn read(&self) -> Vec<u8> {
            let mut out = vec![0u8; self.len];
            // SAFETY: `ptr` holds `len` bytes of device memory owned by this value.
            unsafe { result::memcpy_dtoh_sync(&mut out, self.ptr).unwrap() };
            out
        }
    }

    impl Drop for DevMem {
        fn drop(&mut self) {
            // SAFETY: allocated by `malloc_sync` in `with` and freed only here.
            unsafe { result::free_sync(self.ptr).unwrap() };
        }
    }

    pub(super) fn roundtrip() {
        let _ctx = CudaContext::new(0).expect("device 0");
        let dir = tempfile::tempdir().unwrap();
        let engine = engine(config("gpu").disk(dir.path()));
        let set = sample_tensors(7, 3 << 20);
        // Odd tensors on the device, even ones on the host, so both paths fill one file.
        let dev: Vec<Option<DevMem>> = set
            .iter()
            .enumerate()
            .map(|(i, (_, _, _, b))| (i % 2 == 1).then(|| DevMem::with(b)))
            .collect();
        let tensors: Vec<Tensor> = set
            .iter()
            .zip(&dev)
            .map(|((n, d, s, b), m)| match m {
                Some(m) => {
                    // SAFETY: `m` holds exactly these bytes on device 0 and outlives the save's
                    // staging (waited for below).
                    let t =
                        unsafe { Tensor::from_device(n.clone(), *d, s.clone(), 0, m.ptr, m.len) };
                    t.unwrap()
                }
                None => Tensor::new(n.clone(), *d, s.clone(), b.clone()).unwrap(),
            })
            .collect();
        for step in [1, 2] {
            // The second save reuses the pinned staging buffer.
            let h = engine.save(step, tensors.clone(), extras(step)).unwrap();
            h.wait_staged().unwrap();
            h.wait().unwrap();
            let l = engine
                .load(StepSel::Step(step), Destination::Owned)
                .unwrap();
            assert_loaded(&l, &set, &extras(step));
        }

        // Back into fresh device buffers.
        let outs: Vec<DevMem> = set
            .iter()
            .map(|(_, _, _, b)| DevMem::with(&vec![0u8; b.len()]))
            .collect();
        let dst: HashMap<String, DeviceBuffer> = set
            .iter()
            .zip(&outs)
            // SAFETY: each buffer has the tensor's length and is only used after `load`.
            .map(|((n, ..), m)| (n.clone(), unsafe { DeviceBuffer::new(0, m.ptr, m.len) }))
            .collect();
        let l = engine
            .load(StepSel::Latest, Destination::Device(dst))
            .unwrap();
        assert!(l.tensors.is_empty());
        for ((n, _, _, b), m) in set.iter().zip(&outs) {
            assert!(m.read() == *b, "device bytes of {n} differ after load");
        }
        println!("GPU round trip of {} tensors: bit-exact", set.len());
        large_with_fallback();
    }

    /// A load into device buffers that spans many bounce windows and chunks (a 40 MiB tensor,
    /// 16 MiB chunks), with one chunk damaged on disk: that chunk comes from the store and
    /// rewrites what the bad copy had already sent to the device; tensors without a device
    /// buffer come back owned.
    fn large_with_fallback() {
        let disk = tempfile::tempdir().unwrap();
        let store_dir = tempfile::tempdir().unwrap();
        let store = hotstart_store::Store::open(store_dir.path().to_str().unwrap()).unwrap();
        let mut cfg = config("gpu-large").disk(disk.path()).store(store);
        cfg.chunk_size = 16 << 20;
        let engine = engine(cfg);
        let set = sample_tensors(11, 40 << 20);
        engine
            .save(3, to_tensors(&set), extras(3))
            .unwrap()
            .wait()
            .unwrap();
        let file = disk.path().join("gpu-large/step-3/rank-0.safetensors");
        let mut bytes = std::fs::read(&file).unwrap();
        bytes[(16 << 20) + 12345] ^= 0x40;
        std::fs::write(&file, bytes).unwrap();

        let on_device: Vec<Option<DevMem>> = set
            .iter()
            .enumerate()
            .map(|(i, (n, _, _, b))| {
                (n == "big" || i % 3 == 0).then(|| DevMem::with(&vec![0u8; b.len()]))
            })
            .collect();
        let dst: HashMap<String, DeviceBuffer> = set
            .iter()
            .zip(&on_device)
            .filter_map(|((n, ..), m)| {
                // SAFETY: each buffer has the tensor's length and is only used after `load`.
                m.as_ref()
                    .map(|m| (n.clone(), unsafe { DeviceBuffer::new(0, m.ptr, m.len) }))
            })
            .collect();
        let l = engine
            .load(StepSel::Latest, Destination::Device(dst))
            .unwrap();
        assert_eq!(l.chunk_sources[1], TierKind::Store);
        assert_eq!(l.chunk_sources[0], TierKind::Disk);
        let mut owned = l.tensors.iter();
        for ((n, _, _, b), m) in set.iter().zip(&on_device) {
            match m {
                Some(m) => assert!(m.read() == *b, "device bytes of {n} differ after load"),
                None => {
                    let t = owned.next().expect("a host tensor");
                    assert_eq!(&t.name, n);
                    assert!(t.data[..] == b[..], "bytes of {n} differ");
                }
            }
        }
        assert!(owned.next().is_none());
        println!("GPU load of 40 MiB across chunks with a damaged disk chunk: bit-exact");
    }

    /// Set in the child process of `gpu_sidecar_copies_into_another_process`.
    pub(super) const IPC_CHILD: &str = "HOTSTART_IPC_CHILD";
    /// The child's two allocations; the middle of the second is copied into.
    const A_LEN: usize = (3 << 20) + 5;
    const B_LEN: usize = 1 << 20;
    const B_AT: usize = 4096;
    const B_PART: usize = 512 << 10;

    /// Byte `i` of the segment.
    fn pattern(i: usize) -> u8 {
        (i.wrapping_mul(131).wrapping_add(7) % 251) as u8
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn unhex<const N: usize>(s: &str) -> [u8; N] {
        let mut out = [0u8; N];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
        }
        out
    }

    /// The training process's side: two zeroed allocations on device 0, exported; once told,
    /// checks that exactly the copied ranges hold the segment's bytes.
    pub(super) fn ipc_child() {
        let _ctx = CudaContext::new(0).expect("device 0");
        let a = DevMem::with(&vec![0u8; A_LEN]);
        let b = DevMem::with(&vec![0u8; B_LEN]);
        let uuid = result::device::get_uuid(result::device::get(0).unwrap()).unwrap();
        let export = |ptr: u64| {
            let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
            // SAFETY: `h` is a valid place for the handle; `ptr` starts an allocation made by
            // `malloc_sync` in this context.
            unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), ptr) }
                .result()
                .unwrap();
            // SAFETY: zeroed, then written by the driver.
            hex(&unsafe { h.assume_init() }.reserved.map(|c| c as u8))
        };
        println!(
            "IPC {} {} {}",
            hex(&uuid.bytes.map(|c| c as u8)),
            export(a.ptr),
            export(b.ptr)
        );
        std::io::stdout().flush().unwrap();
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "copied");
        let want_a: Vec<u8> = (0..A_LEN).map(pattern).collect();
        let mut want_b = vec![0u8; B_LEN];
        for (i, x) in want_b[B_AT..B_AT + B_PART].iter_mut().enumerate() {
            *x = pattern(A_LEN + i);
        }
        assert!(a.read() == want_a, "the first allocation differs");
        assert!(
            b.read() == want_b,
            "the second allocation differs (only its middle was copied)"
        );
        println!("IPC-CHILD bit-exact");
    }

    /// The sidecar's side.
    pub(super) fn ipc_parent() {
        use hotstart_proto::shm::Segment;
        use hotstart_proto::wire::DeviceCopy;
        use std::process::{Command, Stdio};

        let len = A_LEN + B_PART;
        let seg = Segment::create("ipc-test", len, None).unwrap();
        {
            let map = seg.map_writable().unwrap();
            // SAFETY: the mapping holds `len` bytes and nothing else uses it.
            let w = unsafe { std::slice::from_raw_parts_mut(map.as_ptr(), len) };
            for (i, x) in w.iter_mut().enumerate() {
                *x = pattern(i);
            }
        }
        let committed = seg.commit().unwrap();
        // Sealed before it is pinned, as the sidecar does (the kernel refuses to seal pinned
        // pages); the seal holds while it is pinned.
        committed.seal().unwrap();
        let bytes = &committed.bytes()[..len];
        // SAFETY: `committed` outlives the registration (dropped at the end of this function,
        // after every copy is done).
        let pin = unsafe { cuda::pin_read_only(bytes.as_ptr(), bytes.len()) }
            .expect("pin a sealed, read-only segment");
        committed.seal().unwrap();

        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args([
                "gpu_sidecar_copies_into_another_process",
                "--exact",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(IPC_CHILD, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        // The harness prints "test <name> ... " before the test's own output, on the same line.
        let mut line = String::new();
        let handles = loop {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "the child exited before exporting its memory"
            );
            if let Some(at) = line.find("IPC ") {
                break line[at..].to_owned();
            }
        };
        let f: Vec<&str> = handles.split_whitespace().collect();
        let (uuid, a, b) = (unhex::<16>(f[1]), unhex::<64>(f[2]), unhex::<64>(f[3]));
        // A's copies on both sides of B's, so A's handle stays open past B's and closes after
        // its last copy.
        let half = A_LEN / 2;
        let good = [
            DeviceCopy::new(0, half as u64, &uuid, &a, 0),
            DeviceCopy::new(A_LEN as u64, B_PART as u64, &uuid, &b, B_AT as u64),
            DeviceCopy::new(half as u64, (A_LEN - half) as u64, &uuid, &a, half as u64),
        ];

        // Refused before anything is opened: a range outside the segment, a device not here.
        let mut outside = good.to_vec();
        outside.push(DeviceCopy::new(len as u64 - 1, 2, &uuid, &b, 0));
        let err = cuda::copy_to_shared(bytes, &outside).unwrap_err();
        assert!(
            err.to_string().contains(&format!("outside {len} bytes")),
            "{err}"
        );
        let err =
            cuda::copy_to_shared(bytes, &[DeviceCopy::new(0, 1, &[0xee; 16], &a, 0)]).unwrap_err();
        assert!(err.to_string().contains("no device with UUID"), "{err}");
        // Refused where it is met, after the copies before it (into the child's own memory,
        // which the good copy below fills again): a copy past its allocation.
        let mut past = good.to_vec();
        past.push(DeviceCopy::new(0, 8192, &uuid, &b, 1 << 40));
        let err = cuda::copy_to_shared(bytes, &past).unwrap_err();
        assert!(err.to_string().contains("outside its"), "{err}");

        let t = std::time::Instant::now();
        let copied = cuda::copy_to_shared(bytes, &good).expect("copy into shared device memory");
        let took = t.elapsed();
        assert_eq!(copied.bytes, len as u64);
        assert_eq!(copied.handles, 2, "one handle opened per allocation");
        child.stdin.take().unwrap().write_all(b"copied\n").unwrap();
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
        let status = child.wait().unwrap();
        assert!(
            status.success() && rest.contains("IPC-CHILD bit-exact"),
            "{rest}"
        );
        drop(pin);
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        println!(
            "sidecar route: sealed, pinned read-only, {len} bytes copied into another process's \
             device memory in {:.3} ms (opening 2 handles {:.3} ms, copying {:.3} ms, closing \
             {:.3} ms): bit-exact",
            ms(took),
            ms(copied.open),
            ms(copied.copy),
            ms(copied.close)
        );
    }
}
