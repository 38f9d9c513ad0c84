//! The paged KV cache: keys and values live in fixed-size blocks of `block_size` positions, and
//! a sequence's cache is a block table (block ids in position order) that the coordinator
//! assigns. Blocks of a shared prompt prefix can thus appear in several tables at once, and the
//! memory a rank holds is a number of blocks, which the coordinator can count exactly.
//!
//! Each attention layer keeps its own blocks: keys as [kv_heads, head_dim, block_size] and values
//! as [kv_heads, block_size, head_dim]. Attention reads a sequence's history by concatenating its
//! blocks along the position axis, which yields keys already transposed for q·kᵀ and values ready
//! for probs·v in one copy each: the same single copy per step the contiguous cache made (its
//! narrowed views had to be made contiguous anyway), so decode speed does not drop.
//!
//! A decode step on a CPU (one new token of a sequence, f32) skips that copy: attention reads
//! the blocks where they are ([`LayerBlocks::host_histories`], `tpserve_kernels::attention`).
//! There the blocks may hold f16 instead of the compute dtype (`--kv-cache-dtype f16`): keys
//! and values are rounded to f16 as they are written, and the kernel widens them as it reads.
//!
//! A block's storage is allocated the first time it is written and kept for reuse, so a rank
//! never holds more than the pool's `num_blocks` blocks, however the ids are reused.

use anyhow::{Result, bail};
use candle_core::{DType, Device, Tensor};
use tpserve_kernels::attention::KvElement;

/// Positions per block unless the coordinator asks for another size.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// The KV blocks of every attention layer of one model on this rank.
pub struct BlockPool {
    block_size: usize,
    num_blocks: usize,
    /// the blocks' element type (None: the dtype of the keys written, the compute dtype)
    kv_dtype: Option<DType>,
    /// indexed by layer; empty for layers without attention
    layers: Vec<LayerBlocks>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self { block_size: block_size.max(1), num_blocks, kv_dtype: None, layers: Vec::new() }
    }

    /// Blocks holding `kv_dtype` (None: the compute dtype).
    pub fn with_kv_dtype(mut self, kv_dtype: Option<DType>) -> Self {
        self.kv_dtype = kv_dtype;
        self
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Refuses a table that names a block outside the pool or does not cover `positions`.
    pub fn check_table(&self, table: &[u32], positions: usize) -> Result<()> {
        if let Some(bad) = table.iter().find(|&&b| b as usize >= self.num_blocks) {
            bail!("block {bad} is outside the pool of {} blocks", self.num_blocks);
        }
        if table.len() * self.block_size < positions {
            bail!(
                "a block table of {} blocks holds {} positions but {positions} are needed",
                table.len(),
                table.len() * self.block_size
            );
        }
        Ok(())
    }

    pub fn layer_mut(&mut self, layer: usize) -> &mut LayerBlocks {
        if self.layers.len() <= layer {
            let (block_size, kv_dtype) = (self.block_size, self.kv_dtype);
            self.layers.resize_with(layer + 1, || LayerBlocks { block_size, kv_dtype, blocks: Vec::new() });
        }
        &mut self.layers[layer]
    }
}

/// One attention layer's blocks, by block id.
pub struct LayerBlocks {
    block_size: usize,
    kv_dtype: Option<DType>,
    blocks: Vec<Option<Block>>,
}

/// A block's keys, transposed ([kv_heads, head_dim, block_size]), and values ([kv_heads,
/// block_size, head_dim]).
enum Block {
    /// A CPU's f32 or f16 block: plain memory, which the attention kernels read in place and
    /// the step's new keys and values are written into element by element. (As tensors, a
    /// 16-sequence decode step of the 100M shape spent 0.35 ms a step in the tensor ops of the
    /// writes and 0.22 ms taking each block's storage lock to read it.)
    F32(HostKv<f32>),
    F16(HostKv<half::f16>),
    /// any other: a GPU's, or a CPU's in another dtype
    Tensors(Tensor, Tensor),
}

/// A block on a CPU, row-major as [`Block`] says.
struct HostKv<T> {
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    keys_t: Vec<T>,
    values: Vec<T>,
}

/// An element a CPU's block holds: f32 as computed, or f16 rounded to nearest as it is written.
trait HostElement: KvElement + Default {
    fn from_f32(v: f32) -> Self;
}

impl HostElement for f32 {
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl HostElement for half::f16 {
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}

impl<T: HostElement> HostKv<T> {
    fn new(kv_heads: usize, head_dim: usize, block_size: usize) -> Self {
        let elements = kv_heads * head_dim * block_size;
        Self { kv_heads, head_dim, block_size, keys_t: vec![T::default(); elements], values: vec![T::default(); elements] }
    }

    /// Position `offset` of the block gets one position's keys and values, [kv_heads, head_dim] each.
    fn put(&mut self, offset: usize, keys: &[f32], values: &[f32]) {
        let block_size = self.block_size;
        for (i, &k) in keys.iter().enumerate() {
            // element (head, d) of the position: row head * head_dim + d of the transposed keys
            self.keys_t[i * block_size + offset] = T::from_f32(k);
        }
        for (head, values) in values.chunks_exact(self.head_dim).enumerate() {
            let at = (head * block_size + offset) * self.head_dim;
            for (to, &v) in self.values[at..at + self.head_dim].iter_mut().zip(values) {
                *to = T::from_f32(v);
            }
        }
    }

    /// The block's first `positions` positions as tensors (keys transposed), widened to f32.
    fn tensors(&self, positions: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let block_size = self.block_size;
        let widen = |v: &[T]| v.iter().map(|&e| e.widen()).collect::<Vec<f32>>();
        let keys_t = Tensor::from_vec(widen(&self.keys_t), (self.kv_heads, self.head_dim, block_size), device)?;
        let values = Tensor::from_vec(widen(&self.values), (self.kv_heads, block_size, self.head_dim), device)?;
        Ok((keys_t.narrow(2, 0, positions)?, values.narrow(1, 0, positions)?))
    }

    fn view(&self, positions: usize) -> HostBlock<'_, T> {
        HostBlock { keys_t: &self.keys_t, values: &self.values, positions }
    }
}

impl LayerBlocks {
    /// Writes the keys and values [kv_heads, n, head_dim] of positions `start .. start + n` of
    /// the sequence whose blocks are `table`, and returns its whole history: keys transposed,
    /// [kv_heads, head_dim, start + n], and values [kv_heads, start + n, head_dim], contiguous,
    /// in the dtype of `keys`.
    pub fn append(&mut self, table: &[u32], start: usize, keys: &Tensor, values: &Tensor) -> Result<(Tensor, Tensor)> {
        self.write(table, start, keys, values)?;
        let (keys_t, values) = self.gather(table, start + keys.dim(1)?)?;
        Ok((keys_t.to_dtype(keys.dtype())?, values.to_dtype(keys.dtype())?))
    }

    /// Whether blocks for keys of `dtype` on `device` are plain memory ([`Block::F32`],
    /// [`Block::F16`]), written by [`Self::write_rows`] and read by [`Self::host_histories`].
    pub fn on_host(&self, dtype: DType, device: &Device) -> bool {
        device.is_cpu() && matches!(self.kv_dtype.unwrap_or(dtype), DType::F32 | DType::F16)
    }

    /// Writes the keys and values [kv_heads, n, head_dim] of positions `start .. start + n` of
    /// the sequence whose blocks are `table`.
    pub fn write(&mut self, table: &[u32], start: usize, keys: &Tensor, values: &Tensor) -> Result<()> {
        let (kv_heads, n, head_dim) = keys.dims3()?;
        let total = start + n;
        if table.len() * self.block_size < total {
            bail!("the block table covers {} positions, not {total}", table.len() * self.block_size);
        }
        if self.on_host(keys.dtype(), keys.device()) {
            // [n, kv_heads, head_dim], a position's row at a time
            let rows = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.to_dtype(DType::F32)?.transpose(0, 1)?.flatten_all()?.to_vec1::<f32>()?) };
            return self.write_rows(table, start, kv_heads, head_dim, &rows(keys)?, &rows(values)?);
        }
        let dtype = self.kv_dtype.unwrap_or(keys.dtype());
        let (keys, values) = (&keys.to_dtype(dtype)?, &values.to_dtype(dtype)?);
        let keys_t = keys.transpose(1, 2)?; // [kv, hd, n]
        let mut written = 0;
        while written < n {
            let position = start + written;
            let (index, offset) = (position / self.block_size, position % self.block_size);
            let run = (self.block_size - offset).min(n - written);
            let Block::Tensors(block_keys, block_values) = self.block(table[index], keys)? else {
                bail!("block {} holds a CPU's keys, not {:?} on {:?}", table[index], keys.dtype(), keys.device());
            };
            block_keys.slice_set(&keys_t.narrow(2, written, run)?.contiguous()?, 2, offset)?;
            block_values.slice_set(&values.narrow(1, written, run)?.contiguous()?, 1, offset)?;
            written += run;
        }
        Ok(())
    }

    /// Writes positions `start ..` of the sequence whose blocks are `table` into CPU blocks:
    /// `keys` and `values` [n, kv_heads, head_dim], f32, rounded to the blocks' dtype.
    pub fn write_rows(&mut self, table: &[u32], start: usize, kv_heads: usize, head_dim: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        let row = kv_heads * head_dim;
        let n = keys.len() / row.max(1);
        if keys.len() != n * row || values.len() != keys.len() {
            bail!("{} keys and {} values are not rows of {kv_heads} heads of {head_dim}", keys.len(), values.len());
        }
        if table.len() * self.block_size < start + n {
            bail!("the block table covers {} positions, not {}", table.len() * self.block_size, start + n);
        }
        let dtype = self.kv_dtype.unwrap_or(DType::F32);
        for (i, (keys, values)) in keys.chunks_exact(row).zip(values.chunks_exact(row)).enumerate() {
            let position = start + i;
            let (id, offset) = (table[position / self.block_size], position % self.block_size);
            match self.host_block(id, dtype, kv_heads, head_dim)? {
                Block::F32(block) => block.put(offset, keys, values),
                Block::F16(block) => block.put(offset, keys, values),
                Block::Tensors(..) => bail!("block {id} is a tensor block, not a CPU's"),
            }
        }
        Ok(())
    }

    /// Calls `f` with the histories of several sequences, (block table, positions 0..total)
    /// each, read in place from a CPU's f32 or f16 blocks: per sequence one [`HostBlock`] per
    /// block, in position order; the sequences in the order given. None when any block is not
    /// a CPU's, or the blocks' dtypes differ.
    pub fn host_histories<R>(&self, tables: &[(&[u32], usize)], f: impl FnOnce(HostHistories<'_>) -> R) -> Result<Option<R>> {
        let mut f32s = Vec::with_capacity(tables.len());
        let mut f16s = Vec::new();
        for &(table, total) in tables {
            let used = total.div_ceil(self.block_size);
            if table.len() < used {
                bail!("the block table covers {} positions, not {total}", table.len() * self.block_size);
            }
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for (i, &id) in table[..used].iter().enumerate() {
                let positions = if i + 1 == used { total - i * self.block_size } else { self.block_size };
                match self.blocks.get(id as usize).and_then(Option::as_ref) {
                    Some(Block::F32(block)) => a.push(block.view(positions)),
                    Some(Block::F16(block)) => b.push(block.view(positions)),
                    Some(Block::Tensors(..)) => return Ok(None),
                    None => bail!("block {id} is in a block table but was never written"),
                }
            }
            f32s.push(a);
            f16s.push(b);
        }
        let all_f16 = f32s.iter().all(Vec::is_empty);
        Ok(if f16s.iter().all(Vec::is_empty) {
            Some(f(HostHistories::F32(f32s)))
        } else if all_f16 {
            Some(f(HostHistories::F16(f16s)))
        } else {
            None
        })
    }

    /// The history of positions 0..total through `table`, in one copy (a CPU's blocks in f32).
    pub fn gather(&self, table: &[u32], total: usize) -> Result<(Tensor, Tensor)> {
        let used = total.div_ceil(self.block_size);
        let tail = total - (used - 1) * self.block_size;
        let mut keys = Vec::with_capacity(used);
        let mut values = Vec::with_capacity(used);
        for (i, &id) in table[..used].iter().enumerate() {
            let positions = if i + 1 == used { tail } else { self.block_size };
            let (k, v) = match self.blocks.get(id as usize).and_then(Option::as_ref) {
                Some(Block::F32(block)) => block.tensors(positions, &Device::Cpu)?,
                Some(Block::F16(block)) => block.tensors(positions, &Device::Cpu)?,
                Some(Block::Tensors(k, v)) => (k.narrow(2, 0, positions)?, v.narrow(1, 0, positions)?),
                None => bail!("block {id} is in a block table but was never written"),
            };
            keys.push(k);
            values.push(v);
        }
        Ok((Tensor::cat(&keys, 2)?.contiguous()?, Tensor::cat(&values, 1)?.contiguous()?))
    }

    /// Block `id`, allocated on first use as tensors shaped for `like` ([kv_heads, n, head_dim]).
    fn block(&mut self, id: u32, like: &Tensor) -> Result<&Block> {
        let (block_size, dtype, device) = (self.block_size, self.kv_dtype.unwrap_or(like.dtype()), like.device());
        let slot = self.slot(id);
        if slot.is_none() {
            let (heads, _, head_dim) = like.dims3()?;
            let keys = Tensor::zeros((heads, head_dim, block_size), dtype, device)?;
            let values = Tensor::zeros((heads, block_size, head_dim), dtype, device)?;
            *slot = Some(Block::Tensors(keys, values));
        }
        slot.as_ref().ok_or_else(|| anyhow::anyhow!("block {id} was not allocated"))
    }

    /// Block `id`, allocated on first use in a CPU's memory, as `dtype` (f32 or f16).
    fn host_block(&mut self, id: u32, dtype: DType, kv_heads: usize, head_dim: usize) -> Result<&mut Block> {
        let block_size = self.block_size;
        let slot = self.slot(id);
        if slot.is_none() {
            *slot = Some(match dtype {
                DType::F32 => Block::F32(HostKv::new(kv_heads, head_dim, block_size)),
                DType::F16 => Block::F16(HostKv::new(kv_heads, head_dim, block_size)),
                other => bail!("a CPU block holds f32 or f16, not {other:?}"),
            });
        }
        match slot {
            Some(Block::F32(HostKv { kv_heads: h, head_dim: d, .. }) | Block::F16(HostKv { kv_heads: h, head_dim: d, .. })) if (*h, *d) != (kv_heads, head_dim) => {
                bail!("block {id} holds {h} KV heads of {d}, not {kv_heads} of {head_dim}")
            }
            Some(block) => Ok(block),
            None => bail!("block {id} was not allocated"),
        }
    }

    fn slot(&mut self, id: u32) -> &mut Option<Block> {
        let id = id as usize;
        if self.blocks.len() <= id {
            self.blocks.resize_with(id + 1, || None);
        }
        &mut self.blocks[id]
    }
}

/// One cache block of a sequence's history, read in place on a CPU.
pub use tpserve_kernels::attention::HostBlock;

/// Sequences' histories read in place on a CPU, in the blocks' element type.
pub enum HostHistories<'a> {
    F32(Vec<Vec<HostBlock<'a, f32>>>),
    F16(Vec<Vec<HostBlock<'a, half::f16>>>),
}

/// The block table `first, first + 1, ...` for `positions` positions: for drivers that run
/// sequences without a coordinator (eval-shard, the offline parity runs), which give each
/// sequence its own range of blocks.
pub fn contiguous_table(first: u32, positions: usize, block_size: usize) -> Vec<u32> {
    (0..positions.div_ceil(block_size) as u32).map(|i| first + i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Written in uneven pieces through a scattered table, the history reads back exactly as
    /// the concatenation of what was written.
    #[test]
    fn append_through_a_scattered_table_reads_back_in_order() -> Result<()> {
        let device = Device::Cpu;
        let mut pool = BlockPool::new(16, 4);
        let table = [7u32, 2, 11, 0];
        let keys = Tensor::randn(0f32, 1.0, (2, 13, 3), &device)?;
        let values = Tensor::randn(0f32, 1.0, (2, 13, 3), &device)?;
        let layer = pool.layer_mut(1);
        let mut start = 0;
        let mut last = None;
        for n in [5, 1, 6, 1] {
            last = Some(layer.append(&table, start, &keys.narrow(1, start, n)?, &values.narrow(1, start, n)?)?);
            start += n;
        }
        let (keys_t, read_values) = last.unwrap();
        let diff = |a: &Tensor, b: &Tensor| -> Result<f32> { Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar()?) };
        assert_eq!(diff(&keys_t, &keys.transpose(1, 2)?.contiguous()?)?, 0.0);
        assert_eq!(diff(&read_values, &values)?, 0.0);
        assert_eq!(read_values.dtype(), DType::F32);
        Ok(())
    }

    /// An f16 pool holds the written keys and values rounded to f16: read in place as f16
    /// blocks (the positions in order), and gathered back in the dtype written.
    #[test]
    fn an_f16_pool_rounds_on_writing() -> Result<()> {
        let device = Device::Cpu;
        let mut pool = BlockPool::new(8, 4).with_kv_dtype(Some(DType::F16));
        let table = [5u32, 1];
        let (keys, values) = (Tensor::randn(0f32, 1.0, (2, 6, 3), &device)?, Tensor::randn(0f32, 1.0, (2, 6, 3), &device)?);
        let layer = pool.layer_mut(0);
        let (keys_t, read_values) = layer.append(&table, 0, &keys, &values)?;
        let rounded = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F16)?.to_dtype(DType::F32)?) };
        assert_eq!(read_values.dtype(), DType::F32);
        assert_eq!(read_values.flatten_all()?.to_vec1::<f32>()?, rounded(&values)?.flatten_all()?.to_vec1::<f32>()?);
        assert_eq!(keys_t.flatten_all()?.to_vec1::<f32>()?, rounded(&keys.transpose(1, 2)?.contiguous()?)?.flatten_all()?.to_vec1::<f32>()?);
        let (positions, first) = layer
            .host_histories(&[(&table, 6)], |histories| match histories {
                HostHistories::F16(all) => (all[0].iter().map(|b| b.positions).collect::<Vec<_>>(), all[0][0].values[0].to_f32()),
                HostHistories::F32(_) => (Vec::new(), f32::NAN),
            })?
            .expect("f16 blocks on a CPU");
        // two blocks of 4 and 2 positions; the first value of position 0, KV head 0
        assert_eq!(positions, [4, 2]);
        assert_eq!(first, rounded(&values.get(0)?.get(0)?)?.to_vec1::<f32>()?[0]);
        Ok(())
    }

    #[test]
    fn tables_are_checked_against_the_pool() {
        let pool = BlockPool::new(8, 4);
        assert!(pool.check_table(&[0, 7], 8).is_ok());
        assert!(pool.check_table(&[0, 8], 8).unwrap_err().to_string().contains("outside the pool"));
        assert!(pool.check_table(&[0], 5).unwrap_err().to_string().contains("positions"));
    }
}
