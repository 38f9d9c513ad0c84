//! Gated DeltaNet, the linear attention of Qwen3.5, tensor-parallel by head.
//!
//! in_proj_qkv, then a depthwise causal convolution over [q | k | v] (silu), per-head L2
//! normalised q and k, and the gated delta rule: a per-head [key_dim, value_dim] memory that
//! decays by exp(g) every token and is corrected towards each new value with strength beta; its
//! read-out goes through an RMSNorm (plain w) gated by silu(z), then out_proj.
//!
//! A rank owns an equal share of the value heads and the key heads they read: the fused
//! [q | k | v] rows of in_proj_qkv and the conv channels are cut region by region, in_proj_z,
//! in_proj_b, in_proj_a, A_log and dt_bias by value head; out_proj is row-parallel (one
//! all-reduce). The conv history and the memory live per sequence in the rank's cache
//! ([`RecurrentState`]). A prefill runs the chunked form of the rule (blocks of 64 tokens, as
//! transformers' torch_chunk_gated_delta_rule), a decode step the recurrent form.

use std::ops::Range;

use anyhow::{Result, bail};
use candle_core::{D, DType, Device, Tensor};

use super::SequenceInput;
use super::cache::{LayerCache, RecurrentState};
use super::config::ModelConfig;
use super::layers::{NormWeight, RmsNorm};
use super::loader::ShardLoader;
use super::parallel::{ColumnParallelLinear, RowParallelLinear, RowSlice, TpGroup};
use super::placement::Placement;
use super::quant::Weight;

/// Tokens per block of the chunked delta rule (as transformers' torch_chunk_gated_delta_rule).
const CHUNK: usize = 64;
/// The epsilon of the q/k L2 normalisation, as in the FLA kernels.
const L2_EPS: f64 = 1e-6;

/// Shape of the Gated DeltaNet layers.
#[derive(Debug, Clone)]
pub struct LinearConfig {
    pub conv_kernel: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub num_key_heads: usize,
    pub num_value_heads: usize,
}

/// Which linear-attention heads a rank owns: an equal share of the value heads, and the key
/// heads they read. Value head v reads key head v / (value heads per key head), so a rank's key
/// heads are contiguous too; when a key head's group of value heads straddles two ranks, both
/// hold it.
#[derive(Debug, Clone)]
pub struct LinearHeads {
    first_value: usize,
    local_values: usize,
    first_key: usize,
    local_keys: usize,
    /// for every local value head, the local index of the key head it reads
    key_of_value: Vec<u32>,
}

impl LinearHeads {
    pub fn new(group: &TpGroup, config: &LinearConfig) -> Result<Self> {
        let values = group.part("linear_num_value_heads", config.num_value_heads)?;
        let per_key = config.num_value_heads / config.num_key_heads;
        let first_key = values.start / per_key;
        let last_key = (values.end - 1) / per_key;
        let key_of_value = values.clone().map(|v| (v / per_key - first_key) as u32).collect();
        Ok(Self {
            first_value: values.start,
            local_values: values.len(),
            first_key,
            local_keys: last_key - first_key + 1,
            key_of_value,
        })
    }

    fn values(&self) -> Range<usize> {
        self.first_value..self.first_value + self.local_values
    }

    fn keys(&self) -> Range<usize> {
        self.first_key..self.first_key + self.local_keys
    }
}

fn scaled(range: Range<usize>, factor: usize, offset: usize) -> Range<usize> {
    offset + range.start * factor..offset + range.end * factor
}

/// A Gated DeltaNet (linear attention) layer: this rank's heads.
pub struct GatedDeltaNet {
    /// this rank's rows of in_proj_qkv ([q | k | v] of its heads), in_proj_z, in_proj_b, in_proj_a
    in_proj: ColumnParallelLinear,
    /// depthwise causal convolution over the local [q | k | v] channels, [kernel, channels]:
    /// one row per tap, so a tap is one broadcast multiply over the tokens
    conv: Tensor,
    /// -exp(A_log) per local value head, [local value heads] f32 on the layer's device (see
    /// `gates`: tensor ops on a GPU, a host loop on a CPU)
    neg_a: Tensor,
    /// [local value heads] f32
    dt_bias: Tensor,
    /// the gated norm scales by plain w
    norm: RmsNorm,
    out_proj: RowParallelLinear,
    heads: LinearHeads,
    key_of_value: Tensor, // [local value heads] u32
    key_head_dim: usize,
    value_head_dim: usize,
    kernel: usize,
    drop_conv_state: bool,
}

impl GatedDeltaNet {
    pub fn load(
        loader: &ShardLoader,
        group: &TpGroup,
        config: &ModelConfig,
        linear: &LinearConfig,
        drop_conv_state: bool,
    ) -> Result<Self> {
        let heads = LinearHeads::new(group, linear)?;
        let (dk, dv, kernel) = (linear.key_head_dim, linear.value_head_dim, linear.conv_kernel);
        let key_dim = linear.num_key_heads * dk;
        let value_dim = linear.num_value_heads * dv;
        let conv_dim = 2 * key_dim + value_dim;
        // The fused [q | k | v] rows, and the conv channels that follow them, cut region by region.
        let channels = vec![
            scaled(heads.keys(), dk, 0),
            scaled(heads.keys(), dk, key_dim),
            scaled(heads.values(), dv, 2 * key_dim),
        ];
        let value_rows = scaled(heads.values(), dv, 0);
        let nv = linear.num_value_heads;
        let in_proj = ColumnParallelLinear::load_fused(
            loader,
            &[
                (RowSlice { name: "in_proj_qkv", rows: channels.clone() }, conv_dim),
                (RowSlice { name: "in_proj_z", rows: vec![value_rows.clone()] }, value_dim),
                (RowSlice { name: "in_proj_b", rows: vec![heads.values()] }, nv),
                (RowSlice { name: "in_proj_a", rows: vec![heads.values()] }, nv),
            ],
            config.hidden_size,
            false,
        )?;
        let local_channels: usize = channels.iter().map(|r| r.len()).sum();
        let conv = loader
            .slice("conv1d.weight", &[conv_dim, 1, kernel], 0, &channels)?
            .reshape((local_channels, kernel))?
            .t()?
            .contiguous()?;
        let per_head = |name: &str| -> Result<Tensor> { Ok(loader.slice(name, &[nv], 0, &[heads.values()])?.to_dtype(DType::F32)?) };
        let neg_a = per_head("A_log")?.exp()?.neg()?;
        let dt_bias = per_head("dt_bias")?;
        let norm = RmsNorm::load(loader, "norm", dv, config.rms_norm_eps, NormWeight::Plain)?;
        let out_proj =
            RowParallelLinear::load_columns(loader, group, "out_proj", config.hidden_size, value_dim, &[value_rows], false)?;
        let key_of_value = Tensor::new(heads.key_of_value.as_slice(), loader.device())?;
        Ok(Self {
            in_proj,
            conv,
            neg_a,
            dt_bias,
            norm,
            out_proj,
            heads,
            key_of_value,
            key_head_dim: dk,
            value_head_dim: dv,
            kernel,
            drop_conv_state,
        })
    }

    pub fn weights(&self) -> Vec<&Tensor> {
        let mut all = self.in_proj.weights();
        all.extend([&self.conv, self.norm.weight()]);
        all.extend(self.out_proj.weights());
        all
    }

    /// Its matrices, to gather with the other layers' (`super::arena`).
    pub fn matrices_mut(&mut self) -> Vec<&mut Weight> {
        vec![self.in_proj.weight_mut(), self.out_proj.weight_mut()]
    }

    /// Bytes of one sequence's state in this layer: the conv history (`compute` bytes per
    /// element) and the f32 memory.
    pub fn state_bytes(&self, compute: usize) -> usize {
        let channels = self.conv.dims().get(1).copied().unwrap_or(0);
        let history = (self.kernel - 1) * channels * compute;
        history + self.heads.local_values * self.key_head_dim * self.value_head_dim * DType::F32.size_in_bytes()
    }

    /// x [tokens, hidden] -> [tokens, hidden]; `caches` are this layer's caches, one per sequence.
    pub fn forward(&self, x: &Tensor, batch: &[SequenceInput<'_>], caches: &mut [&mut LayerCache]) -> Result<Tensor> {
        let tokens = x.dim(0)?;
        let (heads, dv) = (self.heads.local_values, self.value_head_dim);
        let parts = self.in_proj.forward_split(x)?;
        let (mixed, z) = (&parts[0], &parts[1]);
        let (beta, g) = self.gates(&parts[2], &parts[3])?;

        let mut outputs = Vec::with_capacity(batch.len());
        let mut offset = 0;
        for (seq, cache) in batch.iter().zip(caches.iter_mut()) {
            let n = seq.tokens.len();
            let LayerCache::Recurrent(state) = &mut **cache else {
                bail!("sequence {}: a linear-attention layer was given an attention cache", seq.seq_id);
            };
            let mixed = self.convolve(&mixed.narrow(0, offset, n)?, state)?;
            let (q, k, v) = self.split_heads(&mixed)?;
            let (beta, g) = (beta.narrow(0, offset, n)?, g.narrow(0, offset, n)?); // [n, heads]
            let memory = match state.memory.take() {
                Some(memory) => memory,
                None => Tensor::zeros((heads, self.key_head_dim, dv), DType::F32, x.device())?,
            };
            let (out, memory) = if n == 1 {
                recurrent_step(&q, &k, &v, &beta, &g, &memory)?
            } else {
                chunked_delta_rule(&q, &k, &v, &beta, &g, memory, Placement::of(x.device()))?
            };
            state.memory = Some(memory);
            outputs.push(out.transpose(0, 1)?); // [n, heads, dv]
            offset += n;
        }
        let core = Tensor::cat(&outputs, 0)?.to_dtype(x.dtype())?; // [tokens, heads, dv]
        let z = z.reshape((tokens, heads, dv))?;
        let gated = (self.norm.forward(&core)? * candle_nn::ops::silu(&z)?)?;
        self.out_proj.forward(&gated.reshape((tokens, heads * dv))?)
    }

    /// beta = sigmoid(b) and the log-decay g = -exp(A_log) * softplus(a + dt_bias), f32
    /// [tokens, local value heads] on the layer's device.
    ///
    /// On a GPU these are tensor ops, so nothing goes through the host. On a CPU one loop over
    /// the few values beats eight small tensor ops (a decode step of a small hybrid model was 20%
    /// slower with them; see [`Placement`]); the tests hold both to each other.
    fn gates(&self, b: &Tensor, a: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, a) = (b.to_dtype(DType::F32)?, a.to_dtype(DType::F32)?);
        if Placement::of(b.device()) == Placement::Device {
            let beta = candle_nn::ops::sigmoid(&b)?;
            let g = softplus(&a.broadcast_add(&self.dt_bias)?)?.broadcast_mul(&self.neg_a)?;
            return Ok((beta, g));
        }
        let shape = b.shape().clone();
        let beta: Vec<f32> = b.flatten_all()?.to_vec1::<f32>()?.into_iter().map(|b| 1.0 / (1.0 + (-b).exp())).collect();
        let (neg_a, dt_bias) = (self.neg_a.to_vec1::<f32>()?, self.dt_bias.to_vec1::<f32>()?);
        let heads = neg_a.len();
        let a = a.flatten_all()?.to_vec1::<f32>()?;
        let g = a.iter().enumerate().map(|(i, &a)| neg_a[i % heads] * softplus_f32(a + dt_bias[i % heads])).collect();
        Ok((Tensor::from_vec(beta, &shape, b.device())?, Tensor::from_vec(g, &shape, b.device())?))
    }

    /// The causal depthwise convolution of one sequence's new [q | k | v] channels x
    /// [n, channels], continuing from the `kernel - 1` inputs before them; silu applied.
    fn convolve(&self, x: &Tensor, state: &mut RecurrentState) -> Result<Tensor> {
        let n = x.dim(0)?;
        let history_len = self.kernel - 1;
        let history = match &state.conv {
            // The deliberate fault: a prefill chunk forgets the chunk before it.
            Some(_) if self.drop_conv_state && n > 1 => None,
            history => history.clone(),
        };
        let padded = match history {
            Some(history) => Tensor::cat(&[&history, x], 0)?,
            None if history_len > 0 => {
                Tensor::cat(&[&Tensor::zeros((history_len, x.dim(1)?), x.dtype(), x.device())?, x], 0)?
            }
            None => x.clone(),
        }; // [history_len + n, channels]
        let mut out = padded.narrow(0, 0, n)?.broadcast_mul(&self.conv.get(0)?)?;
        for tap in 1..self.kernel {
            out = (out + padded.narrow(0, tap, n)?.broadcast_mul(&self.conv.get(tap)?)?)?;
        }
        if history_len > 0 {
            state.conv = Some(padded.narrow(0, n, history_len)?.contiguous()?);
        }
        Ok(candle_nn::ops::silu(&out)?)
    }

    /// The convolved channels [n, channels] as f32 per value head: q (L2-normalised and scaled
    /// by 1/sqrt(key_head_dim)) and k (L2-normalised) [heads, n, key_head_dim], v [heads, n,
    /// value_head_dim]. Key heads are repeated for the value heads that read them.
    fn split_heads(&self, mixed: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let n = mixed.dim(0)?;
        let (dk, dv) = (self.key_head_dim, self.value_head_dim);
        let (keys, values) = (self.heads.local_keys, self.heads.local_values);
        let mixed = mixed.to_dtype(DType::F32)?;
        let per_value_head = |t: Tensor| -> Result<Tensor> {
            let t = l2_normalize(&t.reshape((n, keys, dk))?)?;
            Ok(t.index_select(&self.key_of_value, 1)?.transpose(0, 1)?.contiguous()?)
        };
        let q = (per_value_head(mixed.narrow(1, 0, keys * dk)?)? * (1.0 / (dk as f64).sqrt()))?;
        let k = per_value_head(mixed.narrow(1, keys * dk, keys * dk)?)?;
        let v = mixed.narrow(1, 2 * keys * dk, values * dv)?.reshape((n, values, dv))?.transpose(0, 1)?.contiguous()?;
        Ok((q, k, v))
    }
}

/// torch's softplus (beta 1, threshold 20).
fn softplus_f32(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// [`softplus_f32`] element-wise as tensor ops: ln(1 + e^x), or x above 20.
fn softplus(x: &Tensor) -> Result<Tensor> {
    let smooth = (x.exp()? + 1.0)?.log()?;
    Ok(x.gt(20.0)?.where_cond(x, &smooth)?)
}

/// x / sqrt(sum(x^2) + eps) over the last dimension.
fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    let norm = (x.sqr()?.sum_keepdim(D::Minus1)? + L2_EPS)?.sqrt()?;
    Ok(x.broadcast_div(&norm)?)
}

/// One token of the gated delta rule. q, k [heads, 1, dk]; v [heads, 1, dv]; beta and g [1,
/// heads] on q's device; memory [heads, dk, dv]. Returns the output [heads, 1, dv] and the new
/// memory.
fn recurrent_step(q: &Tensor, k: &Tensor, v: &Tensor, beta: &Tensor, g: &Tensor, memory: &Tensor) -> Result<(Tensor, Tensor)> {
    let heads = q.dim(0)?;
    let decay = g.exp()?.reshape((heads, 1, 1))?;
    let beta = beta.reshape((heads, 1, 1))?;
    let memory = memory.broadcast_mul(&decay)?;
    // What the memory already predicts for k; only the correction towards v is written.
    let predicted = k.matmul(&memory)?; // [heads, 1, dv]
    let delta = (v - predicted)?.broadcast_mul(&beta)?;
    let memory = (memory + k.transpose(1, 2)?.matmul(&delta)?)?;
    let out = q.matmul(&memory)?;
    Ok((out, memory))
}

/// The gated delta rule over n tokens in blocks of up to [`CHUNK`] (as transformers'
/// torch_chunk_gated_delta_rule). Within a block the sequential updates collapse into a unit
/// lower-triangular system (the UT transform of the DeltaNet paper). The systems do not depend
/// on the memory, so a group of equal blocks is built and solved in one batch; only the
/// memory's carry runs block by block. Same inputs as [`recurrent_step`] with n tokens (beta and
/// g [n, heads]); returns the output [heads, n, dv] and the new memory. `placement` says where
/// the decay matrices and the solve are computed, and how blocks are grouped ([`BlockGroup`]).
fn chunked_delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    beta: &Tensor,
    g: &Tensor,
    mut memory: Tensor,
    placement: Placement,
) -> Result<(Tensor, Tensor)> {
    let mut outputs = Vec::new();
    for group in BlockGroup::cover(q.dim(1)?, placement) {
        let tokens = |t: &Tensor, dim: usize| t.narrow(dim, group.start, group.count * group.len);
        let (q, k, v) = (group.split(&tokens(q, 1)?)?, group.split(&tokens(k, 1)?)?, group.split(&tokens(v, 1)?)?);
        let gates = ChunkGates::new(&tokens(beta, 0)?, &tokens(g, 0)?, &group, placement)?;
        memory = delta_rule_blocks(&q, &k, &v, &gates, memory, placement, &mut outputs)?;
    }
    Ok((Tensor::cat(&outputs, 1)?, memory))
}

/// One group's blocks: q, k [blocks * heads, len, dk] and v [.., dv] block-major, as
/// [`BlockGroup::split`] makes them. Pushes each block's output [heads, len, dv] and returns the
/// memory after the last block.
fn delta_rule_blocks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gates: &ChunkGates,
    mut memory: Tensor,
    placement: Placement,
    outputs: &mut Vec<Tensor>,
) -> Result<Tensor> {
    let heads = memory.dim(0)?;
    let k_t = k.transpose(1, 2)?;
    let k_beta = k.broadcast_mul(&gates.beta)?;
    let v_beta = v.broadcast_mul(&gates.beta)?;
    // system[i, j] (j < i): how much token j's update changes what token i's key reads.
    let system = (k_beta.matmul(&k_t)? * &gates.decay)?;
    let [new_values, decayed_keys] =
        solve_unit_lower(&system, [&v_beta, &k_beta.broadcast_mul(&gates.cum_decay)?], placement)?;
    let intra = (q.matmul(&k_t)? * &gates.decay)?; // causal, decayed q.k within each block
    let q_decayed = q.broadcast_mul(&gates.cum_decay)?;
    let k_to_end_t = k.broadcast_mul(&gates.decay_to_end)?.transpose(1, 2)?;
    for block in 0..q.dim(0)? / heads {
        let at = |t: &Tensor| t.narrow(0, block * heads, heads);
        // The part of each update the memory from earlier blocks already predicts is removed.
        let v_new = (at(&new_values)? - at(&decayed_keys)?.matmul(&memory)?)?;
        outputs.push((at(&q_decayed)?.matmul(&memory)? + at(&intra)?.matmul(&v_new)?)?);
        memory = (memory.broadcast_mul(&at(&gates.block_decay)?)? + at(&k_to_end_t)?.matmul(&v_new)?)?;
    }
    Ok(memory)
}

/// `count` consecutive blocks of `len` tokens from token `start`, built and solved as one batch.
#[derive(Debug, PartialEq, Eq)]
struct BlockGroup {
    start: usize,
    count: usize,
    len: usize,
}

impl BlockGroup {
    /// The groups that cover n tokens in blocks of up to [`CHUNK`]. On a GPU: all full blocks
    /// in one group and the shorter last block in another, so a long prompt costs a few dozen
    /// kernel launches, not a few dozen per block. On a CPU: a group per block, as small work
    /// sets (a 64-token block's matrices are 16 KiB per head) run faster there than batches
    /// large enough to be mapped fresh from the kernel every time (a form that batched every
    /// block, the last one padded, made a 200-token prefill of the hybrid fixture 1.7x slower).
    fn cover(n: usize, placement: Placement) -> Vec<Self> {
        let (full, rest) = (n / CHUNK, n % CHUNK);
        let mut groups: Vec<Self> = match placement {
            Placement::Device if full > 0 => vec![Self { start: 0, count: full, len: CHUNK }],
            Placement::Device => Vec::new(),
            Placement::Host => (0..full).map(|b| Self { start: b * CHUNK, count: 1, len: CHUNK }).collect(),
        };
        if rest > 0 {
            groups.push(Self { start: full * CHUNK, count: 1, len: rest });
        }
        groups
    }

    /// x [heads, count * len, d] -> [count * heads, len, d], block-major: block b is rows
    /// b * heads.. of the batch, so the carry loop takes each block as one slice. A single
    /// block is `x` itself, uncopied: matmuls take its row stride as it is.
    fn split(&self, x: &Tensor) -> Result<Tensor> {
        if self.count == 1 {
            return Ok(x.clone());
        }
        let (heads, _, d) = x.dims3()?;
        let x = x.reshape((heads, self.count, self.len, d))?.transpose(0, 1)?;
        Ok(x.contiguous()?.reshape((self.count * heads, self.len, d))?)
    }

    /// A gate [count * len, heads] -> [count * heads, len], in the order of [`Self::split`].
    fn split_gate(&self, x: &Tensor) -> Result<Tensor> {
        let heads = x.dim(1)?;
        let x = x.reshape((self.count, self.len, heads))?.transpose(1, 2)?;
        Ok(x.contiguous()?.reshape((self.count * heads, self.len))?)
    }
}

/// The per-token gates of every (block, head) row, as tensors.
struct ChunkGates {
    beta: Tensor,         // [rows, len, 1]
    /// exp(G_i - G_j) for j <= i, else 0, where G is the cumulative log-decay: [rows, len, len]
    decay: Tensor,
    cum_decay: Tensor,    // exp(G_i) [rows, len, 1]
    decay_to_end: Tensor, // exp(G_last - G_i) [rows, len, 1]
    block_decay: Tensor,  // exp(G_last) [rows, 1, 1]
}

impl ChunkGates {
    /// The gates of a group's tokens, `beta` and `g` [count * len, heads] token-major, as rows
    /// per (block, head) in the order of [`BlockGroup::split`].
    fn new(beta: &Tensor, g: &Tensor, group: &BlockGroup, placement: Placement) -> Result<Self> {
        match placement {
            Placement::Host => Self::on_host(beta, g, group.len),
            Placement::Device => Self::with_tensor_ops(group.split_gate(beta)?.unsqueeze(2)?, &group.split_gate(g)?),
        }
    }

    /// The cumulative sums and exponentials as host loops, reading the token-major gates in
    /// place (no transposing op first).
    fn on_host(beta: &Tensor, g: &Tensor, len: usize) -> Result<Self> {
        let (heads, device) = (g.dim(1)?, g.device());
        let (beta, g) = (beta.flatten_all()?.to_vec1::<f32>()?, g.flatten_all()?.to_vec1::<f32>()?);
        let rows = g.len() / len;
        // Row (block, head) reads the token-major gates from here, every `heads` values.
        let row_start = |row: usize| (row / heads) * len * heads + row % heads;
        let mut cum = vec![0f32; rows * len];
        for (row, cum) in cum.chunks_exact_mut(len).enumerate() {
            let mut total = 0f32;
            for (cum, g) in cum.iter_mut().zip(g[row_start(row)..].iter().step_by(heads)) {
                total += g;
                *cum = total;
            }
        }
        let mut decay = vec![0f32; rows * len * len];
        for (cum, decay) in cum.chunks_exact(len).zip(decay.chunks_exact_mut(len * len)) {
            for i in 0..len {
                for j in 0..=i {
                    decay[i * len + j] = (cum[i] - cum[j]).exp();
                }
            }
        }
        let last = |row: usize| cum[row * len + len - 1];
        let cum_decay = cum.iter().map(|c| c.exp()).collect();
        let decay_to_end = (0..rows * len).map(|i| (last(i / len) - cum[i]).exp()).collect();
        let block_decay = (0..rows).map(|row| last(row).exp()).collect();
        let mut beta_rows: Vec<f32> = Vec::with_capacity(rows * len);
        for row in 0..rows {
            beta_rows.extend(beta[row_start(row)..].iter().step_by(heads).take(len));
        }
        Ok(Self {
            beta: Tensor::from_vec(beta_rows, (rows, len, 1), device)?,
            decay: Tensor::from_vec(decay, (rows, len, len), device)?,
            cum_decay: Tensor::from_vec(cum_decay, (rows, len, 1), device)?,
            decay_to_end: Tensor::from_vec(decay_to_end, (rows, len, 1), device)?,
            block_decay: Tensor::from_vec(block_decay, (rows, 1, 1), device)?,
        })
    }

    /// The same on the gates' device: a cumulative sum (a matmul with a triangle of ones) and
    /// the pairwise differences under a causal mask.
    fn with_tensor_ops(beta: Tensor, g: &Tensor) -> Result<Self> {
        let (rows, len) = g.dims2()?;
        let cum = g.cumsum(1)?; // [rows, len]
        let differences = cum.unsqueeze(2)?.broadcast_sub(&cum.unsqueeze(1)?)?; // G_i - G_j
        // Above the diagonal G_i - G_j is positive and may overflow exp; -inf there gives 0.
        let causal = lower_triangle(len, g.device())?.broadcast_as((rows, len, len))?;
        let blocked = Tensor::full(f32::NEG_INFINITY, (rows, len, len), g.device())?;
        let decay = causal.where_cond(&differences, &blocked)?.exp()?;
        let last = cum.narrow(1, len - 1, 1)?; // [rows, 1]
        Ok(Self {
            beta,
            decay,
            cum_decay: cum.exp()?.unsqueeze(2)?,
            decay_to_end: last.broadcast_sub(&cum)?.exp()?.unsqueeze(2)?,
            block_decay: last.exp()?.unsqueeze(2)?,
        })
    }
}

/// [len, len] u8 on `device`: 1 where j <= i.
fn lower_triangle(len: usize, device: &Device) -> Result<Tensor> {
    let positions = Tensor::arange(0u32, len as u32, device)?;
    Ok(positions.unsqueeze(1)?.broadcast_ge(&positions.unsqueeze(0)?)?)
}

/// Solves (I + L) X = B per batch row for two right-hand sides B [batch, len, m_i], where L is
/// the strictly lower triangle of `system` [batch, len, len] (its diagonal and upper triangle
/// are ignored, as in torch's solve_triangular(unitriangular=True)).
fn solve_unit_lower(system: &Tensor, rhs: [&Tensor; 2], placement: Placement) -> Result<[Tensor; 2]> {
    match placement {
        Placement::Host => {
            // One substitution over both, side by side; the CPU's gemm reads the column slices
            // of the result as they are.
            let width = rhs[0].dim(2)?;
            let solved = solve_unit_lower_on_host(system, &Tensor::cat(&rhs, 2)?)?;
            Ok([solved.narrow(2, 0, width)?, solved.narrow(2, width, rhs[1].dim(2)?)?])
        }
        Placement::Device => {
            let inverse = unit_lower_inverse(system)?;
            Ok([inverse.matmul(rhs[0])?, inverse.matmul(rhs[1])?])
        }
    }
}

/// [`solve_unit_lower`] by forward substitution, row by row.
fn solve_unit_lower_on_host(system: &Tensor, rhs: &Tensor) -> Result<Tensor> {
    let (batch, len, m) = rhs.dims3()?;
    let a = system.flatten_all()?.to_vec1::<f32>()?;
    let mut x = rhs.flatten_all()?.to_vec1::<f32>()?;
    for h in 0..batch {
        let a = &a[h * len * len..(h + 1) * len * len];
        let x = &mut x[h * len * m..(h + 1) * len * m];
        for i in 1..len {
            let (solved, rest) = x.split_at_mut(i * m);
            let row = &mut rest[..m];
            for j in 0..i {
                let coefficient = a[i * len + j];
                for (target, source) in row.iter_mut().zip(&solved[j * m..(j + 1) * m]) {
                    *target -= coefficient * source;
                }
            }
        }
    }
    Ok(Tensor::from_vec(x, (batch, len, m), rhs.device())?)
}

/// (I + L)^-1 per batch row, L the strictly lower triangle of `system` [batch, len, len], in
/// tensor ops: the matrix is padded to a power of two (with zeros, whose inverse is the
/// identity) and inverted by halves.
fn unit_lower_inverse(system: &Tensor) -> Result<Tensor> {
    let len = system.dim(1)?;
    let padding = len.next_power_of_two() - len;
    if padding == 0 {
        return inverse_by_halves(system);
    }
    let padded = system.pad_with_zeros(1, 0, padding)?.pad_with_zeros(2, 0, padding)?;
    // Contiguous: the corner's rows are further apart than its width (see chunked_delta_rule).
    Ok(inverse_by_halves(&padded)?.narrow(1, 0, len)?.narrow(2, 0, len)?.contiguous()?)
}

/// The inverse of a unit lower-triangular [[A, 0], [C, D]] is [[A', 0], [-D' C A', D']], where
/// A' and D' invert A and D. Both halves recurse as one batch, so a 64-token block takes six
/// levels of a few batched ops each, where forward substitution would take 63 steps. Every
/// intermediate is a block of the true inverse, or one such block times C, so it is as stable
/// as substitution. (The shorter product (I - N)(I + N^2)(I + N^4)... is not: the powers of a
/// nilpotent N with entries near 1 reach 1e16 before they cancel, far beyond f32.)
fn inverse_by_halves(system: &Tensor) -> Result<Tensor> {
    let (batch, size, _) = system.dims3()?;
    if size == 1 {
        return Ok(Tensor::ones((batch, 1, 1), system.dtype(), system.device())?);
    }
    let half = size / 2;
    let block = |row: usize, col: usize| system.narrow(1, row, half)?.narrow(2, col, half);
    let inverses = inverse_by_halves(&Tensor::cat(&[block(0, 0)?, block(half, half)?], 0)?)?;
    let (first, second) = (inverses.narrow(0, 0, batch)?, inverses.narrow(0, batch, batch)?);
    let coupling = second.matmul(&block(half, 0)?.contiguous()?)?.matmul(&first)?.neg()?;
    let top = Tensor::cat(&[&first, &first.zeros_like()?], 2)?;
    let bottom = Tensor::cat(&[&coupling, &second], 2)?;
    Ok(Tensor::cat(&[&top, &bottom], 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_hold_the_key_heads_their_value_heads_read() {
        let linear = |keys, values| LinearConfig {
            conv_kernel: 4,
            key_head_dim: 8,
            value_head_dim: 8,
            num_key_heads: keys,
            num_value_heads: values,
        };
        let group = |rank, world_size| TpGroup { rank, world_size, comm: std::sync::Arc::new(crate::comm::SingleRank) };
        // 4 key heads, 8 value heads, TP 2: rank 1 has value heads 4..8, reading key heads 2 and 3.
        let heads = LinearHeads::new(&group(1, 2), &linear(4, 8)).unwrap();
        assert_eq!((heads.values(), heads.keys()), (4..8, 2..4));
        assert_eq!(heads.key_of_value, [0, 0, 1, 1]);
        // 2 key heads, 8 value heads, TP 8: each key head is held by the 4 ranks reading it.
        let heads = LinearHeads::new(&group(5, 8), &linear(2, 8)).unwrap();
        assert_eq!((heads.values(), heads.keys()), (5..6, 1..2));
        // 2 key heads, 6 value heads, TP 3: rank 1 has value heads 2..4, straddling key heads 0 and 1.
        let heads = LinearHeads::new(&group(1, 3), &linear(2, 6)).unwrap();
        assert_eq!((heads.values(), heads.keys()), (2..4, 0..2));
        assert_eq!(heads.key_of_value, [0, 1]);
        let err = LinearHeads::new(&group(0, 3), &linear(4, 8)).unwrap_err();
        assert!(err.to_string().contains("linear_num_value_heads (8)"), "{err}");
    }

    /// The tensor-op softplus (the GPU's gates) equals the host loop's (the CPU's) over the
    /// range gates see, including both sides of the threshold.
    #[test]
    fn tensor_softplus_matches_the_host_one() -> Result<()> {
        let xs: Vec<f32> = (-400..=400).map(|i| i as f32 / 10.0).collect();
        let tensor = softplus(&Tensor::from_vec(xs.clone(), xs.len(), &Device::Cpu)?)?.to_vec1::<f32>()?;
        for (x, got) in xs.iter().zip(tensor) {
            let want = softplus_f32(*x);
            assert!((got - want).abs() <= 1e-6 * (1.0 + want.abs()) + 1e-7, "softplus({x}): {got} vs {want}");
        }
        Ok(())
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar()?)
    }

    /// Random q, k (L2-normalised), v and memory, and varied gates beta [n, heads] in (0.1, 0.9)
    /// and g [n, heads] in (-0.3, 0].
    fn delta_rule_inputs(heads: usize, n: usize, dk: usize, dv: usize) -> Result<[Tensor; 6]> {
        let device = Device::Cpu;
        let q = l2_normalize(&Tensor::randn(0f32, 1.0, (heads, n, dk), &device)?)?;
        let k = l2_normalize(&Tensor::randn(0f32, 1.0, (heads, n, dk), &device)?)?;
        let v = Tensor::randn(0f32, 1.0, (heads, n, dv), &device)?;
        let beta: Vec<f32> = (0..n * heads).map(|i| 0.1 + 0.8 * ((i * 37 % 101) as f32 / 101.0)).collect();
        let g: Vec<f32> = (0..n * heads).map(|i| -0.3 * ((i * 53 % 97) as f32 / 97.0)).collect();
        let memory = Tensor::randn(0f32, 0.5, (heads, dk, dv), &device)?;
        let beta = Tensor::from_vec(beta, (n, heads), &device)?;
        let g = Tensor::from_vec(g, (n, heads), &device)?;
        Ok([q, k, v, beta, g, memory])
    }

    /// The chunked form is the recurrent form reorganised: over several blocks (the last one
    /// shorter) and from a non-zero memory, both give the same outputs and final memory, with the
    /// chunk systems built and solved on the host and with tensor ops.
    #[test]
    fn chunked_delta_rule_equals_token_by_token() -> Result<()> {
        let (heads, n, dk, dv) = (3, 2 * CHUNK + 37, 8, 6);
        let [q, k, v, beta, g, memory] = delta_rule_inputs(heads, n, dk, dv)?;
        let mut stepped = Vec::new();
        let mut stepped_memory = memory.clone();
        for t in 0..n {
            let at = |x: &Tensor| x.narrow(1, t, 1);
            let gate = |x: &Tensor| x.narrow(0, t, 1);
            let (out, next) = recurrent_step(&at(&q)?, &at(&k)?, &at(&v)?, &gate(&beta)?, &gate(&g)?, &stepped_memory)?;
            stepped.push(out);
            stepped_memory = next;
        }
        let stepped = Tensor::cat(&stepped, 1)?;
        for placement in [Placement::Host, Placement::Device] {
            let (chunked, chunked_memory) = chunked_delta_rule(&q, &k, &v, &beta, &g, memory.clone(), placement)?;
            let (out_diff, memory_diff) = (max_diff(&chunked, &stepped)?, max_diff(&chunked_memory, &stepped_memory)?);
            assert!(out_diff < 1e-4, "{placement:?}: outputs differ by {out_diff}");
            assert!(memory_diff < 1e-4, "{placement:?}: memories differ by {memory_diff}");
        }
        Ok(())
    }

    /// The tensor-op form of the chunked rule (a GPU's) equals the host form (a CPU's) to float
    /// rounding, for a prompt shorter than a block, one of exactly a block, and several blocks.
    #[test]
    fn chunked_delta_rule_on_the_device_equals_the_host_one() -> Result<()> {
        for n in [2, 37, CHUNK, 3 * CHUNK + 5] {
            let [q, k, v, beta, g, memory] = delta_rule_inputs(4, n, 16, 16)?;
            let (host, host_memory) = chunked_delta_rule(&q, &k, &v, &beta, &g, memory.clone(), Placement::Host)?;
            let (device, device_memory) = chunked_delta_rule(&q, &k, &v, &beta, &g, memory, Placement::Device)?;
            let (out_diff, memory_diff) = (max_diff(&host, &device)?, max_diff(&host_memory, &device_memory)?);
            println!("{n} tokens: host vs tensor ops, max |output diff| {out_diff:.2e}, max |memory diff| {memory_diff:.2e}");
            assert!(out_diff < 1e-5 && memory_diff < 1e-5, "{n} tokens: {out_diff}, {memory_diff}");
        }
        Ok(())
    }

    #[test]
    fn blocks_group_by_placement_and_cover_every_token() {
        let group = |start, count, len| BlockGroup { start, count, len };
        let n = 3 * CHUNK + 5;
        assert_eq!(BlockGroup::cover(n, Placement::Device), [group(0, 3, CHUNK), group(3 * CHUNK, 1, 5)]);
        assert_eq!(
            BlockGroup::cover(n, Placement::Host),
            [group(0, 1, CHUNK), group(CHUNK, 1, CHUNK), group(2 * CHUNK, 1, CHUNK), group(3 * CHUNK, 1, 5)]
        );
        assert_eq!(BlockGroup::cover(CHUNK, Placement::Device), [group(0, 1, CHUNK)]);
        assert_eq!(BlockGroup::cover(7, Placement::Device), [group(0, 1, 7)]);
        assert_eq!(BlockGroup::cover(7, Placement::Host), [group(0, 1, 7)]);
    }

    /// Both chunk-gate forms give the same gates for a group of blocks, including the zeros
    /// above the diagonal where exp(G_i - G_j) would overflow (a steep log-decay).
    #[test]
    fn chunk_gates_agree_on_host_and_device() -> Result<()> {
        let (heads, group) = (3, BlockGroup { start: 0, count: 2, len: 48 });
        let tokens = group.count * group.len;
        let g: Vec<f32> = (0..tokens * heads).map(|i| -6.0 * ((i * 29 % 83) as f32 / 83.0)).collect();
        let g = Tensor::from_vec(g, (tokens, heads), &Device::Cpu)?;
        let beta = Tensor::rand(0f32, 1.0, (tokens, heads), &Device::Cpu)?;
        let host = ChunkGates::new(&beta, &g, &group, Placement::Host)?;
        let device = ChunkGates::new(&beta, &g, &group, Placement::Device)?;
        assert!(device.decay.flatten_all()?.to_vec1::<f32>()?.iter().all(|d| d.is_finite()));
        assert_eq!(host.beta.to_vec3::<f32>()?, device.beta.to_vec3::<f32>()?);
        for (name, a, b) in [
            ("decay", &host.decay, &device.decay),
            ("cum_decay", &host.cum_decay, &device.cum_decay),
            ("decay_to_end", &host.decay_to_end, &device.decay_to_end),
            ("block_decay", &host.block_decay, &device.block_decay),
        ] {
            assert_eq!(a.dims(), b.dims(), "{name}");
            // Relative: the decays span many orders of magnitude.
            let relative = ((a - b)?.abs()? / (a.abs()? + 1e-30)?)?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(relative < 1e-4, "{name}: relative difference {relative}");
        }
        Ok(())
    }

    /// The inverse by halves solves what forward substitution solves, also for systems whose
    /// inverse has large entries (strictly lower entries near -1 and near 1), where the powers
    /// of the strictly lower part overflow f32's precision.
    #[test]
    fn inverse_by_halves_matches_forward_substitution() -> Result<()> {
        let device = Device::Cpu;
        for (len, scale) in [(1, 0.5f32), (5, 0.9), (37, 0.9), (64, 0.9), (64, -0.9), (64, 0.3)] {
            let entries = Tensor::rand(0.5f32, 1.0, (3, len, len), &device)?;
            let system = (entries * scale as f64)?; // diagonal and upper triangle ignored
            let rhs = Tensor::randn(0f32, 1.0, (3, len, 7), &device)?;
            let substituted = solve_unit_lower_on_host(&system, &rhs)?;
            let inverted = unit_lower_inverse(&system)?.matmul(&rhs)?;
            let size = substituted.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            let diff = max_diff(&substituted, &inverted)?;
            println!("len {len}, scale {scale}: solution up to {size:.2e}, max |difference| {diff:.2e}");
            assert!(diff <= 1e-4 * (1.0 + size), "len {len}, scale {scale}: differ by {diff} (solution up to {size})");
        }
        Ok(())
    }
}
