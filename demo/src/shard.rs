//! The elastic demo's model (`hotstart demo --elastic`): one embedding table of the whole job,
//! its rows split among the ranks in contiguous blocks, under an MLP every rank holds the same
//! frozen copy of (a pretrained tower, made from the seed).
//!
//! **Why this shape.** A job that loses a node and goes on with fewer ranks must reshard: each
//! new rank needs rows that several old ranks held, at byte offsets of their files that only
//! the rows' new owner knows. That is the load DCP does for an FSDP job, and here it is done
//! through the checkpoint engine's ranged loads ([`hotstart_ckpt::Destination::Regions`]).
//!
//! **The same bits at any world size.** Step `s` of the job draws [`JOB_BATCH`] samples from a
//! counter-based generator keyed by `(seed, s, i)`; each rank trains those whose row it holds,
//! in the job's sample order, with the loss divided by the job's batch, and the MLP does not
//! change. A row's update reads only its own row and the MLP, so a table trained on 3 ranks,
//! resharded to 2 and trained on holds the same bits as one trained on 2 ranks throughout.
//!
//! **Digests without gathering.** A shard's digest is the sum (mod 2¹²⁸) of one blake3 per row,
//! over the row's index, value and Adam moments; the job's digest is the sum of its ranks'.
//! Addition does not care how rows are grouped, so the digest of a resharded job equals the
//! digest of the job that saved the step exactly when every row came back bit for bit. Losses
//! get the same treatment: per step, the sum of one blake3 per sample of the sample's index and
//! loss bits.

use std::ops::Range;

use crate::model::{BATCH, DIM, Model, bytes_of, label, mix};

/// Samples per step of the whole job, split among the ranks by the rows they hold.
pub const JOB_BATCH: usize = 3 * BATCH;

/// The rows rank `rank` of a job of `world` ranks holds, of a table of `rows` rows: contiguous
/// blocks, as even as they can be.
pub fn rows_of(rows: usize, rank: u32, world: u32) -> Range<usize> {
    let at = |r: u32| (rows as u128 * u128::from(r) / u128::from(world.max(1))) as usize;
    at(rank)..at(rank + 1)
}

/// One rank's part of the job: rows `first..first + model.rows()` of a table of `table_rows`.
#[derive(Debug, Clone, PartialEq)]
pub struct Shard {
    /// The rows held (as [`Model::emb`]), the frozen MLP and the step count.
    pub model: Model,
    pub table_rows: usize,
    pub first: usize,
}

/// A digest as the demo reports it.
pub fn hex(digest: u128) -> String {
    format!("{digest:032x}")
}

/// A digest as reported, back as a number.
pub fn parse(digest: &str) -> Option<u128> {
    u128::from_str_radix(digest, 16).ok()
}

fn to_u128(h: blake3::Hash) -> u128 {
    let mut b = [0u8; 16];
    b.copy_from_slice(&h.as_bytes()[..16]);
    u128::from_le_bytes(b)
}

impl Shard {
    /// Rank `rank`'s shard of a freshly initialised job of `world` ranks: row `g` of the table
    /// is initialised from `(seed, g)` whichever rank holds it.
    pub fn new(table_rows: usize, rank: u32, world: u32, seed: u64) -> Shard {
        let rows = rows_of(table_rows, rank, world);
        let mut model = Model::new(0, seed);
        model.emb = Model::new_rows(rows.clone(), seed);
        Shard {
            model,
            table_rows,
            first: rows.start,
        }
    }

    /// Rank `rank`'s shard with every row and moment zero, for a load to fill.
    pub fn zeroed(table_rows: usize, rank: u32, world: u32, seed: u64) -> Shard {
        let rows = rows_of(table_rows, rank, world);
        let mut model = Model::zeroed(rows.len());
        let frozen = Model::new(0, seed);
        (model.w1, model.b1, model.w2, model.b2) = (frozen.w1, frozen.b1, frozen.w2, frozen.b2);
        Shard {
            model,
            table_rows,
            first: rows.start,
        }
    }

    /// The rows held.
    pub fn rows(&self) -> Range<usize> {
        self.first..self.first + self.model.rows()
    }

    /// Trains step `model.step + 1` of the job on the samples whose rows this shard holds;
    /// returns this shard's part of the job's loss and of the job's loss digest.
    pub fn train_step(&mut self, seed: u64) -> (f32, u128) {
        let step = self.model.step;
        let rows = self.rows();
        let mut batch = Vec::new();
        let mut index = Vec::new();
        for i in 0..JOB_BATCH as u64 {
            let row = (mix(mix(seed ^ 0xE1A5_71C0) ^ mix(step ^ (i << 40)))
                % self.table_rows as u64) as usize;
            if rows.contains(&row) {
                batch.push((row - self.first, label(row as u64)));
                index.push(i);
            }
        }
        let losses = self.model.step_on(&batch, JOB_BATCH, false);
        let mut digest = 0u128;
        for (i, loss) in index.iter().zip(&losses) {
            let mut h = blake3::Hasher::new();
            h.update(&step.to_le_bytes());
            h.update(&i.to_le_bytes());
            h.update(&loss.to_bits().to_le_bytes());
            digest = digest.wrapping_add(to_u128(h.finalize()));
        }
        (losses.iter().sum::<f32>() / JOB_BATCH as f32, digest)
    }

    /// This shard's part of the job's state digest: the sum of one blake3 per row held, over
    /// the row's index in the table, its value and its two moments.
    pub fn digest(&self) -> u128 {
        let emb = &self.model.emb;
        (0..self.model.rows()).fold(0u128, |acc, l| {
            let at = l * DIM..(l + 1) * DIM;
            let mut h = blake3::Hasher::new();
            h.update(&((self.first + l) as u64).to_le_bytes());
            h.update(bytes_of(&emb.value[at.clone()]));
            h.update(bytes_of(&emb.m[at.clone()]));
            h.update(bytes_of(&emb.v[at]));
            acc.wrapping_add(to_u128(h.finalize()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 3 ranks train, the job is resharded to 2 (rows copied from the old shards) and trains
    /// on: every row, and every step's loss digest, equal those of a job of 2 ranks throughout.
    #[test]
    fn a_job_resharded_trains_the_same_bits_as_one_never_resharded() {
        let (rows, seed) = (500, 9);
        let train = |shards: &mut [Shard], steps: u64| -> Vec<u128> {
            (0..steps)
                .map(|_| {
                    shards
                        .iter_mut()
                        .fold(0u128, |d, s| d.wrapping_add(s.train_step(seed).1))
                })
                .collect()
        };
        let mut three: Vec<Shard> = (0..3).map(|r| Shard::new(rows, r, 3, seed)).collect();
        let mut two: Vec<Shard> = (0..2).map(|r| Shard::new(rows, r, 2, seed)).collect();
        let job_digest = |s: &[Shard]| s.iter().fold(0u128, |d, s| d.wrapping_add(s.digest()));
        assert_eq!(
            job_digest(&three),
            job_digest(&two),
            "the same initial table"
        );
        assert_eq!(train(&mut three, 30), train(&mut two, 30));
        assert_eq!(job_digest(&three), job_digest(&two));

        // Reshard 3 → 2 by copying rows, as the trainer's ranged loads do.
        let mut resharded: Vec<Shard> = (0..2).map(|r| Shard::zeroed(rows, r, 2, seed)).collect();
        for new in &mut resharded {
            new.model.step = 30;
            for old in &three {
                for g in new.rows().start.max(old.first)..new.rows().end.min(old.rows().end) {
                    let (a, b) = ((g - old.first) * DIM, (g - new.first) * DIM);
                    for (dst, src) in [
                        (&mut new.model.emb.value, &old.model.emb.value),
                        (&mut new.model.emb.m, &old.model.emb.m),
                        (&mut new.model.emb.v, &old.model.emb.v),
                    ] {
                        dst[b..b + DIM].copy_from_slice(&src[a..a + DIM]);
                    }
                }
            }
        }
        assert!(resharded == two, "rows moved bit for bit");
        assert_eq!(train(&mut resharded, 20), train(&mut two, 20));
        assert!(resharded == two, "trained on, still the same bits");

        // A different row breaks the digest.
        resharded[1].model.emb.m[7] += 1.0;
        assert_ne!(job_digest(&resharded), job_digest(&two));
    }
}
