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
use candle_core::{DType, Storage, Tensor};

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
    /// (keys [kv_heads, head_dim, block_size], values [kv_heads, block_size, head_dim])
    blocks: Vec<Option<(Tensor, Tensor)>>,
}

impl LayerBlocks {
    /// Writes the keys and values [kv_heads, n, head_dim] of positions `start .. start + n` of
    /// the sequence whose blocks are `table`, and returns its whole history: keys transposed,
    /// [kv_heads, head_dim, start + n], and values [kv_heads, start + n, head_dim], contiguous.
    pub fn append(&mut self, table: &[u32], start: usize, keys: &Tensor, values: &Tensor) -> Result<(Tensor, Tensor)> {
        self.write(table, start, keys, values)?;
        let (keys_t, values) = self.gather(table, start + keys.dim(1)?)?;
        Ok((keys_t.to_dtype(keys.dtype())?, values.to_dtype(keys.dtype())?))
    }

    /// Writes the keys and values [kv_heads, n, head_dim] of positions `start .. start + n` of
    /// the sequence whose blocks are `table`.
    pub fn write(&mut self, table: &[u32], start: usize, keys: &Tensor, values: &Tensor) -> Result<()> {
        let n = keys.dim(1)?;
        let total = start + n;
        if table.len() * self.block_size < total {
            bail!("the block table covers {} positions, not {total}", table.len() * self.block_size);
        }
        let dtype = self.kv_dtype.unwrap_or(keys.dtype());
        let (keys, values) = (&keys.to_dtype(dtype)?, &values.to_dtype(dtype)?);
        let keys_t = keys.transpose(1, 2)?; // [kv, hd, n]
        let mut written = 0;
        while written < n {
            let position = start + written;
            let (index, offset) = (position / self.block_size, position % self.block_size);
            let run = (self.block_size - offset).min(n - written);
            let (block_keys, block_values) = self.block(table[index], keys)?;
            block_keys.slice_set(&keys_t.narrow(2, written, run)?.contiguous()?, 2, offset)?;
            block_values.slice_set(&values.narrow(1, written, run)?.contiguous()?, 1, offset)?;
            written += run;
        }
        Ok(())
    }

    /// Calls `f` with the histories of several sequences, (block table, positions 0..total)
    /// each, read in place from a CPU's f32 or f16 blocks: per sequence one [`HostBlock`] per
    /// block, in position order; the sequences in the order given. None when any block is on
    /// another device or in another dtype.
    pub fn host_histories<R>(&self, tables: &[(&[u32], usize)], f: impl FnOnce(HostHistories<'_>) -> R) -> Result<Option<R>> {
        let mut guards = Vec::with_capacity(tables.len());
        let mut dtype = None;
        for &(table, total) in tables {
            let used = total.div_ceil(self.block_size);
            if table.len() < used {
                bail!("the block table covers {} positions, not {total}", table.len() * self.block_size);
            }
            let mut sequence = Vec::with_capacity(used);
            for &id in &table[..used] {
                let Some((k, v)) = self.blocks.get(id as usize).and_then(Option::as_ref) else {
                    bail!("block {id} is in a block table but was never written");
                };
                if !matches!(k.dtype(), DType::F32 | DType::F16) || !k.device().is_cpu() || *dtype.get_or_insert(k.dtype()) != k.dtype() {
                    return Ok(None);
                }
                sequence.push((k.storage_and_layout(), v.storage_and_layout()));
            }
            guards.push((sequence, total));
        }
        let mut cpu = Vec::with_capacity(guards.len());
        for (sequence, total) in &guards {
            let mut blocks = Vec::with_capacity(sequence.len());
            for ((k, k_layout), (v, v_layout)) in sequence {
                let (Storage::Cpu(k), Storage::Cpu(v)) = (&**k, &**v) else { return Ok(None) };
                blocks.push(((k, *k_layout), (v, *v_layout)));
            }
            cpu.push((blocks, *total));
        }
        Ok(Some(match dtype {
            Some(DType::F16) => f(HostHistories::F16(cpu.iter().map(|(blocks, total)| self.host_blocks(blocks, *total)).collect::<Result<_>>()?)),
            _ => f(HostHistories::F32(cpu.iter().map(|(blocks, total)| self.host_blocks(blocks, *total)).collect::<Result<_>>()?)),
        }))
    }

    /// A sequence's blocks of [`Self::host_histories`] as slices of `T`, the blocks' element type.
    fn host_blocks<'a, T: candle_core::WithDType>(&self, storage: &[CpuBlock<'a, '_>], total: usize) -> Result<Vec<HostBlock<'a, T>>> {
        let mut history = Vec::with_capacity(storage.len());
        for (i, ((k, k_layout), (v, v_layout))) in storage.iter().enumerate() {
            // Blocks are allocated whole and contiguous (`block`): their elements are the
            // storage's from the layout's offset.
            let k = &k.as_slice::<T>()?[k_layout.start_offset()..k_layout.start_offset() + k_layout.shape().elem_count()];
            let v = &v.as_slice::<T>()?[v_layout.start_offset()..v_layout.start_offset() + v_layout.shape().elem_count()];
            let positions = if i + 1 == storage.len() { total - i * self.block_size } else { self.block_size };
            history.push(HostBlock { keys_t: k, values: v, positions });
        }
        Ok(history)
    }

    /// The history of positions 0..total through `table`, in one copy.
    pub fn gather(&self, table: &[u32], total: usize) -> Result<(Tensor, Tensor)> {
        let used = total.div_ceil(self.block_size);
        let tail = total - (used - 1) * self.block_size;
        let mut keys = Vec::with_capacity(used);
        let mut values = Vec::with_capacity(used);
        for (i, &id) in table[..used].iter().enumerate() {
            let Some((k, v)) = self.blocks.get(id as usize).and_then(Option::as_ref) else {
                bail!("block {id} is in a block table but was never written");
            };
            if i + 1 == used && tail < self.block_size {
                keys.push(k.narrow(2, 0, tail)?);
                values.push(v.narrow(1, 0, tail)?);
            } else {
                keys.push(k.clone());
                values.push(v.clone());
            }
        }
        Ok((Tensor::cat(&keys, 2)?.contiguous()?, Tensor::cat(&values, 1)?.contiguous()?))
    }

    /// The storage of block `id`, allocated on first use with the shape of `like`
    /// ([kv_heads, n, head_dim]).
    fn block(&mut self, id: u32, like: &Tensor) -> Result<&(Tensor, Tensor)> {
        let id = id as usize;
        if self.blocks.len() <= id {
            self.blocks.resize_with(id + 1, || None);
        }
        if self.blocks[id].is_none() {
            let (heads, _, head_dim) = like.dims3()?;
            let (dtype, device) = (self.kv_dtype.unwrap_or(like.dtype()), like.device());
            let keys = Tensor::zeros((heads, head_dim, self.block_size), dtype, device)?;
            let values = Tensor::zeros((heads, self.block_size, head_dim), dtype, device)?;
            self.blocks[id] = Some((keys, values));
        }
        match &self.blocks[id] {
            Some(block) => Ok(block),
            None => bail!("block {id} was not allocated"),
        }
    }
}

/// One cache block of a sequence's history, read in place on a CPU.
pub use tpserve_kernels::attention::HostBlock;

/// A block's keys and values on a CPU: (storage, layout) each.
type CpuBlock<'a, 'l> = ((&'a candle_core::CpuStorage, &'l candle_core::Layout), (&'a candle_core::CpuStorage, &'l candle_core::Layout));

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
