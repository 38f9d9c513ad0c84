//! Admission and step planning over the KV block ledger ([`super::super::blocks`]): which
//! waiting requests get blocks (reusing a cached prefix), which blocks each step needs, what a
//! sequence's GenerateStep entry says about its prefix, and returning blocks when sequences end.

use std::sync::atomic::Ordering;

use super::super::blocks::Hit;
use super::super::detokenizer::IncrementalDecoder;
use super::super::error::Error;
use super::super::stop::StopMatcher;
use super::{Engine, Sequence};
use crate::proto::rank::v1 as rank_pb;

/// How a sequence starts on the ranks: from a cached prefix of `tokens` positions (0: none),
/// whose recurrent state is in the snapshot of `restore`; and where its own prompt's state is
/// snapshotted (`snapshot_at`, a block boundary).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Prefix {
    pub(super) tokens: usize,
    pub(super) restore: Option<u32>,
    pub(super) snapshot_at: Option<usize>,
    /// the ranks hold state for the sequence (its first step ran)
    pub(super) on_ranks: bool,
}

impl Engine {
    /// Admits waiting requests in arrival order while the batch and the KV blocks allow.
    /// Each admitted sequence commits blocks for prompt + max_tokens positions (less what a
    /// cached prefix already holds) and its recurrent state, so a running sequence can never
    /// run out of cache mid-generation.
    pub(super) fn admit(&mut self) {
        if !self.readmit() {
            self.publish_occupancy();
            return;
        }
        while self.running.len() < self.config.max_batch_sequences {
            let Some(front) = self.waiting.front() else { break };
            let admitted = if front.responses.is_closed() {
                None
            } else {
                let hit = self.blocks.lookup(&front.prompt_ids);
                match self.blocks.admit(&hit, front.prompt_ids.len() + front.max_tokens) {
                    Some(blocks) => Some((hit, blocks)),
                    None => break,
                }
            };
            let Some(request) = self.waiting.pop_front() else { break };
            self.model.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            let Some((hit, blocks)) = admitted else {
                self.model.stats.requests_cancelled_total.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let prefix = self.prefix_of(&hit, request.prompt_ids.len());
            self.count_lookup(request.prompt_ids.len(), prefix.tokens);
            let seq_id = self.next_seq_id;
            self.next_seq_id += 1;
            // ignore_eos as vLLM means it: EOS does not end the sequence, but it is not
            // suppressed either, so the model's distribution (and its logprobs) stay untouched.
            let sampling = request.sampling;
            self.model.metrics.prompt_tokens.fetch_add(request.prompt_ids.len() as u64, Ordering::Relaxed);
            drop(request.queue_span);
            let prefill_span = tracing::info_span!(parent: &request.span, "prefill", prompt_tokens = request.prompt_ids.len(), cached_tokens = prefix.tokens);
            self.running.push(Sequence {
                seq_id,
                span: request.span,
                prefill_span: Some(prefill_span),
                arrived: request.arrived,
                last_token_at: None,
                deadline: request.deadline,
                blocks: Some(blocks),
                prefix,
                pending_snapshot: None,
                resumes: 0,
                prompt_len: request.prompt_ids.len(),
                decoder: IncrementalDecoder::new(self.model.tokenizer.clone(), &request.prompt_ids),
                tokens: request.prompt_ids,
                processed: prefix.tokens,
                max_tokens: request.max_tokens,
                ignore_eos: request.ignore_eos,
                sampling,
                stop: StopMatcher::with_set(request.stop),
                responses: request.responses,
            });
        }
        self.publish_occupancy();
    }

    /// Gives blocks again, in order, to the running sequences that lost theirs with an epoch
    /// (they may hit the prefixes the ones before them recompute). True when none is left
    /// waiting, so new requests may be admitted.
    pub(super) fn readmit(&mut self) -> bool {
        for index in 0..self.running.len() {
            let seq = &self.running[index];
            if seq.blocks.is_some() {
                continue;
            }
            let hit = self.blocks.lookup(&seq.tokens);
            let Some(blocks) = self.blocks.admit(&hit, seq.reservation()) else { return false };
            let prefix = self.prefix_of(&hit, seq.prompt_len);
            let seq = &mut self.running[index];
            seq.blocks = Some(blocks);
            seq.prefix = prefix;
            seq.processed = prefix.tokens;
        }
        true
    }

    fn prefix_of(&self, hit: &Hit, prompt_len: usize) -> Prefix {
        let tokens = hit.tokens(self.model.pool.block_size);
        Prefix {
            tokens,
            restore: if self.model.pool.recurrent { hit.last_block() } else { None },
            snapshot_at: self.blocks.snapshot_boundary(prompt_len, tokens),
            on_ranks: false,
        }
    }

    fn count_lookup(&self, queried: usize, hit: usize) {
        if !self.model.prefix_cache {
            return;
        }
        let (stats, metrics) = (&self.model.stats, &self.model.metrics);
        stats.prefix_cache_queries.fetch_add(queried as u64, Ordering::Relaxed);
        stats.prefix_cache_hits.fetch_add(hit as u64, Ordering::Relaxed);
        metrics.prefix_cache_queries.fetch_add(queried as u64, Ordering::Relaxed);
        metrics.prefix_cache_hits.fetch_add(hit as u64, Ordering::Relaxed);
    }

    pub(super) fn publish_occupancy(&self) {
        let stats = &self.model.stats;
        let usage = self.blocks.usage();
        let block_size = self.model.pool.block_size as u64;
        stats.active_sequences.store(self.running.len() as u64, Ordering::Relaxed);
        stats.kv_reserved_tokens.store((usage.used + usage.reserved) as u64 * block_size, Ordering::Relaxed);
        stats.kv_blocks_used.store(usage.used as u64, Ordering::Relaxed);
        stats.kv_blocks_cached.store(usage.cached as u64, Ordering::Relaxed);
        stats.kv_blocks_reserved.store(usage.reserved as u64, Ordering::Relaxed);
        stats.kv_state_blocks.store(usage.state as u64, Ordering::Relaxed);
        let cached: usize = self.running.iter().map(|s| s.processed).sum();
        stats.kv_cached_tokens.store(cached as u64, Ordering::Relaxed);
    }

    /// The queue's head needs more KV cache than the ranks hold in total.
    pub(super) fn refuse_unfittable(&mut self) {
        let Some(mut request) = self.waiting.pop_front() else { return };
        self.model.stats.waiting.fetch_sub(1, Ordering::Relaxed);
        let need = request.prompt_ids.len() + request.max_tokens;
        self.model.metrics.failure("kv_capacity");
        request.responses.fail(Error::capacity(format!(
            "the request needs {need} tokens of KV cache (prompt plus max_tokens) but the ranks hold {}; \
             lower max_tokens or shorten the prompt",
            self.model.kv_capacity_tokens
        )));
    }

    /// Returns the blocks of sequences that ended: their hashed blocks stay in the prefix
    /// cache, and a snapshot whose step never ran is forgotten.
    pub(super) fn release(&mut self, ended: &mut [Sequence]) {
        for seq in ended {
            if let Some(id) = seq.pending_snapshot.take() {
                self.blocks.forget_snapshot(id);
            }
            if let (false, Some(id)) = (seq.prefix.on_ranks, seq.prefix.restore) {
                self.blocks.restored(id);
            }
            if let Some(blocks) = seq.blocks.take() {
                self.blocks.release(blocks);
            }
        }
        self.publish_occupancy();
    }

    /// Builds the next step: decodes first (they are cheap and latency-critical), then prefill
    /// chunks within the token budget. A hybrid model's prefill chunk ends where its
    /// recurrent state is to be snapshotted. Blocks are allocated here, as the step needs them.
    pub(super) fn plan_step(&mut self) -> Vec<rank_pb::SequenceStep> {
        let mut budget = self.config.max_batch_tokens;
        let mut prefill_budget = self.config.prefill_chunk;
        let mut steps = Vec::with_capacity(self.running.len());
        let ready = |s: &Sequence| s.blocks.is_some();
        let decoding = (0..self.running.len()).filter(|&i| ready(&self.running[i]) && self.running[i].processed >= self.running[i].prompt_len);
        let prefilling = (0..self.running.len()).filter(|&i| ready(&self.running[i]) && self.running[i].processed < self.running[i].prompt_len);
        let order: Vec<usize> = decoding.chain(prefilling).collect();
        let mut broken = Vec::new();
        for index in order {
            let seq = &mut self.running[index];
            let pending = seq.tokens.len() - seq.processed;
            let prefill = seq.processed < seq.prompt_len;
            let mut take = if prefill { pending.min(prefill_budget) } else { pending }.min(budget);
            if let Some(boundary) = seq.prefix.snapshot_at.filter(|&b| b > seq.processed) {
                take = take.min(boundary - seq.processed);
            }
            if take == 0 {
                continue;
            }
            let end = seq.processed + take;
            let Some(blocks) = seq.blocks.as_mut() else { continue };
            if let Err(reason) = self.blocks.grow(blocks, end) {
                broken.push((seq.seq_id, reason));
                continue;
            }
            seq.pending_snapshot = match seq.prefix.snapshot_at {
                Some(boundary) if boundary == end => self.blocks.take_snapshot(blocks, &seq.tokens, boundary),
                _ => None,
            };
            budget -= take;
            if prefill {
                prefill_budget -= take;
            }
            steps.push(sequence_step(seq, take));
        }
        for (seq_id, reason) in broken {
            self.fail_one(seq_id, Error::internal(format!("KV block accounting: {reason}")));
        }
        steps
    }

    /// Fails one running sequence from inside the step loop (a bug, not the request's fault).
    pub(super) fn fail_one(&mut self, seq_id: u64, error: Error) {
        let Some(index) = self.running.iter().position(|s| s.seq_id == seq_id) else { return };
        let mut seq = self.running.swap_remove(index);
        tracing::error!(seq_id, %error, "failing a sequence");
        self.model.metrics.failure("internal");
        seq.responses.fail(error);
        self.release(std::slice::from_mut(&mut seq));
    }
}

/// The GenerateStep entry of `take` new tokens of `seq`, whose blocks cover them. A sequence's
/// first step from a cached prefix names the prefix, its tokens (for the sampler's penalties)
/// and the snapshot of its recurrent state.
pub(super) fn sequence_step(seq: &Sequence, take: usize) -> rank_pb::SequenceStep {
    let first_from_cache = !seq.prefix.on_ranks && seq.prefix.tokens > 0 && seq.processed == seq.prefix.tokens;
    rank_pb::SequenceStep {
        seq_id: seq.seq_id,
        token_ids: seq.tokens[seq.processed..seq.processed + take].to_vec(),
        start_pos: seq.processed as u32,
        prompt_len: seq.prompt_len as u32,
        sample: seq.processed + take == seq.tokens.len(),
        sampling: Some(seq.sampling.clone()),
        block_table: seq.blocks.as_ref().map(|b| b.table.clone()).unwrap_or_default(),
        cached_prefix: if first_from_cache { seq.prefix.tokens as u32 } else { 0 },
        restore_state_block: if first_from_cache { seq.prefix.restore } else { None },
        save_state_block: seq.pending_snapshot,
        cached_token_ids: if first_from_cache { seq.tokens[..seq.prefix.tokens].to_vec() } else { Vec::new() },
    }
}
