//! The attention kernel every family uses: causal scaled-dot-product attention of one
//! sequence's new tokens against its cached keys and values, with grouped-query heads.
//!
//! Two forms: [`attend`] over a history gathered into one tensor (every step on a GPU), and, on
//! a CPU, the kernels [`attend_one`] and `attend_rows` (`tpserve_kernels::attention`), which read
//! the paged cache's blocks in place, one query row or a tile of a prompt's rows at a time. A
//! decode step of a batch otherwise copies
//! every sequence's whole history per layer and runs two tiny matmuls through a general gemm: at
//! 16 sequences those copies were a tenth of the step. A prompt's rows go through the same
//! arithmetic, each against the positions it may see: through gemm, a 2,048-token prompt's attention
//! was half its prefill, most of it spent on masked scores, large temporaries and their page
//! faults, and a scalar softmax. One row's arithmetic is then the same in a prompt as in a decode
//! step.

use anyhow::{Result, bail};
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;
use tpserve_kernels::attention::{self as kernel, HostBlock, KvElement, Spread, attend_one, visible_prefix};
use tpserve_kernels::norm::{rms_norm_rows, rope_heads};

use super::SequenceInput;
use super::paged::{HostHistories, LayerBlocks};
use super::placement::Placement;

/// Attention for every sequence of a step: writes each one's new keys and values `k`, `v`
/// [kv_heads, tokens, head_dim] into its blocks, then attends its queries over its history.
/// q [q_heads, tokens, head_dim], the sequences' tokens in batch order; returns [tokens,
/// q_heads * head_dim].
///
/// On a CPU every sequence reads its history in place, after all of the step's writes; on a GPU
/// each gathers its own.
pub fn attend_batch(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: &[SequenceInput<'_>],
    blocks: &mut LayerBlocks,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let on_host = Placement::of(q.device()) == Placement::Host && q.dtype() == DType::F32;
    let mut outputs = Vec::with_capacity(batch.len());
    let mut offset = 0;
    for seq in batch {
        let n = seq.tokens.len();
        let (k, v) = (k.narrow(1, offset, n)?, v.narrow(1, offset, n)?);
        if on_host {
            blocks.write(seq.blocks, seq.start_pos, &k, &v)?;
        } else {
            let (keys_t, values) = blocks.append(seq.blocks, seq.start_pos, &k, &v)?;
            outputs.push(attend(&q.narrow(1, offset, n)?, &keys_t, &values, seq.start_pos, kv_heads, head_dim)?);
        }
        offset += n;
    }
    if on_host {
        if let Some(attended) = attend_on_host(q, batch, blocks, kv_heads, head_dim)? {
            return Ok(attended);
        }
        // Not f32 or f16 blocks on a CPU after all: the gathered form.
        let mut offset = 0;
        for seq in batch {
            let n = seq.tokens.len();
            let (keys_t, values) = blocks.gather(seq.blocks, seq.start_pos + n)?;
            let (keys_t, values) = (keys_t.to_dtype(q.dtype())?, values.to_dtype(q.dtype())?);
            outputs.push(attend(&q.narrow(1, offset, n)?, &keys_t, &values, seq.start_pos, kv_heads, head_dim)?);
            offset += n;
        }
    }
    Ok(Tensor::cat(&outputs, 0)?)
}

/// The step's sequences, their keys and values written, read in place: [tokens, q_heads *
/// head_dim], or None where the blocks are not a CPU's f32 or f16.
fn attend_on_host(q: &Tensor, batch: &[SequenceInput<'_>], blocks: &LayerBlocks, kv_heads: usize, head_dim: usize) -> Result<Option<Tensor>> {
    let tokens = q.dim(1)?;
    let q_rows = q.transpose(0, 1)?.contiguous()?.flatten_all()?.to_vec1::<f32>()?; // [tokens, q_heads, head_dim]
    let attended = attend_rows_in_place(&q_rows, batch, blocks, kv_heads, head_dim)?;
    attended.map(|rows| Ok(Tensor::from_vec(rows, (tokens, q_rows.len() / tokens.max(1)), q.device())?)).transpose()
}

/// The query rows `q_rows` ([tokens, q_heads * head_dim]) of the step's sequences, their keys
/// and values written, against their histories read in place; None where the blocks are not a
/// CPU's f32 or f16.
fn attend_rows_in_place(q_rows: &[f32], batch: &[SequenceInput<'_>], blocks: &LayerBlocks, kv_heads: usize, head_dim: usize) -> Result<Option<Vec<f32>>> {
    let tables: Vec<(&[u32], usize)> = batch.iter().map(|seq| (seq.blocks, seq.start_pos + seq.tokens.len())).collect();
    blocks.host_histories(&tables, |histories| match histories {
        HostHistories::F32(histories) => attend_in_place(q_rows, batch, &histories, kv_heads, head_dim),
        HostHistories::F16(histories) => attend_in_place(q_rows, batch, &histories, kv_heads, head_dim),
    })
}

/// What a layer does to each head of its queries and keys between the qkv product and
/// attention: the RMSNorm of `q_norm` or `k_norm` where the family has them, then RoPE on the
/// first `rotary_dim` dims (the rest pass through). Computes what `RmsNorm::forward` and
/// `Rotary::apply` (candle's `rms_norm` and `rope`) do, element for element, in the same order
/// of operations.
pub struct HeadPrep<'a> {
    pub head_dim: usize,
    pub rotary_dim: usize,
    /// (scale [head_dim], eps)
    pub q_norm: Option<(&'a [f32], f32)>,
    pub k_norm: Option<(&'a [f32], f32)>,
    /// [max_positions, rotary_dim / 2] each
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

impl HeadPrep<'_> {
    /// Every head of `x` (heads of `head_dim`) normed by `norm` and rotated at `position`,
    /// into `out`.
    fn heads(&self, x: &[f32], norm: Option<(&[f32], f32)>, position: usize, out: &mut [f32]) {
        match norm {
            Some((scale, eps)) => rms_norm_rows(x, self.head_dim, scale, eps, out),
            None => out.copy_from_slice(x),
        }
        let half = self.rotary_dim / 2;
        let angles = position * half..(position + 1) * half;
        rope_heads(out, self.head_dim, self.rotary_dim, &self.cos[angles.clone()], &self.sin[angles]);
    }

    /// Positions the tables cover.
    fn max_positions(&self) -> usize {
        self.cos.len() / (self.rotary_dim / 2).max(1)
    }
}

/// Rows of a step at which [`attend_host`] prepares the heads on every thread (as
/// `layers::PARALLEL_NORM_ROWS`).
const PARALLEL_PREP_ROWS: usize = 16;

/// A layer's attention on a CPU from its qkv product `qkv` ([tokens, (q_heads + 2 kv_heads) *
/// head_dim], f32, the sequences' tokens in batch order): the queries' and keys' heads
/// prepared (`prep`), each sequence's new keys and values written into its blocks, every query
/// row attended over its history in place. Returns [tokens * q_heads * head_dim], or None where
/// the blocks are not a CPU's (the caller takes the tensor path, [`attend_batch`]).
///
/// In a 16-sequence decode step of the 100M shape (q8_0) the tensor path spent 0.14 ms a step on
/// the norms, 0.17 on RoPE (their transposes included) and 0.2 on the writes' tensor ops.
pub fn attend_host(qkv: &[f32], batch: &[SequenceInput<'_>], blocks: &mut LayerBlocks, prep: &HeadPrep<'_>, q_heads: usize, kv_heads: usize) -> Result<Option<Vec<f32>>> {
    if !blocks.on_host(DType::F32, &Device::Cpu) {
        return Ok(None);
    }
    let hd = prep.head_dim;
    let (q_width, kv_width) = (q_heads * hd, kv_heads * hd);
    let width = q_width + 2 * kv_width;
    let tokens: usize = batch.iter().map(|seq| seq.tokens.len()).sum();
    if qkv.len() != tokens * width {
        bail!("{} qkv values for {tokens} tokens of {width}", qkv.len());
    }
    let positions: Vec<usize> = batch.iter().flat_map(|seq| seq.start_pos..seq.start_pos + seq.tokens.len()).collect();
    if let Some(&past) = positions.iter().find(|&&p| p >= prep.max_positions()) {
        bail!("position {past} is past the {} positions the RoPE tables cover", prep.max_positions());
    }
    let mut q_rows = vec![0f32; tokens * q_width];
    let mut keys = vec![0f32; tokens * kv_width];
    let prepare = |((row, q_out), k_out): ((&[f32], &mut [f32]), &mut [f32]), position: usize| {
        prep.heads(&row[..q_width], prep.q_norm, position, q_out);
        prep.heads(&row[q_width..q_width + kv_width], prep.k_norm, position, k_out);
    };
    if tokens >= PARALLEL_PREP_ROWS {
        qkv.par_chunks_exact(width).zip(q_rows.par_chunks_exact_mut(q_width)).zip(keys.par_chunks_exact_mut(kv_width)).zip(&positions).for_each(|(rows, &p)| prepare(rows, p));
    } else {
        qkv.chunks_exact(width).zip(q_rows.chunks_exact_mut(q_width)).zip(keys.chunks_exact_mut(kv_width)).zip(&positions).for_each(|(rows, &p)| prepare(rows, p));
    }
    let values: Vec<f32> = qkv.chunks_exact(width).flat_map(|row| &row[q_width + kv_width..]).copied().collect();
    let mut offset = 0;
    for seq in batch {
        let rows = offset * kv_width..(offset + seq.tokens.len()) * kv_width;
        blocks.write_rows(seq.blocks, seq.start_pos, kv_heads, hd, &keys[rows.clone()], &values[rows])?;
        offset += seq.tokens.len();
    }
    attend_rows_in_place(&q_rows, batch, blocks, kv_heads, hd)
}

/// Query rows whose scores `attend_rows` computes together: each chunk of keys read once for
/// their query vectors (16 for two query heads per KV head) while it is in L1.
const ROWS_PER_TILE: usize = 8;

/// One task of [`attend_in_place`]: `rows` query rows of sequence `sequence` from its row
/// `row` (the step's row `token`), for the query heads of KV head `kv`.
struct Task {
    sequence: usize,
    kv: usize,
    row: usize,
    rows: usize,
    token: usize,
}

/// Every row of the step `q` ([tokens, q_heads * head_dim]) against the positions of its
/// sequence's history (`histories`, in batch order) it may see: [tokens * q_heads * head_dim].
///
/// The tasks are (sequence, KV head, tile of [`ROWS_PER_TILE`] rows), in that order, all in
/// one parallel loop, each result copied to its place: a thread's consecutive tasks read the
/// same head's keys and values (2 MiB at 2,048 positions of head_dim 128) while they are in
/// cache. Each row's result is [`attend_one`]'s, bit for bit, however the tasks fall; with few
/// of them (`Spread::Threads`: a decode step at batch 1) the rows go one by one, each spreading a
/// long history's passes over the threads. (One loop in place of a loop per sequence, per KV
/// head and per tile inside one another measured the same: in a 16-sequence decode step of the
/// 100M shape at 64 positions, 1.6 ms of 7.4, the time is the reads of 25 MB of f32 keys and
/// values, which the step's weights have pushed out of the caches; the kernel alone over a
/// cache-resident history takes 0.6 ms, `examples/attention_decode.rs`.)
fn attend_in_place<T: KvElement>(q: &[f32], batch: &[SequenceInput<'_>], histories: &[Vec<HostBlock<'_, T>>], kv_heads: usize, head_dim: usize) -> Vec<f32> {
    let tokens: usize = batch.iter().map(|seq| seq.tokens.len()).sum();
    let width = q.len() / tokens.max(1);
    let per_head = width / kv_heads; // a KV head's query heads' outputs in a row
    let spread = if tokens * kv_heads < 2 * rayon::current_num_threads() { Spread::Threads } else { Spread::Serial };
    let tile = if spread == Spread::Serial { ROWS_PER_TILE } else { 1 };
    let mut tasks = Vec::new();
    let mut token = 0;
    for (sequence, seq) in batch.iter().enumerate() {
        let n = seq.tokens.len();
        for kv in 0..kv_heads {
            for row in (0..n).step_by(tile) {
                tasks.push(Task { sequence, kv, row, rows: tile.min(n - row), token: token + row });
            }
        }
        token += n;
    }
    // One job per task, so that a thread out of work can take any task left (rayon's own
    // pieces ran up to a quarter of the tasks in one go, which no other thread could take). A
    // 16-row step of the 100M shape, both ways alternating step by step in one process, medians
    // of 100: q8_0 5.1%, 3.6% and 0.6% less time, exact bf16 2.5% and the same; one row the
    // same.
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .with_max_len(1)
        .map(|task| {
            let (history, start) = (&histories[task.sequence], batch[task.sequence].start_pos);
            let q = &q[task.token * width..(task.token + task.rows) * width];
            if task.rows == 1 {
                attend_one(q, &visible_prefix(history, start + task.row + 1), kv_heads, head_dim, task.kv, spread)
            } else {
                kernel::attend_rows(q, task.rows, history, start + task.row + 1, kv_heads, head_dim, task.kv)
            }
        })
        .collect();
    let mut out = vec![0f32; tokens * width];
    for (task, result) in tasks.iter().zip(results) {
        for (r, heads) in result.chunks_exact(per_head).enumerate() {
            let at = (task.token + r) * width + task.kv * per_head;
            out[at..at + per_head].copy_from_slice(heads);
        }
    }
    out
}

/// Query rows a prompt's attention takes at a time on a CPU (see [`attend`]).
const QUERY_ROWS_PER_PASS: usize = 128;

/// Causal scaled-dot-product attention of one sequence against its cached history.
/// q [q_heads, n, hd]; keys_t [kv_heads, hd, total] (transposed, as the paged cache gathers
/// them); values [kv_heads, total, hd]; returns [n, q_heads * hd].
///
/// A CPU's f32 cache is read in place instead ([`attend_batch`]). Any other cache on a CPU takes
/// a long prompt [`QUERY_ROWS_PER_PASS`] query rows at a time, each against only the positions
/// those rows may see: in one pass, the scores of a 2,048-token prompt are a [heads, 2048, 2048]
/// tensor per layer (200 MB, newly faulted in, then masked, softmaxed and copied), half of it
/// masked out. The rows' results are those of one pass up to the order of additions (the
/// positions dropped had probability 0).
pub fn attend(
    q: &Tensor,
    keys_t: &Tensor,
    values: &Tensor,
    start_pos: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let n = q.dim(1)?;
    if n <= QUERY_ROWS_PER_PASS || Placement::of(q.device()) != Placement::Host {
        return attend_rows(q, keys_t, values, start_pos, kv_heads, head_dim);
    }
    let mut parts = Vec::with_capacity(n.div_ceil(QUERY_ROWS_PER_PASS));
    for first in (0..n).step_by(QUERY_ROWS_PER_PASS) {
        let rows = QUERY_ROWS_PER_PASS.min(n - first);
        let visible = start_pos + first + rows; // the last row's position, plus one
        let (keys_t, values) = (keys_t.narrow(2, 0, visible)?, values.narrow(1, 0, visible)?);
        parts.push(attend_rows(&q.narrow(1, first, rows)?, &keys_t, &values, start_pos + first, kv_heads, head_dim)?);
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// [`attend`] in one pass over every query row.
fn attend_rows(
    q: &Tensor,
    keys_t: &Tensor,
    values: &Tensor,
    start_pos: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let (q_heads, n, _) = q.dims3()?;
    let total = keys_t.dim(2)?;
    let group = q_heads / kv_heads;
    let compute = q.dtype();
    // Fold the query heads that share a KV head into the row dimension: [kv, group * n, hd].
    let q = q.contiguous()?.reshape((kv_heads, group * n, head_dim))?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let scores = (q.matmul(&keys_t.contiguous()?)? * scale)?; // [kv, group * n, total]
    let scores = if n > 1 {
        let mask = causal_mask(n, total, start_pos, q.device())?.to_dtype(compute)?;
        scores
            .reshape((kv_heads, group, n, total))?
            .broadcast_add(&mask)?
            .reshape((kv_heads, group * n, total))?
    } else {
        scores
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(compute)?;
    let out = probs.matmul(&values.contiguous()?)?; // [kv, group * n, hd]
    Ok(out.reshape((q_heads, n, head_dim))?.transpose(0, 1)?.reshape((n, q_heads * head_dim))?)
}

/// [n, total] f32: 0 where query i (at position start + i) may see key j, -inf elsewhere.
fn causal_mask(n: usize, total: usize, start: usize, device: &Device) -> Result<Tensor> {
    match Placement::of(device) {
        Placement::Host => causal_mask_on_host(n, total, start, device),
        Placement::Device => causal_mask_with_tensor_ops(n, total, start, device),
    }
}

fn causal_mask_on_host(n: usize, total: usize, start: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..total).map(move |j| if j <= start + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(mask, (n, total), device)?)
}

/// The same built on `device` from two position ranges: it receives n + total positions
/// (candle builds a range on the host) instead of the n x total mask, and nothing is read back.
fn causal_mask_with_tensor_ops(n: usize, total: usize, start: usize, device: &Device) -> Result<Tensor> {
    let queries = Tensor::arange(start as u32, (start + n) as u32, device)?.unsqueeze(1)?;
    let keys = Tensor::arange(0u32, total as u32, device)?.unsqueeze(0)?;
    let visible = keys.broadcast_le(&queries)?; // [n, total] u8
    let open = Tensor::zeros((n, total), DType::F32, device)?;
    let blocked = Tensor::full(f32::NEG_INFINITY, (n, total), device)?;
    Ok(visible.where_cond(&open, &blocked)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::paged::BlockPool;

    /// The host path's heads equal `rms_norm` then `rope` as tensor ops, bit for bit: with and
    /// without a norm, RoPE on all of a head or part of it, more heads than are summed side by
    /// side (eleven), at several positions.
    #[test]
    fn head_prep_equals_the_norm_and_rope_tensor_ops() -> Result<()> {
        let device = Device::Cpu;
        let (heads, head_dim, max_positions) = (11, 16, 40);
        let values = |n: usize, seed: u32| -> Vec<f32> { (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2000) as f32 / 700.0 - 1.4).collect() };
        let scale = values(head_dim, 3);
        for rotary_dim in [head_dim, 8] {
            let half = rotary_dim / 2;
            let (cos, sin) = (values(max_positions * half, 5), values(max_positions * half, 7));
            for norm in [Some((&scale[..], 1e-6f32)), None] {
                let prep = HeadPrep { head_dim, rotary_dim, q_norm: norm, k_norm: None, cos: &cos, sin: &sin };
                for position in [0usize, 1, 17, 39] {
                    let x = values(heads * head_dim, position as u32);
                    let mut out = vec![0f32; x.len()];
                    prep.heads(&x, norm, position, &mut out);
                    let mut t = Tensor::from_vec(x.clone(), (heads, head_dim), &device)?;
                    if let Some((scale, eps)) = norm {
                        t = candle_nn::ops::rms_norm(&t, &Tensor::from_slice(scale, head_dim, &device)?, eps)?;
                    }
                    let c = Tensor::from_slice(&cos[position * half..(position + 1) * half], (1, half), &device)?;
                    let s = Tensor::from_slice(&sin[position * half..(position + 1) * half], (1, half), &device)?;
                    let rotated = candle_nn::rotary_emb::rope(&t.narrow(1, 0, rotary_dim)?.contiguous()?.reshape((1, heads, 1, rotary_dim))?, &c, &s)?;
                    let expected = Tensor::cat(&[&rotated.reshape((heads, rotary_dim))?, &t.narrow(1, rotary_dim, head_dim - rotary_dim)?], 1)?;
                    assert_eq!(out, expected.flatten_all()?.to_vec1::<f32>()?, "rotary_dim {rotary_dim}, norm {}, position {position}", norm.is_some());
                }
            }
        }
        Ok(())
    }

    /// One token's attention read in place from scattered blocks equals [`attend`] over the
    /// gathered history (to f32 rounding), for grouped heads and a partly filled last block.
    #[test]
    fn attention_read_in_place_equals_the_gathered_form() -> Result<()> {
        let device = Device::Cpu;
        let (kv_heads, q_heads, head_dim, block_size) = (2, 6, 8, 4);
        for total in [1usize, 4, 5, 11, 16] {
            let mut pool = BlockPool::new(16, block_size);
            let table: Vec<u32> = [9u32, 3, 14, 0, 7].into_iter().take(total.div_ceil(block_size)).collect();
            let keys = Tensor::randn(0f32, 1.0, (kv_heads, total, head_dim), &device)?;
            let values = Tensor::randn(0f32, 1.0, (kv_heads, total, head_dim), &device)?;
            let q = Tensor::randn(0f32, 1.0, (q_heads, 1, head_dim), &device)?;
            let layer = pool.layer_mut(0);
            let (keys_t, gathered) = layer.append(&table, 0, &keys, &values)?;
            let expected = attend(&q, &keys_t, &gathered, total - 1, kv_heads, head_dim)?.flatten_all()?.to_vec1::<f32>()?;
            let q_host = q.flatten_all()?.to_vec1::<f32>()?;
            let mut ours = Vec::new();
            for kv in 0..kv_heads {
                let heads = layer.host_histories(&[(&table, total)], |histories| match histories {
                    HostHistories::F32(all) => attend_one(&q_host, &all[0], kv_heads, head_dim, kv, Spread::Serial),
                    HostHistories::F16(all) => attend_one(&q_host, &all[0], kv_heads, head_dim, kv, Spread::Serial),
                })?;
                ours.extend(heads.expect("f32 blocks on a CPU"));
            }
            let diff = ours.iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff < 1e-5, "total {total}: max |diff| {diff}");
        }
        Ok(())
    }

    /// A step's sequences read in place on a CPU (one query row at a time, each against the
    /// positions it may see) equal the gathered form, to f32 rounding: a whole prompt, a later
    /// chunk of one with a partly filled last block, and a decoding sequence, in one batch.
    #[test]
    fn a_batch_read_in_place_equals_the_gathered_form() -> Result<()> {
        let device = Device::Cpu;
        let (kv_heads, q_heads, head_dim, block_size) = (2, 6, 16, 4);
        // (tokens, start): the earlier positions were written by an earlier step
        let shapes = [(37usize, 0usize), (9, 14), (1, 22)];
        let mut pool = BlockPool::new(64, block_size);
        let tables: Vec<Vec<u32>> = vec![(0..10).collect(), (20..26).rev().collect(), (40..46).collect()];
        let tokens: Vec<Vec<u32>> = shapes.iter().map(|&(n, _)| vec![1; n]).collect();
        let batch: Vec<SequenceInput<'_>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(_, start))| SequenceInput::new(i as u64, &tokens[i], start, true, &tables[i]))
            .collect();
        let layer = pool.layer_mut(0);
        let all = |n| -> Result<(Tensor, Tensor)> {
            Ok((Tensor::randn(0f32, 1.0, (kv_heads, n, head_dim), &device)?, Tensor::randn(0f32, 1.0, (kv_heads, n, head_dim), &device)?))
        };
        let mut new_kv = Vec::new();
        for (i, &(n, start)) in shapes.iter().enumerate() {
            let (keys, values) = all(start + n)?;
            if start > 0 {
                layer.write(&tables[i], 0, &keys.narrow(1, 0, start)?, &values.narrow(1, 0, start)?)?;
            }
            new_kv.push((keys.narrow(1, start, n)?, values.narrow(1, start, n)?));
        }
        let tokens_total: usize = shapes.iter().map(|&(n, _)| n).sum();
        let q = Tensor::randn(0f32, 1.0, (q_heads, tokens_total, head_dim), &device)?;
        let k = Tensor::cat(&new_kv.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(), 1)?;
        let v = Tensor::cat(&new_kv.iter().map(|(_, v)| v.clone()).collect::<Vec<_>>(), 1)?;
        let ours = attend_batch(&q, &k, &v, &batch, layer, kv_heads, head_dim)?;
        let mut offset = 0;
        for (i, &(n, start)) in shapes.iter().enumerate() {
            let (keys_t, values) = layer.gather(&tables[i], start + n)?;
            let expected = attend_rows(&q.narrow(1, offset, n)?, &keys_t, &values, start, kv_heads, head_dim)?;
            let diff = (ours.narrow(0, offset, n)? - expected)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "sequence {i} ({n} tokens from {start}): max |diff| {diff}");
            offset += n;
        }
        Ok(())
    }

    /// A long prompt taken in passes of query rows, each against the positions it may see,
    /// equals one pass over every row: a whole prompt, and a later chunk of one.
    #[test]
    fn a_long_prompt_in_passes_equals_one_pass() -> Result<()> {
        let device = Device::Cpu;
        let (kv_heads, q_heads, head_dim) = (2, 6, 16);
        for (n, start) in [(2 * QUERY_ROWS_PER_PASS + 37, 0), (QUERY_ROWS_PER_PASS + 1, 300)] {
            let total = start + n;
            let q = Tensor::randn(0f32, 1.0, (q_heads, n, head_dim), &device)?;
            let keys_t = Tensor::randn(0f32, 1.0, (kv_heads, head_dim, total), &device)?;
            let values = Tensor::randn(0f32, 1.0, (kv_heads, total, head_dim), &device)?;
            let passes = attend(&q, &keys_t, &values, start, kv_heads, head_dim)?;
            let one = attend_rows(&q, &keys_t, &values, start, kv_heads, head_dim)?;
            assert_eq!(passes.dims(), one.dims());
            let diff = (passes - one)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "n {n}, start {start}: max |diff| {diff}");
        }
        Ok(())
    }

    /// The tensor-op mask (a GPU's) is the host's (a CPU's), bit for bit: a whole prompt, a
    /// later chunk of one, and a chunk shorter than the history.
    #[test]
    fn causal_mask_with_tensor_ops_equals_the_host_one() -> Result<()> {
        for (n, total, start) in [(5, 5, 0), (4, 11, 7), (1, 3, 2), (64, 200, 136)] {
            let host = causal_mask_on_host(n, total, start, &Device::Cpu)?.to_vec2::<f32>()?;
            let device = causal_mask_with_tensor_ops(n, total, start, &Device::Cpu)?.to_vec2::<f32>()?;
            assert_eq!(host, device, "n {n}, total {total}, start {start}");
        }
        Ok(())
    }
}
