//! The demo trainer's model: an embedding table feeding a small MLP classifier, trained with Adam
//! on synthetic data, single-threaded and bit-for-bit deterministic.
//!
//! **Why this shape.** A training job's checkpoint is mostly parameters and optimizer state, and
//! the demo wants about 1 GiB of it per trainer without hours of compute on two cores. An
//! embedding table (as in recommendation and language models) carries most of the bytes, while
//! each step reads and updates only the rows its batch touches; the MLP on top does real dense
//! work (matrix products forward and backward). Every parameter has two Adam moments, so the
//! state is 12 bytes per parameter.
//!
//! **Data.** Sample `i` of step `s` on rank `r` is a row index drawn from a counter-based
//! generator keyed by `(seed, r, s, i)`, and its label is a fixed hash of the row. Nothing else
//! is random, so the same state trained on the same steps gives the same bits, which is what the
//! demo checks after every restore: the losses of the steps replayed after a fault must equal
//! those first computed.
//!
//! **Forward/backward** for a batch of `B` rows `x` (`B × D`): `h = relu(x W1 + b1)` (`B × H`),
//! `z = h W2 + b2` (`B × C`), loss = mean cross-entropy of `softmax(z)` against the labels.
//! Gradients flow back to `W2, b2, W1, b1` and to the touched embedding rows; Adam (with bias
//! correction) updates the dense parameters every step and each touched row lazily (its moments
//! decay only when it is touched, as sparse Adam does).

/// Embedding width.
pub const DIM: usize = 64;
/// Hidden units of the MLP.
pub const HIDDEN: usize = 256;
/// Classes.
pub const CLASSES: usize = 16;
/// Samples per step.
pub const BATCH: usize = 128;

const LR: f32 = 3e-3;
const BETA1: f32 = 0.9;
const BETA2: f32 = 0.999;
const EPS: f32 = 1e-8;

/// One parameter tensor with its two Adam moments.
#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub value: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

impl Param {
    fn new(name: &'static str, shape: Vec<usize>, value: Vec<f32>) -> Param {
        let n = value.len();
        debug_assert_eq!(n, shape.iter().product::<usize>());
        Param {
            name,
            shape,
            value,
            m: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    /// One Adam update of elements `range` with gradient `grad` (same length), at step `t`
    /// (1-based, for bias correction).
    fn adam(&mut self, range: std::ops::Range<usize>, grad: &[f32], t: u64) {
        let (c1, c2) = bias_corrections(t);
        let (w, m, v) = (
            &mut self.value[range.clone()],
            &mut self.m[range.clone()],
            &mut self.v[range],
        );
        for (((w, m), v), &g) in w.iter_mut().zip(m).zip(v).zip(grad) {
            *m = BETA1 * *m + (1.0 - BETA1) * g;
            *v = BETA2 * *v + (1.0 - BETA2) * g * g;
            *w -= LR * (*m / c1) / ((*v / c2).sqrt() + EPS);
        }
    }
}

/// The bytes of `x`, as a checkpoint takes them.
pub(crate) fn bytes_of(x: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte pattern is a valid u8; the slice covers exactly
    // the same memory, borrowed for the same lifetime.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

/// The bytes of `x`, writable, for a load to fill.
pub(crate) fn bytes_of_mut(x: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`; every byte pattern is also a valid f32, so writing any bytes
    // through the returned slice leaves valid floats, and the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

fn bias_corrections(t: u64) -> (f32, f32) {
    let t = t.min(i32::MAX as u64) as i32;
    (1.0 - BETA1.powi(t), 1.0 - BETA2.powi(t))
}

/// The whole training state of one trainer: parameters, Adam moments and the step count.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    /// Steps trained so far.
    pub step: u64,
    pub emb: Param,
    pub w1: Param,
    pub b1: Param,
    pub w2: Param,
    pub b2: Param,
}

/// A counter-based generator (splitmix64 over a key): the same key always gives the same value.
pub fn mix(key: u64) -> u64 {
    let mut z = key.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn key(parts: &[u64]) -> u64 {
    parts.iter().fold(0x5EED, |acc, &p| mix(acc ^ p))
}

/// A uniform value in [-scale, scale) from `key`.
fn uniform(key: u64, scale: f32) -> f32 {
    let unit = (mix(key) >> 40) as f32 / (1u64 << 24) as f32;
    (unit * 2.0 - 1.0) * scale
}

impl Model {
    /// A model of `rows` embedding rows whose every parameter and moment is zero, for a
    /// restore to fill (the zeroed memory is mapped lazily: nothing is written twice).
    pub fn zeroed(rows: usize) -> Model {
        let mut m = Model::new(0, 0);
        m.emb = Param::new("emb", vec![rows, DIM], vec![0.0; rows * DIM]);
        m
    }

    /// Rows of an embedding table such that the whole state takes about `state_bytes`.
    pub fn rows_for(state_bytes: u64) -> usize {
        let mlp = DIM * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES;
        let params = (state_bytes / 12) as usize;
        (params.saturating_sub(mlp) / DIM).max(CLASSES)
    }

    /// A freshly initialised model with `rows` embedding rows, from `seed`.
    pub fn new(rows: usize, seed: u64) -> Model {
        let init = |tag: u64, n: usize, scale: f32| -> Vec<f32> {
            (0..n as u64)
                .map(|i| uniform(key(&[seed, tag, i]), scale))
                .collect()
        };
        Model {
            step: 0,
            emb: Model::new_rows(0..rows, seed),
            w1: Param::new(
                "mlp.w1",
                vec![DIM, HIDDEN],
                init(2, DIM * HIDDEN, (1.0 / DIM as f32).sqrt()),
            ),
            b1: Param::new("mlp.b1", vec![HIDDEN], vec![0.0; HIDDEN]),
            w2: Param::new(
                "mlp.w2",
                vec![HIDDEN, CLASSES],
                init(3, HIDDEN * CLASSES, (1.0 / HIDDEN as f32).sqrt()),
            ),
            b2: Param::new("mlp.b2", vec![CLASSES], vec![0.0; CLASSES]),
        }
    }

    /// Rows `rows` of the embedding table a model made from `seed` starts with (row `g` is
    /// the same wherever the table is cut), with zero moments.
    pub fn new_rows(rows: std::ops::Range<usize>, seed: u64) -> Param {
        let first = (rows.start * DIM) as u64;
        let n = rows.len() * DIM;
        let value = (first..first + n as u64)
            .map(|i| uniform(key(&[seed, 1, i]), 0.5))
            .collect();
        Param::new("emb", vec![rows.len(), DIM], value)
    }

    /// Embedding rows.
    pub fn rows(&self) -> usize {
        self.emb.shape[0]
    }

    /// Every parameter, in a fixed order.
    pub fn params(&self) -> [&Param; 5] {
        [&self.emb, &self.w1, &self.b1, &self.w2, &self.b2]
    }

    /// Every parameter, mutably, in the same order as [`Model::params`].
    pub fn params_mut(&mut self) -> [&mut Param; 5] {
        [
            &mut self.emb,
            &mut self.w1,
            &mut self.b1,
            &mut self.w2,
            &mut self.b2,
        ]
    }

    /// Bytes of parameters and moments.
    pub fn state_bytes(&self) -> u64 {
        self.params()
            .iter()
            .map(|p| 12 * p.value.len() as u64)
            .sum()
    }

    /// The batch of step `step` on `rank`: row indices and labels.
    pub fn batch(&self, seed: u64, rank: u32, step: u64) -> Vec<(usize, usize)> {
        let rows = self.rows() as u64;
        (0..BATCH as u64)
            .map(|i| {
                let row = mix(key(&[seed, 0xDA7A, u64::from(rank), step, i])) % rows;
                (row as usize, label(row))
            })
            .collect()
    }

    /// Trains one step on `batch`; returns the batch's mean loss before the update.
    pub fn train_step(&mut self, batch: &[(usize, usize)]) -> f32 {
        let losses = self.step_on(batch, batch.len(), true);
        losses.iter().sum::<f32>() / batch.len() as f32
    }

    /// Trains one step on `batch`, a part of a batch of `of` samples (the rest trained
    /// elsewhere on other rows), updating the MLP too when `dense`; returns each sample's loss
    /// before the update. Each sample's forward and backward pass reads only its own row and
    /// the MLP, and each row's gradient is summed in the order of `batch`, so a row's update is
    /// the same bits however the whole batch is split.
    pub fn step_on(&mut self, batch: &[(usize, usize)], of: usize, dense: bool) -> Vec<f32> {
        let b = batch.len();
        let t = self.step + 1;
        // Forward.
        let mut x = vec![0f32; b * DIM];
        for (k, &(row, _)) in batch.iter().enumerate() {
            x[k * DIM..(k + 1) * DIM].copy_from_slice(&self.emb.value[row * DIM..(row + 1) * DIM]);
        }
        let mut h = matmul(&x, &self.w1.value, b, DIM, HIDDEN);
        add_bias(&mut h, &self.b1.value);
        h.iter_mut().for_each(|v| *v = v.max(0.0));
        let mut z = matmul(&h, &self.w2.value, b, HIDDEN, CLASSES);
        add_bias(&mut z, &self.b2.value);
        // Softmax cross-entropy; dz = (softmax - onehot) / b.
        let mut losses = Vec::with_capacity(b);
        let mut dz = vec![0f32; b * CLASSES];
        for (k, &(_, y)) in batch.iter().enumerate() {
            let zk = &z[k * CLASSES..(k + 1) * CLASSES];
            let max = zk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = zk.iter().map(|v| (v - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            losses.push(sum.ln() - (zk[y] - max));
            for c in 0..CLASSES {
                let p = exps[c] / sum;
                dz[k * CLASSES + c] = (p - f32::from(c == y)) / of as f32;
            }
        }
        // Backward.
        let mut dh = matmul_nt(&dz, &self.w2.value, b, CLASSES, HIDDEN);
        for (d, &hv) in dh.iter_mut().zip(&h) {
            if hv <= 0.0 {
                *d = 0.0;
            }
        }
        let dx = matmul_nt(&dh, &self.w1.value, b, HIDDEN, DIM);
        // Updates: dense parameters, then each touched row once with its summed gradient.
        if dense {
            let dw2 = matmul_tn(&h, &dz, b, HIDDEN, CLASSES);
            let db2 = column_sums(&dz, CLASSES);
            let dw1 = matmul_tn(&x, &dh, b, DIM, HIDDEN);
            let db1 = column_sums(&dh, HIDDEN);
            self.w1.adam(0..DIM * HIDDEN, &dw1, t);
            self.b1.adam(0..HIDDEN, &db1, t);
            self.w2.adam(0..HIDDEN * CLASSES, &dw2, t);
            self.b2.adam(0..CLASSES, &db2, t);
        }
        let mut rows: Vec<(usize, usize)> = batch
            .iter()
            .enumerate()
            .map(|(k, &(r, _))| (r, k))
            .collect();
        rows.sort_unstable();
        let mut i = 0;
        while i < rows.len() {
            let row = rows[i].0;
            let mut g = [0f32; DIM];
            while i < rows.len() && rows[i].0 == row {
                let k = rows[i].1;
                for (gj, d) in g.iter_mut().zip(&dx[k * DIM..(k + 1) * DIM]) {
                    *gj += d;
                }
                i += 1;
            }
            self.emb.adam(row * DIM..(row + 1) * DIM, &g, t);
        }
        self.step = t;
        losses
    }
}

/// The label of embedding row `row`: a fixed hash, so the task is learnable only by training
/// the row's embedding.
pub fn label(row: u64) -> usize {
    (mix(row ^ 0x1ABE1) % CLASSES as u64) as usize
}

/// `a (m × k) · b (k × n)`.
fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        let row = &mut out[i * n..(i + 1) * n];
        for p in 0..k {
            let av = a[i * k + p];
            if av == 0.0 {
                continue;
            }
            for (o, &bv) in row.iter_mut().zip(&b[p * n..(p + 1) * n]) {
                *o += av * bv;
            }
        }
    }
    out
}

/// `aᵀ (k × m, given as m × k) · b (m × n)`: a `k × n` result.
fn matmul_tn(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; k * n];
    for i in 0..m {
        let brow = &b[i * n..(i + 1) * n];
        for p in 0..k {
            let av = a[i * k + p];
            if av == 0.0 {
                continue;
            }
            for (o, &bv) in out[p * n..(p + 1) * n].iter_mut().zip(brow) {
                *o += av * bv;
            }
        }
    }
    out
}

/// `a (m × n) · bᵀ (n × k, given as k × n)`: an `m × k` result.
fn matmul_nt(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * k];
    for i in 0..m {
        let arow = &a[i * n..(i + 1) * n];
        for p in 0..k {
            out[i * k + p] = arow
                .iter()
                .zip(&b[p * n..(p + 1) * n])
                .map(|(x, y)| x * y)
                .sum();
        }
    }
    out
}

fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

fn column_sums(x: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    for row in x.chunks(n) {
        for (o, v) in out.iter_mut().zip(row) {
            *o += v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loss of `batch` under `model`, computed by a forward pass alone.
    fn loss_of(model: &Model, batch: &[(usize, usize)]) -> f64 {
        let mut m = model.clone();
        // A train step returns the loss before its update.
        f64::from(m.train_step(batch))
    }

    #[test]
    fn gradients_match_finite_differences() {
        let model = Model::new(40, 7);
        let batch = model.batch(7, 0, 0);
        // Analytic gradient of one weight of each dense tensor, read back from Adam's first
        // moment after one step: m = (1 - beta1) * g.
        let mut stepped = model.clone();
        stepped.train_step(&batch);
        for (which, idx) in [(1usize, 5usize), (1, 1000), (3, 17), (3, 2000), (4, 3)] {
            let g = f64::from(stepped.params()[which].m[idx]) / f64::from(1.0 - BETA1);
            let h = 1e-2f32;
            let mut plus = model.clone();
            plus.params_mut()[which].value[idx] += h;
            let mut minus = model.clone();
            minus.params_mut()[which].value[idx] -= h;
            let numeric = (loss_of(&plus, &batch) - loss_of(&minus, &batch)) / (2.0 * f64::from(h));
            assert!(
                (g - numeric).abs() <= 2e-3 + 0.05 * numeric.abs(),
                "{} [{idx}]: analytic {g} vs numeric {numeric}",
                model.params()[which].name
            );
        }
    }

    #[test]
    fn training_is_deterministic_and_learns() {
        let mut a = Model::new(64, 3);
        let mut b = Model::new(64, 3);
        let mut first = 0.0;
        let mut last = 0.0;
        for step in 0..150 {
            let batch = a.batch(3, 1, step);
            let la = a.train_step(&batch);
            let lb = b.train_step(&b.batch(3, 1, step));
            assert_eq!(la.to_bits(), lb.to_bits(), "step {step}");
            if step == 0 {
                first = la;
            }
            last = la;
        }
        assert!(a == b, "same seed, same steps: same bits");
        assert!(last < first * 0.5, "the loss falls: {first} -> {last}");
    }

    #[test]
    fn state_size_follows_the_request() {
        let rows = Model::rows_for(64 << 20);
        let m = Model::new(rows, 1);
        let bytes = m.state_bytes();
        assert!(
            bytes <= 64 << 20 && bytes > (64 << 20) - 12 * DIM as u64 * 2,
            "{bytes}"
        );
    }
}
