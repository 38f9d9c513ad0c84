//! Per-sequence state a rank keeps between steps: the block table through which its attention
//! layers find their keys and values in the model's block pool ([`super::paged`]), and the
//! convolution and recurrent state of every linear-attention (Gated DeltaNet) layer.
//!
//! A recurrent state has a fixed size and cannot be rewound, so a prefix-cache hit needs the
//! state exactly at the prefix's end: the store keeps snapshots of it, keyed by the id of the
//! block that ends at that position (the coordinator says when to take and drop them).

use std::collections::HashMap;

use anyhow::{Result, bail};
use candle_core::Tensor;

use super::paged::BlockPool;

/// The state a linear-attention layer carries from one step to the next: a fixed size whatever
/// the sequence length, and only ever moving forward (it cannot be rewound, only reset).
#[derive(Default)]
pub struct RecurrentState {
    /// the last `kernel - 1` inputs of the causal convolution, [kernel - 1, channels]
    pub conv: Option<Tensor>,
    /// the delta-rule memory, [value_heads, key_head_dim, value_head_dim] in f32
    pub memory: Option<Tensor>,
}

// Cloning shares the tensors, which is safe: a step replaces a state's tensors, never writes
// into them, so a snapshot keeps the values it was taken with.
impl Clone for RecurrentState {
    fn clone(&self) -> Self {
        Self { conv: self.conv.clone(), memory: self.memory.clone() }
    }
}

impl RecurrentState {
    pub fn reset(&mut self) {
        self.conv = None;
        self.memory = None;
    }
}

/// The cached state of one layer: attention keeps nothing per sequence (its keys and values
/// are in the block pool, found through the sequence's block table).
#[derive(Clone)]
pub enum LayerCache {
    Attention,
    Recurrent(RecurrentState),
}

/// Everything a rank remembers about one sequence.
pub struct SequenceCache {
    pub layers: Vec<LayerCache>,
    /// number of positions already processed
    pub len: usize,
    /// the blocks holding positions 0, block_size, 2 * block_size, ... (as of the last step)
    pub blocks: Vec<u32>,
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
                    LayerCache::Attention
                }
            })
            .collect();
        Self { layers, len: 0, blocks: Vec::new() }
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
                LayerCache::Attention => {}
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

    /// The recurrent layers' states, to restore a sequence at this position later; None when
    /// the model has no recurrent layer.
    pub fn snapshot(&self) -> Option<Vec<LayerCache>> {
        let recurrent = self.layers.iter().any(|l| matches!(l, LayerCache::Recurrent(_)));
        recurrent.then(|| self.layers.clone())
    }
}

/// All sequences a rank holds state for, by sequence id, the block pool their attention layers
/// share, and the recurrent-state snapshots of cached prefixes.
pub struct CacheStore {
    pub pool: BlockPool,
    sequences: HashMap<u64, SequenceCache>,
    /// layer states at the end of a cached block, by that block's id
    snapshots: HashMap<u32, Vec<LayerCache>>,
}

impl CacheStore {
    pub fn new(pool: BlockPool) -> Self {
        Self { pool, sequences: HashMap::new(), snapshots: HashMap::new() }
    }

    /// Keeps `layers` as the state at the end of block `block`, replacing any older snapshot.
    pub fn save_snapshot(&mut self, block: u32, layers: Vec<LayerCache>) {
        self.snapshots.insert(block, layers);
    }

    pub fn snapshot(&self, block: u32) -> Option<&Vec<LayerCache>> {
        self.snapshots.get(&block)
    }

    pub fn drop_snapshots(&mut self, blocks: &[u32]) {
        for block in blocks {
            self.snapshots.remove(block);
        }
    }

    pub fn snapshot_count(&self) -> usize {
        self.snapshots.len()
    }

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

    /// Drops every sequence and snapshot (the block storage stays allocated for reuse).
    pub fn clear(&mut self) -> usize {
        let count = self.sequences.len();
        self.sequences.clear();
        self.snapshots.clear();
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
