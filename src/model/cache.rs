//! Per-sequence state a rank keeps between steps: the attention KV cache of every attention
//! layer, and the convolution and recurrent state of every linear-attention (Gated DeltaNet) layer.
//!
//! Buffers grow by doubling and new positions are written in place, so a decode step copies only
//! the new token's keys and values, not the whole history.

use std::collections::HashMap;

use anyhow::{Result, bail};
use candle_core::Tensor;

/// Keys and values of one attention layer for one sequence: [kv_heads, capacity, head_dim].
#[derive(Default)]
pub struct KvBuffer {
    keys: Option<Tensor>,
    values: Option<Tensor>,
    len: usize,
}

impl KvBuffer {
    /// Appends `[kv_heads, n, head_dim]` keys and values and returns views of the whole history,
    /// `[kv_heads, len + n, head_dim]`.
    pub fn append(&mut self, keys: &Tensor, values: &Tensor) -> Result<(Tensor, Tensor)> {
        let new = keys.dim(1)?;
        let needed = self.len + new;
        let capacity = self.keys.as_ref().map(|k| k.dim(1)).transpose()?.unwrap_or(0);
        if needed > capacity {
            let capacity = needed.next_power_of_two().max(64);
            self.keys = Some(grow(self.keys.as_ref(), keys, self.len, capacity)?);
            self.values = Some(grow(self.values.as_ref(), values, self.len, capacity)?);
        }
        let (Some(all_keys), Some(all_values)) = (&self.keys, &self.values) else {
            bail!("kv buffer was not allocated");
        };
        all_keys.slice_set(&keys.contiguous()?, 1, self.len)?;
        all_values.slice_set(&values.contiguous()?, 1, self.len)?;
        self.len = needed;
        Ok((all_keys.narrow(1, 0, needed)?, all_values.narrow(1, 0, needed)?))
    }

    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A new buffer of `capacity` positions holding the first `len` positions of `old`.
fn grow(old: Option<&Tensor>, like: &Tensor, len: usize, capacity: usize) -> Result<Tensor> {
    let (heads, _, head_dim) = like.dims3()?;
    let buffer = Tensor::zeros((heads, capacity, head_dim), like.dtype(), like.device())?;
    if let Some(old) = old {
        if len > 0 {
            buffer.slice_set(&old.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
        }
    }
    Ok(buffer)
}

/// The state a linear-attention layer carries from one step to the next: a fixed size whatever
/// the sequence length, and only ever moving forward (it cannot be rewound, only reset).
#[derive(Default)]
pub struct RecurrentState {
    /// the last `kernel - 1` inputs of the causal convolution, [kernel - 1, channels]
    pub conv: Option<Tensor>,
    /// the delta-rule memory, [value_heads, key_head_dim, value_head_dim] in f32
    pub memory: Option<Tensor>,
}

impl RecurrentState {
    pub fn reset(&mut self) {
        self.conv = None;
        self.memory = None;
    }
}

/// The cached state of one layer.
pub enum LayerCache {
    Attention(KvBuffer),
    Recurrent(RecurrentState),
}

/// Everything a rank remembers about one sequence.
pub struct SequenceCache {
    pub layers: Vec<LayerCache>,
    /// number of positions already processed
    pub len: usize,
}

impl SequenceCache {
    pub fn new_attention(num_layers: usize) -> Self {
        Self::new(num_layers, |_| false)
    }

    /// Empty caches for `num_layers` layers; `recurrent(i)` says whether layer i is a
    /// linear-attention layer.
    pub fn new(num_layers: usize, recurrent: impl Fn(usize) -> bool) -> Self {
        let layers = (0..num_layers)
            .map(|i| {
                if recurrent(i) {
                    LayerCache::Recurrent(RecurrentState::default())
                } else {
                    LayerCache::Attention(KvBuffer::default())
                }
            })
            .collect();
        Self { layers, len: 0 }
    }

    /// Fails when the cache cannot be rewound to `len` positions: a recurrent state has folded
    /// every processed token into itself and can only restart from position 0.
    pub fn check_truncate(&self, len: usize) -> Result<()> {
        if len == 0 || len >= self.len {
            return Ok(());
        }
        if let Some(layer) = self.layers.iter().position(|l| matches!(l, LayerCache::Recurrent(_))) {
            bail!(
                "cannot rewind to position {len}: {} positions are cached and layer {layer} keeps a \
                 recurrent (linear-attention) state, which cannot be rewound; restart the sequence \
                 from position 0 instead",
                self.len
            );
        }
        Ok(())
    }

    /// Rewinds to `len` positions (used when a sequence is re-prefilled from an earlier point).
    /// Rewinding to 0 resets recurrent state; any other rewind of recurrent state is an error.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        self.check_truncate(len)?;
        for layer in &mut self.layers {
            match layer {
                LayerCache::Attention(kv) => kv.truncate(len),
                LayerCache::Recurrent(state) => {
                    if len == 0 {
                        state.reset();
                    }
                }
            }
        }
        self.len = self.len.min(len);
        Ok(())
    }
}

/// All sequences a rank holds state for, by sequence id.
#[derive(Default)]
pub struct CacheStore {
    sequences: HashMap<u64, SequenceCache>,
}

impl CacheStore {
    pub fn get_mut(&mut self, seq_id: u64) -> Option<&mut SequenceCache> {
        self.sequences.get_mut(&seq_id)
    }

    pub fn get_or_insert_with(&mut self, seq_id: u64, new: impl FnOnce() -> SequenceCache) -> &mut SequenceCache {
        self.sequences.entry(seq_id).or_insert_with(new)
    }

    pub fn take(&mut self, seq_id: u64) -> Option<SequenceCache> {
        self.sequences.remove(&seq_id)
    }

    pub fn insert(&mut self, seq_id: u64, cache: SequenceCache) {
        self.sequences.insert(seq_id, cache);
    }

    pub fn remove(&mut self, seq_id: u64) -> bool {
        self.sequences.remove(&seq_id).is_some()
    }

    pub fn clear(&mut self) -> usize {
        let count = self.sequences.len();
        self.sequences.clear();
        count
    }

    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    /// Total cached positions over all sequences (the KV occupancy in tokens).
    pub fn cached_tokens(&self) -> usize {
        self.sequences.values().map(|s| s.len).sum()
    }
}
