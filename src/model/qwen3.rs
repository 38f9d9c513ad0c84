//! Qwen3 dense (and Llama, which is Qwen3 without the q/k norms), tensor-parallel.
//!
//! Per layer: RMSNorm -> attention (q/k/v column-parallel, per-head q/k RMSNorm, RoPE, GQA,
//! o_proj row-parallel) -> residual -> RMSNorm -> SwiGLU MLP (gate/up column-parallel, down
//! row-parallel) -> residual. Two all-reduces per layer.
//!
//! A step carries several sequences; their tokens are concatenated for every linear layer
//! ([tokens, hidden]) and split again only for attention, which is per sequence.

use anyhow::{Result, bail};
use candle_core::{DType, Device, Tensor};

use super::cache::{LayerCache, SequenceCache};
use super::config::ModelConfig;
use super::layers::Mlp;
use super::loader::ShardLoader;
use super::parallel::{
    ColumnParallelLinear, HeadLayout, ParallelLmHead, RowParallelLinear, RowSlice, TpGroup,
    VocabParallelEmbedding,
};
use super::{SequenceInput, rms_norm};

/// RMSNorm with a learned scale, computed in f32 as transformers does.
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn load(loader: &ShardLoader, name: &str, size: usize, eps: f64) -> Result<Self> {
        Ok(Self { weight: loader.tensor(&format!("{name}.weight"), &[size])?, eps })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm(x, &self.weight, self.eps)
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
}

/// cos/sin tables for every position, [max_positions, rotary_dim / 2].
pub struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    pub fn new(rotary_dim: usize, theta: f64, max_positions: usize, device: &Device) -> Result<Self> {
        // Same formula and precision as transformers' default RoPE: f32 inverse frequencies,
        // f32 angles.
        let inv_freq: Vec<f32> = (0..rotary_dim / 2)
            .map(|i| (1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64)) as f32)
            .collect();
        let mut cos = Vec::with_capacity(max_positions * inv_freq.len());
        let mut sin = Vec::with_capacity(max_positions * inv_freq.len());
        for position in 0..max_positions {
            for &f in &inv_freq {
                let angle = position as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let shape = (max_positions, inv_freq.len());
        Ok(Self { cos: Tensor::from_vec(cos, shape, device)?, sin: Tensor::from_vec(sin, shape, device)? })
    }

    /// x [1, heads, tokens, rotary_dim] rotated at `positions` (one per token).
    pub fn apply(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
        let cos = self.cos.index_select(positions, 0)?.to_dtype(x.dtype())?;
        let sin = self.sin.index_select(positions, 0)?.to_dtype(x.dtype())?;
        Ok(candle_nn::rotary_emb::rope(&x.contiguous()?, &cos, &sin)?)
    }
}

struct Attention {
    qkv: ColumnParallelLinear,
    o_proj: RowParallelLinear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: HeadLayout,
    head_dim: usize,
}

impl Attention {
    fn load(loader: &ShardLoader, group: &TpGroup, config: &ModelConfig) -> Result<Self> {
        let hd = config.head_dim;
        let heads = HeadLayout::new(group, config.num_attention_heads, config.num_key_value_heads)?;
        let q_rows = heads.q_rows(hd);
        let kv_rows = heads.kv_rows(hd);
        let q_full = config.num_attention_heads * hd;
        let kv_full = config.num_key_value_heads * hd;
        let qkv = ColumnParallelLinear::load_fused(
            loader,
            &[
                (RowSlice { name: "q_proj", rows: vec![q_rows.clone()] }, q_full),
                (RowSlice { name: "k_proj", rows: vec![kv_rows.clone()] }, kv_full),
                (RowSlice { name: "v_proj", rows: vec![kv_rows] }, kv_full),
            ],
            config.hidden_size,
            config.attention_bias,
        )?;
        let o_proj = RowParallelLinear::load_columns(
            loader,
            group,
            "o_proj",
            config.hidden_size,
            q_full,
            &[q_rows],
            false,
        )?;
        let (q_norm, k_norm) = if config.qk_norm {
            (
                Some(RmsNorm::load(loader, "q_norm", hd, config.rms_norm_eps)?),
                Some(RmsNorm::load(loader, "k_norm", hd, config.rms_norm_eps)?),
            )
        } else {
            (None, None)
        };
        Ok(Self { qkv, o_proj, q_norm, k_norm, heads, head_dim: hd })
    }

    /// x [tokens, hidden] -> [tokens, hidden]
    fn forward(
        &self,
        x: &Tensor,
        batch: &[SequenceInput<'_>],
        positions: &Tensor,
        rotary: &Rotary,
        caches: &mut [&mut LayerCache],
    ) -> Result<Tensor> {
        let tokens = x.dim(0)?;
        let (hd, lq, lkv) = (self.head_dim, self.heads.local_q_heads, self.heads.local_kv_heads);
        let parts = self.qkv.forward_split(x)?;
        let (q, k, v) = (&parts[0], &parts[1], &parts[2]);
        let mut q = q.reshape((tokens, lq, hd))?;
        let mut k = k.reshape((tokens, lkv, hd))?;
        if let (Some(q_norm), Some(k_norm)) = (&self.q_norm, &self.k_norm) {
            q = q_norm.forward(&q)?;
            k = k_norm.forward(&k)?;
        }
        // [1, heads, tokens, head_dim] for the RoPE kernel
        let q = rotary.apply(&q.transpose(0, 1)?.unsqueeze(0)?, positions)?.squeeze(0)?;
        let k = rotary.apply(&k.transpose(0, 1)?.unsqueeze(0)?, positions)?.squeeze(0)?;
        let v = v.reshape((tokens, lkv, hd))?.transpose(0, 1)?;

        let mut outputs = Vec::with_capacity(batch.len());
        let mut offset = 0;
        for (seq, cache) in batch.iter().zip(caches.iter_mut()) {
            let n = seq.tokens.len();
            let LayerCache::Attention(kv) = &mut **cache else { bail!("sequence {}: not an attention cache", seq.seq_id) };
            let (keys, values) =
                kv.append(&k.narrow(1, offset, n)?, &v.narrow(1, offset, n)?)?;
            let q_seq = q.narrow(1, offset, n)?;
            outputs.push(attend(&q_seq, &keys, &values, seq.start_pos, lkv, hd)?);
            offset += n;
        }
        let attended = Tensor::cat(&outputs, 0)?; // [tokens, lq * hd]
        self.o_proj.forward(&attended)
    }
}

/// Causal scaled-dot-product attention of one sequence against its cached history.
/// q [q_heads, n, hd]; keys, values [kv_heads, total, hd]; returns [n, q_heads * hd].
pub fn attend(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    start_pos: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let (q_heads, n, _) = q.dims3()?;
    let total = keys.dim(1)?;
    let group = q_heads / kv_heads;
    let compute = q.dtype();
    // Fold the query heads that share a KV head into the row dimension: [kv, group * n, hd].
    let q = q.contiguous()?.reshape((kv_heads, group * n, head_dim))?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let scores = (q.matmul(&keys.t()?.contiguous()?)? * scale)?; // [kv, group * n, total]
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

/// [n, total]: 0 where query i (at position start + i) may see key j, -inf elsewhere.
fn causal_mask(n: usize, total: usize, start: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..total).map(move |j| if j <= start + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(mask, (n, total), device)?)
}

struct DecoderLayer {
    input_norm: RmsNorm,
    attention: Attention,
    post_attention_norm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn weights(&self) -> Vec<&Tensor> {
        let mut all = vec![self.input_norm.weight(), self.post_attention_norm.weight()];
        all.extend(self.attention.qkv.weights());
        all.extend(self.attention.o_proj.weights());
        all.extend(self.attention.q_norm.iter().map(RmsNorm::weight));
        all.extend(self.attention.k_norm.iter().map(RmsNorm::weight));
        all.extend(self.mlp.weights());
        all
    }

    fn load(loader: &ShardLoader, group: &TpGroup, config: &ModelConfig) -> Result<Self> {
        let h = config.hidden_size;
        Ok(Self {
            input_norm: RmsNorm::load(loader, "input_layernorm", h, config.rms_norm_eps)?,
            attention: Attention::load(&loader.pp("self_attn"), group, config)?,
            post_attention_norm: RmsNorm::load(loader, "post_attention_layernorm", h, config.rms_norm_eps)?,
            mlp: Mlp::load(&loader.pp("mlp"), group, h, config.intermediate_size, "intermediate_size")?,
        })
    }
}

/// A Qwen3 (or Llama) causal LM shard.
pub struct Model {
    embed: VocabParallelEmbedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: ParallelLmHead,
    rotary: Rotary,
    config: ModelConfig,
    group: TpGroup,
}

impl Model {
    pub fn load(loader: &ShardLoader, group: &TpGroup, config: &ModelConfig) -> Result<Self> {
        // Check every divisibility requirement up front, so the error names the field before
        // any bytes are read.
        HeadLayout::new(group, config.num_attention_heads, config.num_key_value_heads)?;
        group.check_divisible("intermediate_size", config.intermediate_size)?;
        let model = loader.pp("model");
        let embed = VocabParallelEmbedding::load(&model, group, "embed_tokens", config.vocab_size, config.hidden_size)?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| DecoderLayer::load(&model.pp(format!("layers.{i}")), group, config))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(&model, "norm", config.hidden_size, config.rms_norm_eps)?;
        let lm_head = if config.tie_word_embeddings || !loader.contains("lm_head.weight") {
            if !config.tie_word_embeddings {
                bail!("tensor \"lm_head.weight\" is missing and tie_word_embeddings is false");
            }
            ParallelLmHead::tied(&embed, group)
        } else {
            ParallelLmHead::load(loader, group, "lm_head", config.vocab_size, config.hidden_size)?
        };
        let rotary = Rotary::new(config.head_dim, config.rope_theta, config.max_position_embeddings, loader.device())?;
        Ok(Self { embed, layers, norm, lm_head, rotary, config: config.clone(), group: group.clone() })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn group(&self) -> &TpGroup {
        &self.group
    }

    pub fn dtype(&self) -> DType {
        self.embed.weight().dtype()
    }

    pub fn weight_bytes(&self) -> usize {
        self.weights().iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }

    fn weights(&self) -> Vec<&Tensor> {
        let mut all = vec![self.embed.weight(), self.norm.weight()];
        if !self.config.tie_word_embeddings {
            all.push(self.lm_head.weight());
        }
        for layer in &self.layers {
            all.extend(layer.weights());
        }
        all
    }

    pub fn kv_bytes_per_token(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| 2 * l.attention.heads.local_kv_heads * l.attention.head_dim)
            .sum();
        per_layer * self.dtype().size_in_bytes()
    }

    pub fn new_sequence_cache(&self) -> SequenceCache {
        SequenceCache::new_attention(self.layers.len())
    }

    /// Runs the new tokens of every sequence and returns the logits of each sequence's last
    /// token, [sequences, vocab] in f32, on the sampling rank (None on the others).
    pub fn forward(&self, batch: &[SequenceInput<'_>], caches: &mut [&mut SequenceCache]) -> Result<Option<Tensor>> {
        let device = self.embed.weight().device().clone();
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut last_rows = Vec::with_capacity(batch.len());
        for seq in batch {
            ids.extend_from_slice(seq.tokens);
            positions.extend((seq.start_pos..seq.start_pos + seq.tokens.len()).map(|p| p as u32));
            if seq.sample {
                last_rows.push((ids.len() - 1) as u32);
            }
        }
        let positions = Tensor::from_vec(positions, ids.len(), &device)?;
        let mut hidden = self.embed.forward(&ids)?;
        for (index, layer) in self.layers.iter().enumerate() {
            let mut layer_caches: Vec<&mut LayerCache> =
                caches.iter_mut().map(|c| &mut c.layers[index]).collect();
            let normed = layer.input_norm.forward(&hidden)?;
            let attended = layer.attention.forward(&normed, batch, &positions, &self.rotary, &mut layer_caches)?;
            hidden = (hidden + attended)?;
            let normed = layer.post_attention_norm.forward(&hidden)?;
            hidden = (&hidden + layer.mlp.forward(&normed)?)?;
        }
        for (seq, cache) in batch.iter().zip(caches.iter_mut()) {
            cache.len = seq.start_pos + seq.tokens.len();
        }
        // Every rank sees the same batch, so all of them agree on skipping the gather.
        if last_rows.is_empty() {
            return Ok(None);
        }
        let last_rows = Tensor::from_vec(last_rows.clone(), last_rows.len(), &device)?;
        let last = hidden.index_select(&last_rows, 0)?;
        let last = self.norm.forward(&last)?;
        self.lm_head.forward(&last)
    }
}

