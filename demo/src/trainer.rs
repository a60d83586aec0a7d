//! A demo trainer: one rank of the job, attached to its node's sidecar.
//!
//! It restores the newest step complete for every rank (through the sidecar: from this node's
//! memory, a peer, disk or the store), or starts fresh; then trains, checkpointing every
//! `every` steps. A checkpoint saves the model's parameters and Adam moments straight from the
//! model's own memory (no copy of its own: the trainer waits for `wait_staged` before the next
//! step changes them), and the trainer reports how long it waited, the blake3 of the state it
//! saved, and each tier as it finishes. Everything is reported as [`Event`]s on stdout, one JSON
//! object per line; nothing else is written there.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hotstart_ckpt::{
    Destination, Dtype, Engine, EngineConfig, Phase, SaveHandle, StepSel, Tensor, TierKind,
};

use crate::event::Event;
use crate::model::{DIM, Model, Param, bytes_of, bytes_of_mut};
use crate::shard::{self, Shard};
use crate::{Error, Result};

/// What a trainer process is told.
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    pub socket: PathBuf,
    pub job: String,
    pub rank: u32,
    pub world_size: u32,
    /// Bytes of parameters and Adam moments.
    pub state_bytes: u64,
    pub seed: u64,
    /// Steps between checkpoints.
    pub every: u64,
    /// Stop after this step (run until killed when `None`).
    pub until: Option<u64>,
    /// The directory the job agrees on the step it resumes from through, one per start of the
    /// job (see [`restore_agreed`]; `None`: each rank restores the newest step its own sidecar
    /// finds).
    pub agreement: Option<PathBuf>,
    /// Train the elastic demo's row-sharded job ([`crate::shard`]): every restore reshards
    /// from the ranks of the job that saved the step, whatever their number.
    pub elastic: bool,
}

const STEP_EXTRA: &str = "demo.step";
/// The elastic job's table rows, in every rank's checkpoint.
const ROWS_EXTRA: &str = "demo.rows";

/// What a trainer trains: a model of its own, or its shard of the elastic job's table.
enum State {
    Own(Model),
    Shard(Shard),
}

impl State {
    fn model(&self) -> &Model {
        match self {
            State::Own(m) => m,
            State::Shard(s) => &s.model,
        }
    }

    /// Trains the next step; the event reporting it.
    fn train(&mut self, cfg: &TrainerConfig) -> Event {
        let (loss, loss_digest) = match self {
            State::Own(m) => (m.train_step(&m.batch(cfg.seed, cfg.rank, m.step)), None),
            State::Shard(s) => {
                let (loss, digest) = s.train_step(cfg.seed);
                (loss, Some(shard::hex(digest)))
            }
        };
        Event::Step {
            rank: cfg.rank,
            step: self.model().step,
            loss_bits: loss.to_bits(),
            loss_digest,
        }
    }

    /// What the demo compares after a restore: the blake3 of the model, or the shard's part of
    /// the job's digest.
    fn hash(&self) -> String {
        match self {
            State::Own(m) => state_hash(m),
            State::Shard(s) => shard::hex(s.digest()),
        }
    }

    fn extras(&self) -> hotstart_ckpt::Extras {
        let mut extras: hotstart_ckpt::Extras = [(
            STEP_EXTRA.to_string(),
            self.model().step.to_le_bytes().to_vec(),
        )]
        .into();
        if let State::Shard(s) = self {
            extras.insert(
                ROWS_EXTRA.into(),
                (s.table_rows as u64).to_le_bytes().to_vec(),
            );
        }
        extras
    }
}

/// The u64 extra `name` of step `step`.
fn extra_u64(extras: &hotstart_ckpt::Extras, name: &str, step: u64) -> Result<u64> {
    extras
        .get(name)
        .and_then(|b| <[u8; 8]>::try_from(&b[..]).ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| Error::Protocol(format!("step {step} has no {name} extra")))
}

/// The model's bytes as safetensors tensors: every parameter and both its moments.
fn views(model: &Model) -> Vec<(String, &[f32], Vec<u64>)> {
    let mut out = Vec::new();
    for p in model.params() {
        let shape: Vec<u64> = p.shape.iter().map(|&d| d as u64).collect();
        out.push((p.name.to_string(), &p.value[..], shape.clone()));
        out.push((format!("{}.adam_m", p.name), &p.m[..], shape.clone()));
        out.push((format!("{}.adam_v", p.name), &p.v[..], shape));
    }
    out
}

/// blake3 of the whole training state (step, then every tensor in order): what the demo
/// compares after a restore.
pub fn state_hash(model: &Model) -> String {
    let mut h = blake3::Hasher::new();
    h.update(&model.step.to_le_bytes());
    for (_, data, _) in views(model) {
        h.update(bytes_of(data));
    }
    h.finalize().to_hex().to_string()
}

fn emit(event: &Event) {
    let mut out = std::io::stdout().lock();
    // A trainer whose orchestrator went away has nobody to tell; it is killed soon anyway.
    let _ = serde_json::to_writer(&mut out, event);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

/// Restores step `which` (the newest complete for every rank, or a given one): a model shaped
/// after the checkpoint, loaded straight into its memory, and the event reporting it; `None`
/// when there is none.
fn restore(engine: &Engine, rank: u32, which: StepSel) -> Result<Option<(Model, Event)>> {
    let started = Instant::now();
    let mut model: Option<Model> = None;
    let slot = &mut model;
    // The model is made once the checkpoint's manifest names its shapes, before any byte is
    // read, so its memory is written once, by the load.
    let plan = Destination::Planned(Box::new(move |m, _| {
        let rows = m
            .tensors
            .iter()
            .find(|t| t.name == "emb")
            .and_then(|t| t.shape.first())
            .ok_or_else(|| hotstart_ckpt::Error::Config {
                reason: format!("step {} has no embedding table", m.step),
            })?;
        let model = slot.insert(Model::zeroed(*rows as usize));
        let mut buffers: HashMap<String, &mut [u8]> = HashMap::new();
        for p in model.params_mut() {
            let Param {
                name, value, m, v, ..
            } = p;
            buffers.insert(name.to_string(), bytes_of_mut(value));
            buffers.insert(format!("{name}.adam_m"), bytes_of_mut(m));
            buffers.insert(format!("{name}.adam_v"), bytes_of_mut(v));
        }
        Ok(Destination::Buffers(buffers))
    }));
    let loaded = match engine.load(which, plan) {
        Ok(l) => l,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let mut model = model.ok_or_else(|| Error::Protocol("a load without its plan".into()))?;
    let step = extra_u64(&loaded.extras, STEP_EXTRA, loaded.step)?;
    if step != loaded.step || !loaded.tensors.is_empty() {
        return Err(Error::Protocol(format!(
            "step {} holds the state of step {step} and {} tensors the model does not have",
            loaded.step,
            loaded.tensors.len()
        )));
    }
    model.step = step;
    let seconds = started.elapsed().as_secs_f64();
    let event = Event::Restored {
        rank,
        step,
        sources: loaded
            .chunk_sources
            .iter()
            .map(TierKind::to_string)
            .collect(),
        seconds,
        hash: state_hash(&model),
    };
    Ok(Some((model, event)))
}

/// Rank `cfg.rank`'s shard of the elastic job at step `step`, whatever the number of ranks that
/// saved it: each row it now holds is loaded, as byte ranges of the three tensors the row is
/// in, from the file of the old rank that held it (through the sidecar: its memory, a peer's,
/// a disk, the store, whichever is nearest), straight into the shard's memory. `None` when the
/// step, or an old rank's part of it, is gone.
fn reshard(engine: &Engine, cfg: &TrainerConfig, step: u64) -> Result<Option<(State, Event)>> {
    let started = Instant::now();
    let first = match engine.manifest(step, 0) {
        Err(e) if e.is_not_found() => return Ok(None),
        m => m?,
    };
    let old_world = first.world_size;
    let extras = first
        .decode_extras()
        .map_err(|e| Error::Protocol(format!("step {step}, rank 0: {e}")))?;
    let table_rows = extra_u64(&extras, ROWS_EXTRA, step)?;
    let mut shard = Shard::zeroed(table_rows as usize, cfg.rank, cfg.world_size, cfg.seed);
    shard.model.step = step;
    let mine = shard.rows();
    let row_bytes = (DIM * std::mem::size_of::<f32>()) as u64;
    let mut sources = Vec::new();
    for old in 0..old_world {
        let theirs = shard::rows_of(table_rows as usize, old, old_world);
        let (a, b) = (mine.start.max(theirs.start), mine.end.min(theirs.end));
        if a >= b {
            continue;
        }
        let at = Some((a - theirs.start) as u64 * row_bytes);
        let into = (a - mine.start) * DIM..(b - mine.start) * DIM;
        let Param { value, m, v, .. } = &mut shard.model.emb;
        let regions = vec![
            (
                "emb".to_string(),
                at,
                bytes_of_mut(&mut value[into.clone()]),
            ),
            (
                "emb.adam_m".to_string(),
                at,
                bytes_of_mut(&mut m[into.clone()]),
            ),
            ("emb.adam_v".to_string(), at, bytes_of_mut(&mut v[into])),
        ];
        let reader =
            Engine::new(EngineConfig::new(cfg.job.clone(), old, old_world).sidecar(&cfg.socket))?;
        let loaded = match reader.load(StepSel::Step(step), Destination::Regions(regions)) {
            Err(e) if e.is_not_found() => return Ok(None),
            l => l?,
        };
        let (s, rows) = (
            extra_u64(&loaded.extras, STEP_EXTRA, step)?,
            extra_u64(&loaded.extras, ROWS_EXTRA, step)?,
        );
        if (s, rows) != (step, table_rows) {
            return Err(Error::Protocol(format!(
                "step {step}, rank {old} of {old_world}: the state of step {s} of a table of \
                 {rows} rows, not of step {step} of {table_rows} rows"
            )));
        }
        sources.extend(loaded.chunk_sources.iter().map(TierKind::to_string));
    }
    let seconds = started.elapsed().as_secs_f64();
    let event = Event::Resharded {
        rank: cfg.rank,
        step,
        from_world: old_world,
        sources,
        seconds,
        hash: shard::hex(shard.digest()),
    };
    Ok(Some((State::Shard(shard), event)))
}

/// Starts a checkpoint of `state` and waits until it is staged.
fn save(engine: &Engine, state: &State, rank: u32) -> Result<(SaveHandle, Instant)> {
    // Hashed before the save, not after: the step survives from `wait_staged` on, and a trainer
    // killed while it hashed would have saved a step without telling its hash.
    let hash = state.hash();
    let started = Instant::now();
    let model = state.model();
    let mut tensors = Vec::new();
    for (name, data, shape) in views(model) {
        let bytes = bytes_of(data);
        // SAFETY: the model is not changed until `wait_staged` below returns (the training loop
        // is this thread, and it waits here), and it outlives the save.
        let t = unsafe { Tensor::from_raw(name, Dtype::F32, shape, bytes.as_ptr(), bytes.len()) }?;
        tensors.push(t);
    }
    let handle = engine.save(model.step, tensors, state.extras())?;
    let waited = started.elapsed();
    handle.wait_staged()?;
    emit(&Event::Saved {
        rank,
        step: model.step,
        stall_seconds: started.elapsed().as_secs_f64(),
        wait_seconds: waited.as_secs_f64(),
        hash,
    });
    Ok((handle, started))
}

/// A save whose tiers are still being reported.
struct Pending {
    handle: SaveHandle,
    started: Instant,
    reported: Vec<TierKind>,
}

impl Pending {
    /// Reports the tiers that finished since the last call; true once every tier has.
    fn report(&mut self, rank: u32) -> bool {
        let status = self.handle.status();
        let mut open = false;
        for tier in [
            TierKind::Memory,
            TierKind::Peer,
            TierKind::Disk,
            TierKind::Store,
        ] {
            if self.reported.contains(&tier) {
                continue;
            }
            let error = match status.tier(tier) {
                Phase::Pending => {
                    open = true;
                    continue;
                }
                Phase::Off | Phase::Skipped => {
                    self.reported.push(tier);
                    continue;
                }
                Phase::Done => None,
                Phase::Failed(e) => Some(e.to_string()),
            };
            self.reported.push(tier);
            emit(&Event::Persisted {
                rank,
                step: status.step,
                tier: tier.to_string(),
                seconds: self.started.elapsed().as_secs_f64(),
                error,
            });
        }
        !open
    }
}

/// The newest step complete for every rank of this job's size, older than `below` if given.
fn newest_complete(engine: &Engine, below: Option<u64>) -> Result<Option<u64>> {
    Ok(match below {
        None => engine.latest_complete_step()?,
        Some(s) => engine.latest_complete_step_below(s)?,
    })
}

/// How long a rank waits for the others in [`restore_agreed`].
const AGREEMENT_WAIT: Duration = Duration::from_secs(120);

/// Writes `text` to `path` whole: written beside, then renamed.
fn publish(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(|e| Error::io("write an agreement file", e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io("publish an agreement file", e))
}

/// The contents of `path` once it exists.
fn await_file(path: &Path, what: &str) -> Result<String> {
    let deadline = Instant::now() + AGREEMENT_WAIT;
    loop {
        match std::fs::read_to_string(path) {
            Ok(text) => return Ok(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("read an agreement file", e)),
        }
        if Instant::now() > deadline {
            return Err(Error::Timeout(format!("{what} ({})", path.display())));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Restores the step the whole job agrees on, through files in the directory `dir` (one per
/// start of the job), as a real job does through its collectives: a job must let one rank
/// decide (docs/SEMANTICS.md), since two sidecars may see a step become complete a moment apart.
///
/// In round k rank 0 proposes a step (`step-k`): the newest complete for every rank, then each
/// round the newest complete one older than the last proposal. Every rank tries to restore it
/// and says whether it could (`result-k-<rank>`). When all could, that is the step; when one
/// could not (its copies corrupt or gone in every tier), the job goes back a step and tries
/// again, rather than failing the same way at every restart. `None`: no step is left, every
/// rank starts fresh.
///
/// `propose(below)` is rank 0's choice, `restore(step)` each rank's attempt.
fn restore_agreed<T>(
    cfg: &TrainerConfig,
    dir: &Path,
    propose: impl Fn(Option<u64>) -> Result<Option<u64>>,
    mut restore: impl FnMut(u64) -> Result<Option<T>>,
) -> Result<Option<T>> {
    if cfg.rank == 0 {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create the agreement directory", e))?;
    }
    let mut proposed: Option<u64> = None;
    let mut round = 0;
    loop {
        let at = dir.join(format!("step-{round}"));
        if cfg.rank == 0 {
            let step = propose(proposed)?;
            publish(
                &at,
                &step.map_or_else(|| "fresh".to_string(), |s| s.to_string()),
            )?;
        }
        let text = await_file(&at, "rank 0 to choose the step to resume from")?;
        if text == "fresh" {
            return Ok(None);
        }
        let step: u64 = text
            .parse()
            .map_err(|_| Error::Protocol(format!("{}: not a step: {text:?}", at.display())))?;
        proposed = Some(step);
        let (restored, said) = match restore(step) {
            Ok(Some(r)) => (Some(r), "ok".to_string()),
            Ok(None) => (None, "not found".to_string()),
            Err(e) => (None, e.to_string()),
        };
        if restored.is_none() {
            eprintln!("rank {}: cannot restore step {step}: {said}", cfg.rank);
        }
        publish(&dir.join(format!("result-{round}-{}", cfg.rank)), &said)?;
        let mut all = true;
        for r in 0..cfg.world_size {
            let theirs = await_file(
                &dir.join(format!("result-{round}-{r}")),
                "every rank to try the chosen step",
            )?;
            all &= theirs == "ok";
        }
        if all {
            return Ok(restored);
        }
        round += 1;
    }
}

/// Runs a trainer until `until` (or until killed).
pub fn run(cfg: &TrainerConfig) -> Result<()> {
    let engine = Engine::new(
        EngineConfig::new(cfg.job.clone(), cfg.rank, cfg.world_size).sidecar(&cfg.socket),
    )?;
    let restored = if cfg.elastic {
        // Any checkpoint of the job, saved by however many ranks.
        let propose = |below: Option<u64>| -> Result<Option<u64>> {
            let found = match below {
                None => engine.latest_checkpoint()?,
                Some(s) => engine.latest_checkpoint_below(s)?,
            };
            Ok(found.map(|(step, _)| step))
        };
        match &cfg.agreement {
            None => match propose(None)? {
                Some(step) => reshard(&engine, cfg, step)?,
                None => None,
            },
            Some(dir) => restore_agreed(cfg, dir, propose, |step| reshard(&engine, cfg, step))?,
        }
    } else {
        let own = |r: Option<(Model, Event)>| r.map(|(m, e)| (State::Own(m), e));
        match &cfg.agreement {
            None => own(restore(&engine, cfg.rank, StepSel::Latest)?),
            Some(dir) => own(restore_agreed(
                cfg,
                dir,
                |below| newest_complete(&engine, below),
                |step| restore(&engine, cfg.rank, StepSel::Step(step)),
            )?),
        }
    };
    let (mut state, event) = match restored {
        Some((state, event)) => (state, event),
        None => {
            let rows = Model::rows_for(cfg.state_bytes);
            let state = if cfg.elastic {
                let table = rows * cfg.world_size as usize;
                State::Shard(Shard::new(table, cfg.rank, cfg.world_size, cfg.seed))
            } else {
                State::Own(Model::new(rows, cfg.seed ^ u64::from(cfg.rank)))
            };
            (state, Event::Fresh { rank: cfg.rank })
        }
    };
    emit(&Event::Started {
        rank: cfg.rank,
        state_bytes: state.model().state_bytes(),
    });
    emit(&event);
    let mut pending: Vec<Pending> = Vec::new();
    loop {
        if cfg.until.is_some_and(|u| state.model().step >= u) {
            break;
        }
        emit(&state.train(cfg));
        if state.model().step.is_multiple_of(cfg.every.max(1)) {
            let (handle, started) = save(&engine, &state, cfg.rank)?;
            pending.push(Pending {
                handle,
                started,
                reported: Vec::new(),
            });
        }
        pending.retain_mut(|p| !p.report(cfg.rank));
    }
    for mut p in pending {
        let _ = p.handle.wait();
        p.report(cfg.rank);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// Rank 1's copy of the newest step is corrupt in the only tier: the job must go back to
    /// the step before it, every rank together, instead of failing at every restart.
    #[test]
    fn the_job_goes_back_together_when_a_rank_cannot_restore_the_chosen_step() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("disk");
        let agreement = dir.path().join("resume-1");
        let engine =
            |rank| Engine::new(EngineConfig::new("demo", rank, 2).disk(disk.clone())).unwrap();
        let mut hashes = Vec::new();
        for rank in 0..2 {
            let e = engine(rank);
            let mut state = State::Own(Model::new(Model::rows_for(1 << 20), u64::from(rank)));
            let mut saved = BTreeMap::new();
            for step in [10, 20] {
                if let State::Own(m) = &mut state {
                    m.step = step;
                }
                let (h, _) = save(&e, &state, rank).unwrap();
                h.wait().unwrap();
                saved.insert(step, state.hash());
            }
            hashes.push(saved);
        }
        let file = disk.join("demo/step-20/rank-1.safetensors");
        let mut bytes = std::fs::read(&file).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        std::fs::write(&file, bytes).unwrap();

        let restored: Vec<_> = std::thread::scope(|s| {
            let runs: Vec<_> = (0..2)
                .map(|rank| {
                    let (engine, agreement) = (engine(rank), agreement.clone());
                    s.spawn(move || {
                        let cfg = TrainerConfig {
                            socket: PathBuf::new(),
                            job: "demo".into(),
                            rank,
                            world_size: 2,
                            state_bytes: 1 << 20,
                            seed: 0,
                            every: 10,
                            until: None,
                            agreement: Some(agreement.clone()),
                            elastic: false,
                        };
                        restore_agreed(
                            &cfg,
                            &agreement,
                            |below| newest_complete(&engine, below),
                            |step| restore(&engine, rank, StepSel::Step(step)),
                        )
                        .unwrap()
                    })
                })
                .collect();
            runs.into_iter().map(|r| r.join().unwrap()).collect()
        });
        for (rank, r) in restored.iter().enumerate() {
            let (model, _) = r.as_ref().expect("a step restored");
            assert_eq!(model.step, 10, "rank {rank}");
            assert_eq!(state_hash(model), hashes[rank][&10], "rank {rank}");
        }
        let read = |name: &str| std::fs::read_to_string(agreement.join(name)).unwrap();
        assert_eq!(read("step-0"), "20");
        assert_eq!(read("result-0-0"), "ok");
        assert_ne!(read("result-0-1"), "ok");
        assert_eq!(read("step-1"), "10");
        assert_eq!(
            (read("result-1-0"), read("result-1-1")),
            ("ok".into(), "ok".into())
        );
    }
}
