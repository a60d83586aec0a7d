//! A stand-in training process for crash tests, which `kill -9` it at chosen moments.
//!
//! `ckpt-test-trainer DISK_DIR STORE_DIR JOB BIG_MIB`: step 1 holds 1 MiB and is waited for
//! until persisted everywhere ("persisted 1"). Step 2 holds `BIG_MIB` MiB; the trainer prints
//! "staged 2" once staging is done and then waits for the persist, which the store tier makes
//! slow (a throttled local-directory store), so a kill after "staged 2" lands mid-persist.
//!
//! Tensor bytes are one tensor `w` of `pattern(len, step)`, which tests recompute.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use hotstart_ckpt::{Dtype, Engine, EngineConfig, Tensor};
use hotstart_store::Store;
use hotstart_store::wrap::{Interceptor, Throttle, ThrottleConfig};

/// Deterministic pseudo-random bytes (xorshift64*), distinct per seed; tests use the same.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

const USAGE: &str = "usage: ckpt-test-trainer DISK_DIR STORE_DIR JOB BIG_MIB";

fn tensor(len: usize, step: u64) -> Result<Tensor, String> {
    Tensor::new("w", Dtype::U8, vec![len as u64], pattern(len, step)).map_err(|e| e.to_string())
}

fn run(args: &[String]) -> Result<(), String> {
    let [disk, store_dir, job, big_mib] = args else {
        return Err(USAGE.into());
    };
    let big: usize = big_mib.parse::<usize>().map_err(|e| e.to_string())? << 20;
    let throttle = Arc::new(Throttle::new(ThrottleConfig {
        latency: Duration::from_millis(200),
        per_request_bytes_per_sec: None,
        total_bytes_per_sec: Some(8 << 20),
    }));
    let store = Store::open(store_dir)
        .map_err(|e| e.to_string())?
        .wrap(|inner| throttle.clone().wrap(inner));
    let mut cfg = EngineConfig::new(job.clone(), 0, 1).disk(disk).store(store);
    cfg.chunk_size = 1 << 20;
    let engine = Engine::new(cfg).map_err(|e| e.to_string())?;
    let mut out = std::io::stdout();
    for (step, len) in [(1u64, 1usize << 20), (2, big)] {
        let h = engine
            .save(step, vec![tensor(len, step)?], Default::default())
            .map_err(|e| e.to_string())?;
        h.wait_staged().map_err(|e| e.to_string())?;
        let _ = writeln!(out, "staged {step}");
        let _ = out.flush();
        h.wait().map_err(|e| e.to_string())?;
        let _ = writeln!(out, "persisted {step}");
        let _ = out.flush();
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ckpt-test-trainer: {e}");
            ExitCode::FAILURE
        }
    }
}
