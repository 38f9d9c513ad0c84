//! Layers every model family shares: RMSNorm with either weight convention, GQA attention with
//! optional per-head q/k norms, an optional output gate and partial rotary, and the SwiGLU MLP.
//!
//! Every layer takes the step's tokens concatenated, [tokens, hidden]; attention splits them
//! per sequence against each sequence's own KV cache.

use anyhow::Result;
use candle_core::{DType, Tensor};
use rayon::prelude::*;
use tpserve_kernels::norm::rms_norm_rows;

use super::SequenceInput;
use super::activation::swiglu;
use super::attention::{HeadPrep, attend_batch, attend_host};
use super::loader::ShardLoader;
use super::paged::LayerBlocks;
use super::placement::{Placement, with_host_f32};
use super::parallel::{ColumnParallelLinear, HeadLayout, RowParallelLinear, RowSlice, TpGroup};
use super::quant::Weight;
use super::rope::Rotary;

/// How a checkpoint stores an RMSNorm's scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormWeight {
    /// the layer scales by w (Qwen3, Llama; and Qwen3.5's gated norm)
    Plain,
    /// the layer scales by 1 + w, so a zero-initialised w is the identity (Qwen3.5)
    OffsetFromOne,
}

/// Rows from which [`RmsNorm::forward`] spreads a CPU's rows over the threads, and how many
/// each task takes: a 16-row decode step's norms too, now that the pool's other threads poll
/// for work over a pass (`compute_pool::KeepWarm`) rather than wait to be woken (from 64 rows
/// before; with the heads' preparation of `attention::attend_host` from 16 rows too, a 16-row
/// step 0.5-3% faster in three alternating runs).
const PARALLEL_NORM_ROWS: usize = 16;
const NORM_ROWS_PER_TASK: usize = 8;

/// RMSNorm computed in f32 (as transformers does), the result cast back to the input's dtype.
pub struct RmsNorm {
    /// the effective scale (1 + w for [`NormWeight::OffsetFromOne`]), f32
    scale: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn load(loader: &ShardLoader, name: &str, size: usize, eps: f64, kind: NormWeight) -> Result<Self> {
        let weight = loader.tensor(&format!("{name}.weight"), &[size])?.to_dtype(DType::F32)?;
        // transformers computes `1.0 + w.float()` on every call; adding once here gives the same
        // f32 value.
        let scale = match kind {
            NormWeight::Plain => weight,
            NormWeight::OffsetFromOne => (weight + 1.0)?,
        };
        Ok(Self { scale, eps })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        if let Some(normed) = self.forward_host(&x)? {
            return Ok(normed.to_dtype(dtype)?);
        }
        Ok(candle_nn::ops::rms_norm(&x, &self.scale, self.eps as f32)?.to_dtype(dtype)?)
    }

    /// On a CPU, candle's values from the row kernel (`tpserve_kernels::norm`: eight rows' sums
    /// side by side; the same kernel norms the attention heads, `attention::HeadPrep`), x and
    /// the scale read in place. None elsewhere, or for an x whose last dim is not the scale's
    /// (candle's op then gives the error).
    fn forward_host(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let width = self.scale.elem_count();
        if Placement::of(x.device()) != Placement::Host || x.dims().last() != Some(&width) {
            return Ok(None);
        }
        let eps = self.eps as f32;
        let normed = with_host_f32(&self.scale, |scale| {
            with_host_f32(x, |values| {
                let mut out = vec![0f32; values.len()];
                if values.len() >= PARALLEL_NORM_ROWS * width {
                    values.par_chunks(NORM_ROWS_PER_TASK * width).zip(out.par_chunks_mut(NORM_ROWS_PER_TASK * width)).for_each(|(x, out)| rms_norm_rows(x, width, scale, eps, out));
                } else {
                    rms_norm_rows(values, width, scale, eps, &mut out);
                }
                out
            })
        })?
        .transpose()?
        .flatten();
        Ok(normed.map(|normed| Tensor::from_vec(normed, x.shape(), x.device())).transpose()?)
    }

    pub fn weight(&self) -> &Tensor {
        &self.scale
    }

    /// The scale and eps, as the attention's CPU path takes them for its heads.
    fn host(&self) -> Result<(Vec<f32>, f32)> {
        Ok((self.scale.to_vec1::<f32>()?, self.eps as f32))
    }
}

/// Shape of an attention layer.
#[derive(Debug, Clone)]
pub struct AttentionConfig {
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// leading dimensions of each head that RoPE rotates (head_dim unless partial rotary)
    pub rotary_dim: usize,
    /// q_proj carries a sigmoid output gate per head: [query | gate] rows for every head
    pub gated: bool,
    /// per-head RMSNorm of queries and keys before RoPE (Qwen3, Qwen3.5; not Llama)
    pub qk_norm: bool,
    pub bias: bool,
    pub norm: NormWeight,
    pub eps: f64,
}

/// Causal GQA attention: q/k/v column-parallel by head (each head's [query | gate] rows stay on
/// one rank), per-head q/k RMSNorm, RoPE on the first `rotary_dim` dims, o_proj row-parallel.
pub struct Attention {
    qkv: ColumnParallelLinear,
    o_proj: RowParallelLinear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: HeadLayout,
    head_dim: usize,
    rotary_dim: usize,
    gated: bool,
}

impl Attention {
    pub fn load(loader: &ShardLoader, group: &TpGroup, config: &AttentionConfig) -> Result<Self> {
        let hd = config.head_dim;
        let heads = HeadLayout::new(group, config.num_heads, config.num_kv_heads)?;
        // With a gate, q_proj holds 2 * head_dim rows per head, so head h's rows (query and
        // gate together) are h * 2hd .. (h + 1) * 2hd.
        let q_width = if config.gated { 2 * hd } else { hd };
        let q_rows = heads.q_rows(q_width);
        let kv_rows = heads.kv_rows(hd);
        let kv_full = config.num_kv_heads * hd;
        let qkv = ColumnParallelLinear::load_fused(
            loader,
            &[
                (RowSlice { name: "q_proj", rows: vec![q_rows] }, config.num_heads * q_width),
                (RowSlice { name: "k_proj", rows: vec![kv_rows.clone()] }, kv_full),
                (RowSlice { name: "v_proj", rows: vec![kv_rows] }, kv_full),
            ],
            config.hidden_size,
            config.bias,
        )?;
        let o_proj = RowParallelLinear::load_columns(
            loader,
            group,
            "o_proj",
            config.hidden_size,
            config.num_heads * hd,
            &[heads.q_rows(hd)],
            config.bias,
        )?;
        Ok(Self {
            qkv,
            o_proj,
            q_norm: config.qk_norm.then(|| RmsNorm::load(loader, "q_norm", hd, config.eps, config.norm)).transpose()?,
            k_norm: config.qk_norm.then(|| RmsNorm::load(loader, "k_norm", hd, config.eps, config.norm)).transpose()?,
            heads,
            head_dim: hd,
            rotary_dim: config.rotary_dim,
            gated: config.gated,
        })
    }

    pub fn weights(&self) -> Vec<&Tensor> {
        let mut all = self.qkv.weights();
        all.extend(self.o_proj.weights());
        all.extend(self.q_norm.iter().chain(&self.k_norm).map(RmsNorm::weight));
        all
    }

    /// Its matrices, to gather with the other layers' (`super::arena`).
    pub fn matrices_mut(&mut self) -> Vec<&mut Weight> {
        vec![self.qkv.weight_mut(), self.o_proj.weight_mut()]
    }

    /// Elements of keys and values one token adds to this rank's cache.
    pub fn kv_elements_per_token(&self) -> usize {
        2 * self.heads.local_kv_heads * self.head_dim
    }

    /// x [tokens, hidden] -> [tokens, hidden]; `blocks` are this layer's KV blocks, which every
    /// sequence reads and writes through its block table.
    pub fn forward(
        &self,
        x: &Tensor,
        batch: &[SequenceInput<'_>],
        positions: &Tensor,
        rotary: &Rotary,
        blocks: &mut LayerBlocks,
    ) -> Result<Tensor> {
        let tokens = x.dim(0)?;
        let (hd, lq, lkv) = (self.head_dim, self.heads.local_q_heads, self.heads.local_kv_heads);
        let qkv = self.qkv.forward(x)?;
        if let Some(attended) = self.attend_host(&qkv, batch, rotary, blocks)? {
            return self.o_proj.forward(&Tensor::from_vec(attended, (tokens, lq * hd), x.device())?);
        }
        let parts = self.qkv.split(&qkv)?;
        let (q, gate) = if self.gated {
            let q_gate = parts[0].reshape((tokens, lq, 2 * hd))?;
            (q_gate.narrow(2, 0, hd)?, Some(q_gate.narrow(2, hd, hd)?.reshape((tokens, lq * hd))?))
        } else {
            (parts[0].reshape((tokens, lq, hd))?, None)
        };
        let k = parts[1].reshape((tokens, lkv, hd))?;
        let (q, k) = match (&self.q_norm, &self.k_norm) {
            (Some(q_norm), Some(k_norm)) => (q_norm.forward(&q)?, k_norm.forward(&k)?),
            _ => (q, k),
        };
        // [1, heads, tokens, head_dim] for the RoPE kernel
        let q = self.rotate(&q.transpose(0, 1)?.unsqueeze(0)?, positions, rotary)?.squeeze(0)?;
        let k = self.rotate(&k.transpose(0, 1)?.unsqueeze(0)?, positions, rotary)?.squeeze(0)?;
        let v = parts[2].reshape((tokens, lkv, hd))?.transpose(0, 1)?;

        let attended = attend_batch(&q, &k, &v, batch, blocks, lkv, hd)?; // [tokens, lq * hd]
        let attended = match gate {
            Some(gate) => (attended * candle_nn::ops::sigmoid(&gate)?)?,
            None => attended,
        };
        self.o_proj.forward(&attended)
    }

    /// [`Self::forward`]'s attention on a CPU, from the qkv product's rows read in place
    /// (`attention::attend_host`): [tokens * q_heads * head_dim], or None where it does not
    /// apply (another device or dtype, the tensor forms asked for, Qwen3.5's gated queries).
    fn attend_host(&self, qkv: &Tensor, batch: &[SequenceInput<'_>], rotary: &Rotary, blocks: &mut LayerBlocks) -> Result<Option<Vec<f32>>> {
        if self.gated || Placement::of(qkv.device()) != Placement::Host {
            return Ok(None);
        }
        let (q_norm, k_norm) = (self.q_norm.as_ref().map(RmsNorm::host).transpose()?, self.k_norm.as_ref().map(RmsNorm::host).transpose()?);
        let attended = rotary.with_host_tables(|cos, sin| -> Result<Option<Vec<f32>>> {
            let prep = HeadPrep {
                head_dim: self.head_dim,
                rotary_dim: self.rotary_dim,
                q_norm: q_norm.as_ref().map(|(scale, eps)| (&scale[..], *eps)),
                k_norm: k_norm.as_ref().map(|(scale, eps)| (&scale[..], *eps)),
                cos,
                sin,
            };
            let attended = with_host_f32(qkv, |rows| attend_host(rows, batch, blocks, &prep, self.heads.local_q_heads, self.heads.local_kv_heads))?;
            attended.unwrap_or(Ok(None))
        })?;
        Ok(attended.transpose()?.flatten())
    }

    /// RoPE on the first `rotary_dim` dims of x [1, heads, tokens, head_dim]; the rest pass
    /// through. (Qwen3.5's multimodal RoPE gives text tokens equal temporal, height and width
    /// positions, so for text it is exactly this.)
    fn rotate(&self, x: &Tensor, positions: &Tensor, rotary: &Rotary) -> Result<Tensor> {
        if self.rotary_dim == self.head_dim {
            return rotary.apply(x, positions);
        }
        let rotated = rotary.apply(&x.narrow(3, 0, self.rotary_dim)?, positions)?;
        let passed = x.narrow(3, self.rotary_dim, self.head_dim - self.rotary_dim)?;
        Ok(Tensor::cat(&[&rotated, &passed], 3)?)
    }
}

/// SwiGLU MLP: gate/up column-parallel on the intermediate dimension, down row-parallel.
pub struct Mlp {
    gate_up: ColumnParallelLinear,
    down: RowParallelLinear,
}

impl Mlp {
    /// `field` names the intermediate size in config.json, for the divisibility error.
    pub fn load(loader: &ShardLoader, group: &TpGroup, hidden: usize, intermediate: usize, field: &str) -> Result<Self> {
        let rows = group.part(field, intermediate)?;
        let gate_up = ColumnParallelLinear::load_fused(
            loader,
            &[
                (RowSlice { name: "gate_proj", rows: vec![rows.clone()] }, intermediate),
                (RowSlice { name: "up_proj", rows: vec![rows.clone()] }, intermediate),
            ],
            hidden,
            false,
        )?;
        let down = RowParallelLinear::load_columns(loader, group, "down_proj", hidden, intermediate, &[rows], false)?;
        Ok(Self { gate_up, down })
    }

    pub fn weights(&self) -> Vec<&Tensor> {
        let mut all = self.gate_up.weights();
        all.extend(self.down.weights());
        all
    }

    /// Its matrices, to gather with the other layers' (`super::arena`).
    pub fn matrices_mut(&mut self) -> Vec<&mut Weight> {
        vec![self.gate_up.weight_mut(), self.down.weight_mut()]
    }

    /// [tokens, hidden] -> [tokens, hidden], summed over ranks.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // gate and up are fused in that order, each this rank's slice of the intermediate size
        let activated = swiglu(&self.gate_up.forward(x)?)?;
        self.down.forward(&activated)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// On a CPU the norm takes the row kernel; it gives candle's `rms_norm` bits, for a few rows
    /// on one thread and for enough rows to spread over the threads (an odd number of them).
    #[test]
    fn the_host_norm_equals_candles() -> Result<()> {
        let device = Device::Cpu;
        let width = 96;
        let values = |n: usize, seed: u32| -> Vec<f32> { (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 3000) as f32 / 900.0 - 1.6).collect() };
        let norm = RmsNorm { scale: Tensor::from_vec(values(width, 9), width, &device)?, eps: 1e-6 };
        for rows in [3, 2 * PARALLEL_NORM_ROWS + 5] {
            let x = Tensor::from_vec(values(rows * width, rows as u32), (rows, width), &device)?;
            let expected = candle_nn::ops::rms_norm(&x, &norm.scale, norm.eps as f32)?;
            assert_eq!(norm.forward(&x)?.to_vec2::<f32>()?, expected.to_vec2::<f32>()?, "{rows} rows");
        }
        Ok(())
    }
}
