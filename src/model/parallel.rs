//! Tensor-parallel building blocks shared by every model family (Megatron-style).
//!
//! - [`ColumnParallelLinear`]: the weight is split on its output dimension; no communication.
//! - [`RowParallelLinear`]: split on its input dimension; a local matmul then one all-reduce.
//! - [`VocabParallelEmbedding`] / [`ParallelLmHead`]: each rank holds a slice of the vocabulary.
//! - [`HeadLayout`]: which attention heads a rank owns, replicating KV heads when there are
//!   fewer of them than ranks.

use std::ops::Range;
use std::sync::Arc;

use anyhow::{Result, bail};
use candle_core::{DType, Tensor};

use super::loader::{ShardLoader, even_part};
use super::quant::Weight;
use crate::comm::Collective;

/// The rank's place in the tensor-parallel group, and the communicator that joins it.
#[derive(Clone)]
pub struct TpGroup {
    pub rank: usize,
    pub world_size: usize,
    pub comm: Arc<dyn Collective>,
}

impl TpGroup {
    pub fn new(comm: Arc<dyn Collective>) -> Self {
        Self { rank: comm.rank(), world_size: comm.world_size(), comm }
    }

    pub fn single() -> Self {
        Self::new(Arc::new(crate::comm::SingleRank))
    }

    /// Whether collectives are skipped: a group of one, unless `TPSERVE_TP1_COLLECTIVES` asks
    /// for them to run through the communicator anyway.
    pub fn skips_collectives(&self) -> bool {
        self.world_size == 1 && !crate::comm::collectives_at_tp1()
    }

    /// Sums partial results of every rank. Communicates in the tensor's dtype.
    pub fn all_reduce(&self, tensor: &Tensor) -> Result<Tensor> {
        if self.skips_collectives() {
            return Ok(tensor.clone());
        }
        Ok(self.comm.all_reduce_sum(tensor)?)
    }

    /// Fails at load time, naming the field, when `value` does not split across the group.
    pub fn check_divisible(&self, field: &str, value: usize) -> Result<()> {
        if value % self.world_size != 0 {
            bail!(
                "{field} ({value}) is not divisible by the tensor-parallel size {}; \
                 choose a TP size that divides it",
                self.world_size
            );
        }
        Ok(())
    }

    /// This rank's equal part of `0..len`; `len` must divide (checked with the field's name).
    pub fn part(&self, field: &str, len: usize) -> Result<Range<usize>> {
        self.check_divisible(field, len)?;
        let size = len / self.world_size;
        Ok(self.rank * size..(self.rank + 1) * size)
    }
}

/// `x @ weight.T` for x of shape [tokens, in] and weight [out, in], in x's dtype (the weight
/// may be held in another dtype: bf16 weights with f32 activations on CPU).
fn linear(x: &Tensor, weight: &Weight, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = weight.matmul_t(x)?;
    Ok(match bias {
        Some(bias) => y.broadcast_add(bias)?,
        None => y,
    })
}

/// `x @ weight.T`: the CPU kernel where it applies, else candle (after converting a weight held
/// in another dtype, which the CPU kernel makes rare: it takes bf16 and f16 weights at any row count).
pub(crate) fn matmul_transposed(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if let Some(y) = super::cpu_matmul::matmul_transposed(x, weight)? {
        return Ok(y);
    }
    if weight.dtype() != x.dtype() {
        return Ok(x.matmul(&weight.to_dtype(x.dtype())?.t()?)?);
    }
    Ok(x.matmul(&weight.t()?)?)
}

/// One region of a column-parallel weight: the rows `rows` of tensor `name`.
pub struct RowSlice<'a> {
    pub name: &'a str,
    pub rows: Vec<Range<usize>>,
}

/// A linear layer whose output features are split across ranks. Several checkpoint tensors
/// (q, k and v; gate and up) can be fused into one weight so the rank runs one matmul.
pub struct ColumnParallelLinear {
    weight: Weight, // [local_out, in]
    bias: Option<Tensor>,
    /// local output width of each fused part, to split the result again
    part_sizes: Vec<usize>,
}

impl ColumnParallelLinear {
    /// Loads `parts`, each `[full_rows, in_features]` in the checkpoint, keeping only the given
    /// rows, and concatenates them on the output dimension.
    pub fn load_fused(
        loader: &ShardLoader,
        parts: &[(RowSlice<'_>, usize)],
        in_features: usize,
        with_bias: bool,
    ) -> Result<Self> {
        let mut weights = Vec::with_capacity(parts.len());
        let mut biases = Vec::new();
        let mut part_sizes = Vec::with_capacity(parts.len());
        for (slice, full_rows) in parts {
            let weight_name = format!("{}.weight", slice.name);
            weights.push(loader.matmul_weight(&weight_name, &[*full_rows, in_features], 0, &slice.rows)?);
            if with_bias {
                let bias_name = format!("{}.bias", slice.name);
                biases.push(loader.slice(&bias_name, &[*full_rows], 0, &slice.rows)?);
            }
            part_sizes.push(slice.rows.iter().map(|r| r.end - r.start).sum());
        }
        let weight = Weight::cat_rows(weights)?;
        let bias = if with_bias { Some(Tensor::cat(&biases, 0)?) } else { None };
        Ok(Self { weight, bias, part_sizes })
    }

    /// A plain column-parallel layer: this rank's equal share of the rows of `name`.
    pub fn load(
        loader: &ShardLoader,
        group: &TpGroup,
        name: &str,
        field: &str,
        out_features: usize,
        in_features: usize,
        with_bias: bool,
    ) -> Result<Self> {
        let rows = group.part(field, out_features)?;
        Self::load_fused(loader, &[(RowSlice { name, rows: vec![rows] }, out_features)], in_features, with_bias)
    }

    pub fn weights(&self) -> Vec<&Tensor> {
        self.weight.tensors().into_iter().chain(self.bias.as_ref()).collect()
    }

    /// Its matrix, to gather with the layers' others (`super::arena`).
    pub fn weight_mut(&mut self) -> &mut Weight {
        &mut self.weight
    }

    /// [tokens, in] -> [tokens, local_out]
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(x, &self.weight, self.bias.as_ref())
    }

    /// The output split back into its fused parts, each [tokens, part_local_out].
    pub fn forward_split(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        self.split(&self.forward(x)?)
    }

    /// The fused parts of an output of [`Self::forward`] ([tokens, out]), as views.
    pub fn split(&self, y: &Tensor) -> Result<Vec<Tensor>> {
        let mut parts = Vec::with_capacity(self.part_sizes.len());
        let mut offset = 0;
        for &size in &self.part_sizes {
            parts.push(y.narrow(1, offset, size)?);
            offset += size;
        }
        Ok(parts)
    }
}

/// A linear layer whose input features are split across ranks: each rank multiplies its slice
/// of the activations and the partial outputs are summed with one all-reduce.
pub struct RowParallelLinear {
    weight: Weight, // [out, local_in]
    /// added once, after the reduction
    bias: Option<Tensor>,
    group: TpGroup,
}

impl RowParallelLinear {
    /// Loads the columns `columns` of `name` ([out_features, in_features] in the checkpoint).
    pub fn load_columns(
        loader: &ShardLoader,
        group: &TpGroup,
        name: &str,
        out_features: usize,
        in_features: usize,
        columns: &[Range<usize>],
        with_bias: bool,
    ) -> Result<Self> {
        let weight =
            loader.matmul_weight(&format!("{name}.weight"), &[out_features, in_features], 1, columns)?;
        let bias = if with_bias {
            Some(loader.tensor(&format!("{name}.bias"), &[out_features])?)
        } else {
            None
        };
        Ok(Self { weight, bias, group: group.clone() })
    }

    /// A plain row-parallel layer: this rank's equal share of the input features.
    pub fn load(
        loader: &ShardLoader,
        group: &TpGroup,
        name: &str,
        field: &str,
        out_features: usize,
        in_features: usize,
        with_bias: bool,
    ) -> Result<Self> {
        let columns = group.part(field, in_features)?;
        Self::load_columns(loader, group, name, out_features, in_features, &[columns], with_bias)
    }

    pub fn weights(&self) -> Vec<&Tensor> {
        self.weight.tensors().into_iter().chain(self.bias.as_ref()).collect()
    }

    /// Its matrix, to gather with the layers' others (`super::arena`).
    pub fn weight_mut(&mut self) -> &mut Weight {
        &mut self.weight
    }

    /// [tokens, local_in] -> [tokens, out], summed over ranks.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let partial = linear(x, &self.weight, None)?;
        let full = self.group.all_reduce(&partial)?;
        Ok(match &self.bias {
            Some(bias) => full.broadcast_add(bias)?,
            None => full,
        })
    }
}

/// The embedding table split by vocabulary rows. A rank looks up the ids in its range, writes
/// zeros for the others, and one all-reduce assembles the full embeddings.
pub struct VocabParallelEmbedding {
    weight: Weight, // [local_vocab, hidden], in the matmul dtype (it may be the tied LM head)
    /// dtype of the embeddings it returns
    compute_dtype: DType,
    vocab: Range<usize>,
    vocab_size: usize,
    group: TpGroup,
}

impl VocabParallelEmbedding {
    pub fn load(
        loader: &ShardLoader,
        group: &TpGroup,
        name: &str,
        vocab_size: usize,
        hidden_size: usize,
    ) -> Result<Self> {
        if vocab_size < group.world_size {
            bail!("vocab_size ({vocab_size}) is smaller than the tensor-parallel size {}", group.world_size);
        }
        let vocab = even_part(vocab_size, group.rank, group.world_size);
        let weight = loader.matmul_weight(
            &format!("{name}.weight"),
            &[vocab_size, hidden_size],
            0,
            std::slice::from_ref(&vocab),
        )?;
        Ok(Self { weight, compute_dtype: loader.dtype(), vocab, vocab_size, group: group.clone() })
    }

    /// ids [tokens] (u32) -> [tokens, hidden]. Ids must already be checked against vocab_size.
    pub fn forward(&self, ids: &[u32]) -> Result<Tensor> {
        let local_len = self.vocab.end - self.vocab.start;
        let mut local_ids = Vec::with_capacity(ids.len());
        let mut mask = Vec::with_capacity(ids.len());
        for &id in ids {
            let id = id as usize;
            if self.vocab.contains(&id) {
                local_ids.push((id - self.vocab.start) as u32);
                mask.push(1f32);
            } else {
                local_ids.push(0);
                mask.push(0f32);
            }
        }
        let device = &self.weight.device();
        let index = Tensor::from_vec(local_ids, ids.len(), device)?;
        let rows = if local_len == 0 {
            Tensor::zeros((ids.len(), self.weight.dims2()?.1), self.compute_dtype, device)?
        } else {
            self.weight.rows_f32(&index)?.to_dtype(self.compute_dtype)?
        };
        let mask = Tensor::from_vec(mask, (ids.len(), 1), device)?.to_dtype(rows.dtype())?;
        let local = rows.broadcast_mul(&mask)?;
        self.group.all_reduce(&local)
    }

    pub fn weight(&self) -> &Weight {
        &self.weight
    }

    /// The dtype of the embeddings [`Self::forward`] returns: the model's compute dtype.
    pub fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }
}

/// The output projection split by vocabulary rows. Each rank computes the logits of its slice;
/// they are gathered to the sampling rank only, so full logits never exist anywhere else.
pub struct ParallelLmHead {
    weight: Weight, // [local_vocab, hidden]
    group: TpGroup,
    sampling_rank: usize,
    /// every rank's vocabulary slice length, known to all, so the gather exchanges no shapes
    vocab_parts: Vec<usize>,
}

impl ParallelLmHead {
    pub fn load(
        loader: &ShardLoader,
        group: &TpGroup,
        name: &str,
        vocab_size: usize,
        hidden_size: usize,
    ) -> Result<Self> {
        let vocab = even_part(vocab_size, group.rank, group.world_size);
        let weight = loader.matmul_weight(&format!("{name}.weight"), &[vocab_size, hidden_size], 0, &[vocab])?;
        Ok(Self::from_weight(weight, group, vocab_size))
    }

    /// Tied embeddings: reuse the embedding's vocabulary slice.
    pub fn tied(embedding: &VocabParallelEmbedding, group: &TpGroup) -> Self {
        Self::from_weight(embedding.weight().clone(), group, embedding.vocab_size)
    }

    pub fn weight(&self) -> &Weight {
        &self.weight
    }

    fn from_weight(weight: Weight, group: &TpGroup, vocab_size: usize) -> Self {
        let vocab_parts = (0..group.world_size).map(|rank| even_part(vocab_size, rank, group.world_size).len()).collect();
        Self { weight, group: group.clone(), sampling_rank: 0, vocab_parts }
    }

    /// hidden [n, hidden] -> full logits [n, vocab] in f32 on the sampling rank, None elsewhere.
    pub fn forward(&self, hidden: &Tensor) -> Result<Option<Tensor>> {
        self.gather(linear(hidden, &self.weight, None)?.to_dtype(DType::F32)?)
    }

    /// [`ParallelLmHead::forward`] for rows whose sampler takes only the largest logit and
    /// never one of the token ids `suppressed[row]`: those values exactly where they can be the
    /// largest, NEG_INFINITY elsewhere (`PanelMatrix::argmax_logits`), the full logits where
    /// the weight has no such path. Each rank's candidates hold the largest of its slice,
    /// hence the gathered row's.
    pub fn forward_argmax(&self, hidden: &Tensor, suppressed: &[&[u32]]) -> Result<Option<Tensor>> {
        let Weight::Panels(panels) = &self.weight else { return self.forward(hidden) };
        let first: usize = self.vocab_parts[..self.group.rank].iter().sum();
        let len = self.vocab_parts[self.group.rank];
        let masked: Vec<Vec<usize>> =
            suppressed.iter().map(|ids| ids.iter().filter_map(|&id| (id as usize).checked_sub(first).filter(|&j| j < len)).collect()).collect();
        let masked: Vec<&[usize]> = masked.iter().map(Vec::as_slice).collect();
        match panels.argmax_logits(hidden, &masked)? {
            Some(local) => self.gather(local),
            None => self.forward(hidden),
        }
    }

    /// A rank's logits `[n, local vocab]` -> `[n, vocab]` on the sampling rank.
    fn gather(&self, local: Tensor) -> Result<Option<Tensor>> {
        if self.group.skips_collectives() {
            return Ok(Some(local));
        }
        Ok(self.group.comm.gather_sized(&local, 1, self.sampling_rank, &self.vocab_parts)?)
    }
}

/// Which attention heads a rank owns.
///
/// Query heads split evenly. KV heads split evenly when there are at least as many as ranks;
/// otherwise each KV head is replicated on `world_size / num_kv_heads` consecutive ranks, which
/// keeps every rank's query heads next to the KV head they attend with.
#[derive(Debug, Clone)]
pub struct HeadLayout {
    pub local_q_heads: usize,
    pub local_kv_heads: usize,
    /// first global query head of this rank
    pub first_q_head: usize,
    /// first global KV head of this rank
    pub first_kv_head: usize,
}

impl HeadLayout {
    pub fn new(group: &TpGroup, num_q_heads: usize, num_kv_heads: usize) -> Result<Self> {
        let world = group.world_size;
        group.check_divisible("num_attention_heads", num_q_heads)?;
        let local_q_heads = num_q_heads / world;
        let first_q_head = group.rank * local_q_heads;
        if num_kv_heads >= world {
            group.check_divisible("num_key_value_heads", num_kv_heads)?;
            let local_kv_heads = num_kv_heads / world;
            Ok(Self { local_q_heads, local_kv_heads, first_q_head, first_kv_head: group.rank * local_kv_heads })
        } else {
            if world % num_kv_heads != 0 {
                bail!(
                    "num_key_value_heads ({num_kv_heads}) is smaller than the tensor-parallel size \
                     {world} and does not divide it, so KV heads cannot be replicated evenly"
                );
            }
            let replicas = world / num_kv_heads;
            Ok(Self { local_q_heads, local_kv_heads: 1, first_q_head, first_kv_head: group.rank / replicas })
        }
    }

    /// Rows of a per-head projection for this rank's query heads.
    pub fn q_rows(&self, head_dim: usize) -> Range<usize> {
        self.first_q_head * head_dim..(self.first_q_head + self.local_q_heads) * head_dim
    }

    /// Rows of a per-head projection for this rank's KV heads.
    pub fn kv_rows(&self, head_dim: usize) -> Range<usize> {
        self.first_kv_head * head_dim..(self.first_kv_head + self.local_kv_heads) * head_dim
    }
}
