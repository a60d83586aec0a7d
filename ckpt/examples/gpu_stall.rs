//! GPU training stall: `save()` → `wait_staged()` of device tensors against the floor, a raw
//! `cuMemcpyDtoHAsync` of the same bytes into pre-registered pinned memory on one stream.
//!
//! Allocates `--gib` GiB on device 0 as `--tensors` tensors, fills them with a pattern, then for
//! `--runs` runs times both, prints the medians and their ratio, and checks that the saved bytes
//! (loaded back and verified) equal the device bytes. See `benches/gpu/README.md`.
//!
//! ```sh
//! cargo run --release -p hotstart-ckpt --features cuda --example gpu_stall -- --gib 4
//! ```

use std::ffi::c_void;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};
use hotstart_ckpt::{Destination, Dtype, Engine, EngineConfig, Extras, StepSel, Tensor, cuda};

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

fn arg(name: &str, default: usize) -> BoxResult<usize> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args.get(i + 1).ok_or("missing value")?.parse()?),
        None => Ok(default),
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> BoxResult<()> {
    let gib = arg("--gib", 4)?;
    let count = arg("--tensors", 16)?.max(1);
    let runs = arg("--runs", 5)?.max(1);
    let devices = match cuda::available() {
        Ok(n) => n,
        Err(e) => {
            println!("skipping: {e}");
            std::process::exit(2);
        }
    };
    let total = gib << 30;
    let per = total / count;
    let total = per * count;
    println!("{devices} CUDA device(s); {count} tensors of {per} bytes on device 0, {runs} runs");

    // Device 0's primary context, current on this thread for the raw calls below.
    let _ctx = cudarc::driver::CudaContext::new(0)?;
    let mut ptrs = Vec::with_capacity(count);
    let chunk = 64 << 20;
    for i in 0..count {
        // SAFETY: a fresh allocation of `per` bytes in the current (primary) context.
        let p = unsafe { result::malloc_sync(per.max(1)) }?;
        let fill = hotstart_testkit::pattern(chunk.min(per), i as u64 + 1);
        let mut at = 0;
        while at < per {
            let n = fill.len().min(per - at);
            // SAFETY: `p + at .. p + at + n` lies inside the allocation above.
            unsafe { result::memcpy_htod_sync(p + at as u64, &fill[..n]) }?;
            at += n;
        }
        ptrs.push(p);
    }
    let tensors: Vec<Tensor> = ptrs
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            // SAFETY: `p` holds `per` bytes on device 0, freed only at the end of `main`, after
            // every save has finished staging.
            unsafe { Tensor::from_device(format!("t{i}"), Dtype::U8, vec![per as u64], 0, p, per) }
        })
        .collect::<Result<_, _>>()?;

    let dir = tempfile::tempdir()?;
    let mut cfg = EngineConfig::new("gpu-stall", 0, 1).disk(dir.path());
    cfg.max_inflight = 1;
    cfg.keep = 1;
    let engine = Engine::new(cfg)?;
    // Warm-up: allocates the staging buffer and registers it as pinned memory.
    engine.save(0, tensors.clone(), Extras::new())?.wait()?;
    let mut staged = Vec::with_capacity(runs);
    for step in 1..=runs as u64 {
        let t0 = Instant::now();
        let h = engine.save(step, tensors.clone(), Extras::new())?;
        h.wait_staged()?;
        staged.push(t0.elapsed());
        h.wait()?; // persistence is outside the stall
    }

    // The floor: one stream, pinned memory registered ahead, the same bytes.
    // SAFETY: a fresh pinned allocation of `total` bytes, freed below.
    let host = unsafe { result::malloc_host(total.max(1), 0) }?.cast::<u8>();
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking)?;
    let mut raw = Vec::with_capacity(runs);
    for _ in 0..=runs {
        let t0 = Instant::now();
        for (i, &p) in ptrs.iter().enumerate() {
            // SAFETY: `host + i * per` has `per` bytes of the pinned allocation; `p` has `per`
            // device bytes; the stream is synchronized before either is used again.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(host.add(i * per).cast::<c_void>(), p, per, stream)
                    .result()?;
            }
        }
        // SAFETY: `stream` is live.
        unsafe { result::stream::synchronize(stream) }?;
        raw.push(t0.elapsed());
    }
    raw.remove(0); // the first run warms up the copy path

    // The saved bytes, loaded back (checksums verified) against the device bytes.
    let loaded = engine.load(StepSel::Latest, Destination::Owned)?;
    // SAFETY: `host` holds `total` initialized bytes (the raw copies above finished).
    let device_bytes = unsafe { std::slice::from_raw_parts(host, total) };
    for (i, t) in loaded.tensors.iter().enumerate() {
        if t.data[..] != device_bytes[i * per..(i + 1) * per] {
            return Err(format!("tensor {i}: saved bytes differ from the device bytes").into());
        }
    }
    println!(
        "bytes check: {} tensors saved equal the device bytes",
        loaded.tensors.len()
    );

    let (s, r) = (median(staged), median(raw));
    let gibs = |d: Duration| total as f64 / d.as_secs_f64() / (1u64 << 30) as f64;
    println!("| what | median | GiB/s |");
    println!("|---|---|---|");
    println!(
        "| hotstart save() -> wait_staged() | {s:.3?} | {:.2} |",
        gibs(s)
    );
    println!(
        "| raw pinned cuMemcpyDtoHAsync, one stream | {r:.3?} | {:.2} |",
        gibs(r)
    );
    println!(
        "ratio (stall / raw): {:.3}",
        s.as_secs_f64() / r.as_secs_f64()
    );

    drop(engine);
    // SAFETY: every copy has finished and nothing uses these allocations any more.
    unsafe {
        result::stream::destroy(stream)?;
        result::free_host(host.cast())?;
        for p in ptrs {
            result::free_sync(p)?;
        }
    }
    Ok(())
}
