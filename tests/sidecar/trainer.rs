//! The stand-in training process: saves steps of deterministic tensors through the sidecar
//! named by `HOTSTART_SOCKET`, or restores the newest step and checks every byte.
//!
//! ```text
//! sidecar trainer save    --job J --rank R --world W --mib M --steps N [--first S] [--wait memory|all] [--hold] [--replica]
//! sidecar trainer restore --job J --rank R --world W --mib M [--step S] [--replica]
//! ```
//!
//! `--replica`: every rank's tensors are rank 0's (the replicas of a data-parallel job).
//!
//! `save` prints `saved <step>` once each step reached the tiers waited for, then `done`, and
//! with `--hold` stays alive until killed. `restore` loads into its own buffers (and one tensor
//! returned owned), compares them with the expected bytes of the step it got, and prints
//! `restored <step> <source> <millis>`; any difference is an error (exit status 1).

use std::collections::HashMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use hotstart_ckpt::{Destination, Dtype, Engine, EngineConfig, Extras, StepSel, Tensor, TierKind};
use hotstart_testkit::pattern;

/// The tensors of `step` on `rank`: a big one of `mib` MiB, a small BF16 one, an empty one.
pub fn tensors(step: u64, rank: u32, mib: usize) -> Vec<(String, Dtype, Vec<u64>, Vec<u8>)> {
    let seed = step * 1000 + rank as u64;
    vec![
        (
            "w".into(),
            Dtype::U8,
            vec![(mib << 20) as u64],
            pattern(mib << 20, seed),
        ),
        ("b".into(), Dtype::BF16, vec![3, 5], pattern(30, seed + 1)),
        ("empty".into(), Dtype::I64, vec![0], Vec::new()),
    ]
}

fn extras(step: u64) -> Extras {
    Extras::from([("step".to_string(), step.to_le_bytes().to_vec())])
}

struct Opts {
    job: String,
    rank: u32,
    world: u32,
    mib: usize,
    steps: u64,
    first: u64,
    step: Option<u64>,
    wait_all: bool,
    hold: bool,
    replica: bool,
}

impl Opts {
    /// The rank whose tensors this rank holds.
    fn content_rank(&self) -> u32 {
        if self.replica { 0 } else { self.rank }
    }
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        job: "run".into(),
        rank: 0,
        world: 1,
        mib: 1,
        steps: 1,
        first: 1,
        step: None,
        wait_all: false,
        hold: false,
        replica: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{a} needs a value"))
        };
        let num = |s: String| s.parse::<u64>().map_err(|e| format!("{a}: {e}"));
        match a.as_str() {
            "--job" => o.job = val()?,
            "--rank" => o.rank = num(val()?)? as u32,
            "--world" => o.world = num(val()?)? as u32,
            "--mib" => o.mib = num(val()?)? as usize,
            "--steps" => o.steps = num(val()?)?,
            "--first" => o.first = num(val()?)?,
            "--step" => o.step = Some(num(val()?)?),
            "--wait" => o.wait_all = val()? == "all",
            "--hold" => o.hold = true,
            "--replica" => o.replica = true,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(o)
}

fn engine(o: &Opts) -> Result<Engine, String> {
    let mut cfg = EngineConfig::new(o.job.clone(), o.rank, o.world).sidecar_from_env();
    if cfg.sidecar.is_none() {
        return Err("HOTSTART_SOCKET is not set".into());
    }
    cfg.chunk_size = 1 << 20;
    Engine::new(cfg).map_err(|e| e.to_string())
}

fn say(line: String) {
    let mut out = std::io::stdout();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn save(o: &Opts) -> Result<(), String> {
    let engine = engine(o)?;
    for step in o.first..o.first + o.steps {
        let set = tensors(step, o.content_rank(), o.mib);
        let ts: Vec<Tensor> = set
            .into_iter()
            .map(|(n, d, s, b)| Tensor::new(n, d, s, b).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        let h = engine
            .save(step, ts, extras(step))
            .map_err(|e| format!("save {step}: {e}"))?;
        h.wait_staged().map_err(|e| format!("stage {step}: {e}"))?;
        if o.wait_all {
            h.wait().map_err(|e| format!("persist {step}: {e}"))?;
        } else {
            h.wait_persisted(TierKind::Memory)
                .map_err(|e| format!("commit {step}: {e}"))?;
        }
        say(format!("saved {step}"));
    }
    say("done".into());
    if o.hold {
        loop {
            std::thread::park();
        }
    }
    Ok(())
}

fn restore(o: &Opts) -> Result<(), String> {
    let started = Instant::now();
    let engine = engine(o)?;
    let mut w = vec![0u8; o.mib << 20];
    let mut bufs: HashMap<String, &mut [u8]> = HashMap::new();
    bufs.insert("w".into(), &mut w);
    let which = o.step.map_or(StepSel::Latest, StepSel::Step);
    let loaded = engine
        .load(which, Destination::Buffers(bufs))
        .map_err(|e| format!("load: {e}"))?;
    let millis = started.elapsed().as_millis();
    let want = tensors(loaded.step, o.content_rank(), o.mib);
    if w != want[0].3 {
        return Err(format!("step {}: tensor w differs", loaded.step));
    }
    let owned: HashMap<&str, &[u8]> = loaded
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), &t.data[..]))
        .collect();
    for (name, _, _, bytes) in &want[1..] {
        if owned.get(name.as_str()) != Some(&&bytes[..]) {
            return Err(format!("step {}: tensor {name} differs", loaded.step));
        }
    }
    if loaded.extras != extras(loaded.step) {
        return Err(format!("step {}: extras differ", loaded.step));
    }
    let source = loaded.chunk_sources.first().copied().ok_or("no chunks")?;
    say(format!("restored {} {source} {millis}", loaded.step));
    Ok(())
}

pub fn main(args: &[String]) -> ExitCode {
    let res = match args.first().map(String::as_str) {
        Some("save") => parse(&args[1..]).and_then(|o| save(&o)),
        Some("restore") => parse(&args[1..]).and_then(|o| restore(&o)),
        _ => Err("usage: sidecar trainer save|restore [options]".into()),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("trainer: {e}");
            ExitCode::FAILURE
        }
    }
}
