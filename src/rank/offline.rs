//! A driver that runs prompts through one shard with no coordinator: every rank of a group
//! runs it with the same prompts, and the sampling rank reports greedy tokens and logits.
//! Parity tests and the benchmark use it to exercise the model and the collectives without
//! the RPC layer.

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::model::paged::{BlockPool, DEFAULT_BLOCK_SIZE, contiguous_table};
use crate::model::{CacheStore, Model, SequenceInput};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PromptResult {
    /// greedy tokens after the prompt
    pub new_ids: Vec<u32>,
    /// logits at the last prompt position (whole vocabulary)
    pub last_logits: Vec<f32>,
}

/// A greedy run with the time its prefill and its single-token steps took.
pub struct TimedResult {
    pub result: Option<PromptResult>,
    pub timing: Timing,
}

/// What a timed greedy run measures. The prefill's time includes reading its logits, so on a
/// GPU it covers the device's work too.
#[derive(Debug, Default)]
pub struct Timing {
    pub prefill_tokens: usize,
    pub prefill_time: std::time::Duration,
    pub decode_steps: usize,
    pub decode_time: std::time::Duration,
}

/// [`greedy`] with the KV cache in `kv_dtype` (None: the compute dtype), timing the prefill and
/// the decode steps (for the benchmark).
pub fn greedy_timed(
    model: &Model,
    seq_id: u64,
    prompt: &[u32],
    max_new: usize,
    chunk: usize,
    suppressed: &[u32],
    kv_dtype: Option<DType>,
) -> Result<TimedResult> {
    let mut timing = Timing::default();
    let result = run_greedy(model, seq_id, prompt, max_new, chunk, suppressed, kv_dtype, &mut timing)?;
    Ok(TimedResult { result, timing })
}

/// Greedy decoding of `prompt`: prefill in chunks of `chunk` tokens (0 = all at once), then
/// `max_new` single-token steps. `suppressed` ids (EOS when ignoring it) are never chosen.
/// Returns Some on the sampling rank only.
pub fn greedy(
    model: &Model,
    seq_id: u64,
    prompt: &[u32],
    max_new: usize,
    chunk: usize,
    suppressed: &[u32],
) -> Result<Option<PromptResult>> {
    run_greedy(model, seq_id, prompt, max_new, chunk, suppressed, None, &mut Timing::default())
}

#[allow(clippy::too_many_arguments)]
fn run_greedy(
    model: &Model,
    seq_id: u64,
    prompt: &[u32],
    max_new: usize,
    chunk: usize,
    suppressed: &[u32],
    kv_dtype: Option<DType>,
    timing: &mut Timing,
) -> Result<Option<PromptResult>> {
    // One sequence owns the whole pool.
    let table = contiguous_table(0, prompt.len() + max_new, DEFAULT_BLOCK_SIZE);
    let mut store = CacheStore::new(BlockPool::new(table.len(), DEFAULT_BLOCK_SIZE).with_kv_dtype(kv_dtype));
    let chunk = if chunk == 0 { prompt.len() } else { chunk };
    let mut logits = None;
    let mut start = 0;
    let started = std::time::Instant::now();
    for piece in prompt.chunks(chunk) {
        logits = model.step(&[SequenceInput::new(seq_id, piece, start, true, &table)], &mut store)?;
        start += piece.len();
    }
    let last_logits = match &logits {
        Some(l) => Some(row(l)?),
        None => None,
    };
    timing.prefill_tokens += prompt.len();
    timing.prefill_time += started.elapsed();
    let mut new_ids = Vec::with_capacity(max_new);
    let mut next = last_logits.as_ref().map(|l| argmax(l, suppressed));
    for step in 0..max_new {
        // Every rank must feed the same token; the sampling rank knows it, the others learn it
        // through a broadcast, as the coordinator would tell them in a served system.
        let token = broadcast_token(model, next)?;
        new_ids.push(token);
        if step + 1 == max_new {
            break;
        }
        let started = std::time::Instant::now();
        let out = model.step(&[SequenceInput::new(seq_id, &[token], start, true, &table)], &mut store)?;
        timing.decode_steps += 1;
        timing.decode_time += started.elapsed();
        start += 1;
        next = match out {
            Some(l) => Some(argmax(&row(&l)?, suppressed)),
            None => None,
        };
    }
    Ok(last_logits.map(|last_logits| PromptResult { new_ids, last_logits }))
}

fn row(logits: &Tensor) -> Result<Vec<f32>> {
    Ok(logits.get(0)?.to_vec1::<f32>()?)
}

fn argmax(logits: &[f32], suppressed: &[u32]) -> u32 {
    let mut best = 0usize;
    let mut best_value = f32::NEG_INFINITY;
    for (i, &value) in logits.iter().enumerate() {
        if value > best_value && !suppressed.contains(&(i as u32)) {
            best = i;
            best_value = value;
        }
    }
    best as u32
}

fn broadcast_token(model: &Model, token: Option<u32>) -> Result<u32> {
    let group = model.group();
    if group.skips_collectives() {
        return token.context("the single rank produced no logits");
    }
    let value = Tensor::new(&[token.unwrap_or(0) as f32], &candle_core::Device::Cpu)?;
    let value = group.comm.broadcast(&value, 0)?;
    Ok(value.to_vec1::<f32>()?[0] as u32)
}

/// Teacher forcing: the logits (whole vocabulary) after `prompt`, then after each token of
/// `continuation` fed one at a time, `continuation.len() + 1` rows in all; Some on the sampling
/// rank only. Comparing two loads of a model on the same forced tokens measures their logit
/// difference and top-1 agreement at every step, without one divergence derailing the rest.
pub fn teacher_forced(model: &Model, seq_id: u64, prompt: &[u32], continuation: &[u32]) -> Result<Option<Vec<Vec<f32>>>> {
    teacher_forced_with(model, seq_id, prompt, continuation, None)
}

/// [`teacher_forced`] with the KV cache in `kv_dtype` (None: the compute dtype).
pub fn teacher_forced_with(
    model: &Model,
    seq_id: u64,
    prompt: &[u32],
    continuation: &[u32],
    kv_dtype: Option<DType>,
) -> Result<Option<Vec<Vec<f32>>>> {
    // One sequence owns the whole pool.
    let table = contiguous_table(0, prompt.len() + continuation.len(), DEFAULT_BLOCK_SIZE);
    let mut store = CacheStore::new(BlockPool::new(table.len(), DEFAULT_BLOCK_SIZE).with_kv_dtype(kv_dtype));
    let mut rows = Vec::with_capacity(continuation.len() + 1);
    let mut position = 0;
    let mut feed = |tokens: &[u32]| -> Result<Option<Vec<f32>>> {
        let input = SequenceInput::new(seq_id, tokens, position, true, &table);
        position += tokens.len();
        let logits = model.step(&[input], &mut store)?;
        logits.map(|l| Ok(l.get(0)?.to_vec1::<f32>()?)).transpose()
    };
    let first = feed(prompt)?;
    let Some(first) = first else {
        for &token in continuation {
            feed(&[token])?;
        }
        return Ok(None);
    };
    rows.push(first);
    for &token in continuation {
        rows.push(feed(&[token])?.context("the sampling rank returned no logits")?);
    }
    Ok(Some(rows))
}

/// (largest |a - b| over every row, rows whose argmax agree) of two [`teacher_forced`] runs.
pub fn compare_rows(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f32, usize) {
    let argmax = |row: &[f32]| row.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &v)| if v > best.1 { (i, v) } else { best }).0;
    let mut diff = 0f32;
    let mut agree = 0;
    for (x, y) in a.iter().zip(b) {
        diff = x.iter().zip(y).fold(diff, |d, (p, q)| d.max((p - q).abs()));
        agree += usize::from(argmax(x) == argmax(y));
    }
    (diff, agree)
}
