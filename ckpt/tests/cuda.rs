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

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use cudarc::driver::{CudaContext, result};

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
}
