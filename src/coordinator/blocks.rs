//! The coordinator's ledger of the ranks' KV block pools, and the prefix cache on top of it.
//!
//! Every rank keeps its keys and values in a pool of fixed-size blocks; this ledger decides which
//! block ids each sequence gets and sends the block tables with every step, so all ranks agree
//! without talking to each other. Everything is counted in blocks: a sequence's reservation
//! (prompt plus max_tokens), and, for models with Gated DeltaNet layers, the fixed-size
//! recurrent state of each running sequence and of each prefix snapshot (`state_units` blocks
//! each). Admission commits blocks, so the memory reserved is the memory the ranks can use.
//!
//! Prefix caching: a full block is keyed by a chained hash of the model and every token up to
//! its end. A sequence that ends leaves its hashed blocks cached (reference count 0); a new
//! request reuses the longest cached chain (never its last partial block, never the whole
//! prompt: one token must run to produce logits). Cached blocks are evicted least recently used
//! when an allocation needs room. A recurrent state cannot be rebuilt from KV blocks, so for
//! hybrid models a hit can only end at a block that carries a state snapshot.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::{Hash, Hasher};

/// The size of the ranks' pools, as the smallest rank reports it.
#[derive(Debug, Clone, Copy)]
pub struct PoolGeometry {
    pub blocks: usize,
    pub block_size: usize,
    /// blocks' worth of memory one recurrent state takes (0 without Gated DeltaNet layers)
    pub state_units: usize,
    /// the model has recurrent layers: hits need snapshots
    pub recurrent: bool,
}

impl PoolGeometry {
    /// The most tokens one sequence can ever hold (with its recurrent state beside them).
    pub fn max_sequence_tokens(&self) -> usize {
        self.blocks.saturating_sub(self.state_units) * self.block_size
    }
}

/// A cached prefix found for a prompt.
#[derive(Debug, Default, Clone)]
pub struct Hit {
    pub blocks: Vec<u32>,
    /// the chained hash through the last hit block (None: no block, the model's seed)
    chain: Option<u64>,
}

impl Hit {
    pub fn tokens(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }

    /// The block whose snapshot holds the recurrent state at the end of the hit.
    pub fn last_block(&self) -> Option<u32> {
        self.blocks.last().copied()
    }
}

/// The blocks of one running sequence.
#[derive(Debug)]
pub struct SeqBlocks {
    /// block ids in position order
    pub table: Vec<u32>,
    /// blocks reserved at admission and not allocated yet
    reserve: usize,
    /// leading blocks whose hash is known (hit or registered)
    hashed: usize,
    chain: u64,
}

#[derive(Debug, Default, Clone)]
struct BlockMeta {
    refs: u32,
    /// set while the block is in the prefix cache's index
    hash: Option<u64>,
    parent: u64,
    tokens: Vec<u32>,
    last_used: u64,
}

/// Occupancy for ModelInfo and the metrics.
#[derive(Debug, Default, Clone, Copy)]
pub struct Usage {
    pub total: usize,
    /// blocks referenced by running sequences
    pub used: usize,
    /// blocks no sequence references, kept for prefix hits
    pub cached: usize,
    /// blocks promised to running sequences and not allocated yet
    pub reserved: usize,
    /// blocks' worth of recurrent state: running sequences' and snapshots'
    pub state: usize,
}

pub struct BlockManager {
    geometry: PoolGeometry,
    caching: bool,
    /// the chain's start: a hash of the model, so two models never share a key
    seed: u64,
    meta: Vec<BlockMeta>,
    recycled: Vec<u32>,
    by_hash: HashMap<u64, u32>,
    /// cached blocks (refs 0, hashed) by (last use, id): the first is evicted first
    lru: BTreeSet<(u64, u32)>,
    tick: u64,
    in_use: usize,
    reserved: usize,
    live_states: usize,
    snapshots: HashSet<u32>,
    /// snapshots admitted sequences will restore from in their first step: not evictable
    protected: HashMap<u32, usize>,
    /// snapshots evicted since the last step, for the ranks to drop
    dropped: Vec<u32>,
}

impl BlockManager {
    pub fn new(geometry: PoolGeometry, caching: bool, model_key: &str) -> Self {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        model_key.hash(&mut hasher);
        Self {
            geometry,
            caching,
            seed: hasher.finish(),
            meta: Vec::new(),
            recycled: Vec::new(),
            by_hash: HashMap::new(),
            lru: BTreeSet::new(),
            tick: 0,
            in_use: 0,
            reserved: 0,
            live_states: 0,
            snapshots: HashSet::new(),
            protected: HashMap::new(),
            dropped: Vec::new(),
        }
    }

    pub fn geometry(&self) -> PoolGeometry {
        self.geometry
    }

    pub fn usage(&self) -> Usage {
        Usage {
            total: self.geometry.blocks,
            used: self.in_use,
            cached: self.lru.len(),
            reserved: self.reserved,
            state: (self.live_states + self.snapshots.len()) * self.geometry.state_units,
        }
    }

    /// Blocks committed to running sequences (the snapshots they are about to restore from
    /// included): what admission may not exceed.
    pub fn committed(&self) -> usize {
        self.in_use + self.reserved + (self.live_states + self.protected.len()) * self.geometry.state_units
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.geometry.block_size)
    }

    /// Whether a sequence of `tokens` positions fits an empty pool at all.
    pub fn fits_ever(&self, tokens: usize) -> bool {
        self.blocks_for(tokens) + self.geometry.state_units <= self.geometry.blocks
    }

    fn chain_hash(&self, parent: u64, tokens: &[u32]) -> u64 {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (self.seed, parent, tokens).hash(&mut hasher);
        hasher.finish()
    }

    /// The longest cached prefix of `tokens` in full blocks, leaving at least one token to run.
    /// For hybrid models it ends at the deepest block with a recurrent-state snapshot.
    pub fn lookup(&self, tokens: &[u32]) -> Hit {
        let mut hit = Hit::default();
        if !self.caching || tokens.is_empty() {
            return hit;
        }
        let size = self.geometry.block_size;
        let mut best = Hit::default();
        for block in tokens[..tokens.len() - 1].chunks_exact(size) {
            let parent = hit.chain.unwrap_or(self.seed);
            let hash = self.chain_hash(parent, block);
            let Some(&id) = self.by_hash.get(&hash) else { break };
            let meta = &self.meta[id as usize];
            // A 64-bit hash can collide; the tokens and the parent settle it.
            if meta.tokens != block || meta.parent != parent {
                break;
            }
            hit.blocks.push(id);
            hit.chain = Some(hash);
            if !self.geometry.recurrent || self.snapshots.contains(&id) {
                best = hit.clone();
            }
        }
        best
    }

    /// Admits a sequence of `tokens` positions reusing `hit`: pins the hit blocks and reserves
    /// the rest (and a recurrent state). For a hybrid model the snapshot the hit restores from
    /// is protected until [`Self::restored`]. None when the committed blocks would exceed the
    /// pool.
    pub fn admit(&mut self, hit: &Hit, tokens: usize) -> Option<SeqBlocks> {
        let reserve = self.blocks_for(tokens).saturating_sub(hit.blocks.len());
        let unpinned = hit.blocks.iter().filter(|&&id| self.meta[id as usize].refs == 0).count();
        let restore = hit.last_block().filter(|_| self.geometry.recurrent);
        let new_protection = restore.filter(|id| !self.protected.contains_key(id)).map_or(0, |_| self.geometry.state_units);
        let state = if self.geometry.recurrent { self.geometry.state_units } else { 0 };
        if self.committed() + unpinned + reserve + state + new_protection > self.geometry.blocks {
            return None;
        }
        if let Some(id) = restore {
            *self.protected.entry(id).or_insert(0) += 1;
        }
        for &id in &hit.blocks {
            let meta = &mut self.meta[id as usize];
            if meta.refs == 0 {
                self.lru.remove(&(meta.last_used, id));
                self.in_use += 1;
            }
            meta.refs += 1;
        }
        self.reserved += reserve;
        if self.geometry.recurrent {
            self.live_states += 1;
        }
        let chain = hit.chain.unwrap_or(self.seed);
        Some(SeqBlocks { table: hit.blocks.clone(), reserve, hashed: hit.blocks.len(), chain })
    }

    /// Allocates blocks from the sequence's reservation until its table covers `positions`.
    pub fn grow(&mut self, seq: &mut SeqBlocks, positions: usize) -> Result<(), String> {
        while seq.table.len() * self.geometry.block_size < positions {
            if seq.reserve == 0 {
                return Err(format!("the sequence needs block {} beyond its reservation", seq.table.len()));
            }
            let id = self.allocate()?;
            seq.reserve -= 1;
            self.reserved -= 1;
            seq.table.push(id);
        }
        Ok(())
    }

    /// Turns one reserved block into an allocated one. A reservation is already counted as
    /// held, so this only has to evict what admissions promised beyond the cached blocks.
    fn allocate(&mut self) -> Result<u32, String> {
        self.make_room()?;
        let id = match self.recycled.pop() {
            Some(id) => id,
            None => {
                self.meta.push(BlockMeta::default());
                (self.meta.len() - 1) as u32
            }
        };
        self.meta[id as usize] = BlockMeta { refs: 1, ..BlockMeta::default() };
        self.in_use += 1;
        Ok(id)
    }

    /// Blocks the ranks hold or are promised, evictable ones included.
    fn physical(&self) -> usize {
        self.in_use + self.lru.len() + self.reserved + (self.live_states + self.snapshots.len()) * self.geometry.state_units
    }

    /// Evicts until everything held or promised fits the pool.
    fn make_room(&mut self) -> Result<(), String> {
        while self.physical() > self.geometry.blocks {
            if !self.evict_one() {
                return Err(format!(
                    "the block pool is exhausted ({} blocks, {} committed)",
                    self.geometry.blocks,
                    self.committed()
                ));
            }
        }
        Ok(())
    }

    /// Evicts the least recently used cached block, or failing that, a snapshot of a block in
    /// use (it only enables hits) that no admitted sequence is about to restore from. False
    /// when nothing is evictable.
    fn evict_one(&mut self) -> bool {
        if let Some((_, id)) = self.lru.pop_first() {
            let meta = &mut self.meta[id as usize];
            if let Some(hash) = meta.hash.take() {
                self.by_hash.remove(&hash);
            }
            meta.tokens.clear();
            self.forget_snapshot(id);
            self.recycled.push(id);
            return true;
        }
        match self.snapshots.iter().find(|id| !self.protected.contains_key(id)).copied() {
            Some(id) => {
                self.forget_snapshot(id);
                true
            }
            None => false,
        }
    }

    /// Records the hashes of the sequence's blocks that `processed` positions have filled.
    pub fn register(&mut self, seq: &mut SeqBlocks, tokens: &[u32], processed: usize) {
        let size = self.geometry.block_size;
        while self.caching && (seq.hashed + 1) * size <= processed.min(tokens.len()) {
            let block = &tokens[seq.hashed * size..(seq.hashed + 1) * size];
            let hash = self.chain_hash(seq.chain, block);
            let id = seq.table[seq.hashed];
            // Another sequence may have filled the same prefix first: that copy stays the
            // cached one, and this block is freed when its sequence ends.
            if !self.by_hash.contains_key(&hash) {
                self.by_hash.insert(hash, id);
                let meta = &mut self.meta[id as usize];
                meta.hash = Some(hash);
                meta.parent = seq.chain;
                meta.tokens = block.to_vec();
            }
            seq.chain = hash;
            seq.hashed += 1;
        }
    }

    /// For a hybrid model, where to snapshot the recurrent state of a prompt: the last block
    /// boundary that leaves at least one token to run, if it lies beyond `hit_tokens`.
    pub fn snapshot_boundary(&self, prompt_len: usize, hit_tokens: usize) -> Option<usize> {
        if !self.caching || !self.geometry.recurrent || prompt_len == 0 {
            return None;
        }
        let size = self.geometry.block_size;
        let boundary = (prompt_len - 1) / size * size;
        (boundary > hit_tokens).then_some(boundary)
    }

    /// Picks the block id to keep the snapshot at `boundary` under (the cached block with that
    /// prefix if there is one, else the sequence's own block there, registered after the step)
    /// and counts its memory. None when such a snapshot exists already or there is no room.
    pub fn take_snapshot(&mut self, seq: &SeqBlocks, tokens: &[u32], boundary: usize) -> Option<u32> {
        let size = self.geometry.block_size;
        let last = boundary / size;
        if boundary == 0 || boundary > tokens.len() || seq.table.len() < last || seq.hashed > last {
            return None;
        }
        let mut chain = seq.chain;
        for index in seq.hashed..last {
            chain = self.chain_hash(chain, &tokens[index * size..(index + 1) * size]);
        }
        let id = self.by_hash.get(&chain).copied().unwrap_or(seq.table[last - 1]);
        if self.snapshots.contains(&id) {
            return None;
        }
        // Room for the new state without touching anything committed.
        while self.physical() + self.geometry.state_units > self.geometry.blocks {
            if self.lru.is_empty() || !self.evict_one() {
                return None;
            }
        }
        self.snapshots.insert(id);
        Some(id)
    }

    /// A sequence admitted with a hit restored its state from the snapshot of `id` (or ended
    /// before it could): the snapshot is evictable again.
    pub fn restored(&mut self, id: u32) {
        if let Some(count) = self.protected.get_mut(&id) {
            *count -= 1;
            if *count == 0 {
                self.protected.remove(&id);
            }
        }
    }

    /// Snapshots sent to the ranks to drop with a step that did not run: they go with the next.
    pub fn requeue_dropped(&mut self, ids: Vec<u32>) {
        self.dropped.extend(ids);
    }

    /// The snapshot under `id` is gone (evicted, or its step never ran): tell the ranks.
    pub fn forget_snapshot(&mut self, id: u32) {
        if self.snapshots.remove(&id) {
            self.dropped.push(id);
        }
    }

    /// Snapshots the ranks should drop with the next step.
    pub fn take_dropped(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.dropped)
    }

    /// Returns a sequence's blocks: hashed ones stay cached (the tail first in line for
    /// eviction, as a tail is useless without its head), the others are free at once.
    pub fn release(&mut self, seq: SeqBlocks) {
        for &id in seq.table.iter().rev() {
            self.tick += 1;
            let meta = &mut self.meta[id as usize];
            meta.refs = meta.refs.saturating_sub(1);
            meta.last_used = self.tick;
            if meta.refs > 0 {
                continue;
            }
            self.in_use -= 1;
            if meta.hash.is_some() {
                self.lru.insert((self.tick, id));
            } else {
                meta.tokens.clear();
                self.forget_snapshot(id);
                self.recycled.push(id);
            }
        }
        self.reserved -= seq.reserve;
        if self.geometry.recurrent {
            self.live_states = self.live_states.saturating_sub(1);
        }
    }

    /// Forgets everything: the ranks dropped their caches with the old epoch.
    pub fn reset(&mut self) {
        let seed = self.seed;
        *self = Self::new(self.geometry, self.caching, "");
        self.seed = seed;
    }
}

#[cfg(test)]
#[path = "blocks_tests.rs"]
mod tests;
