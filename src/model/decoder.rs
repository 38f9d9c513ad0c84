//! A pre-norm decoder whose layers choose their token mixer (full attention or Gated DeltaNet
//! linear attention) and their feed-forward (dense SwiGLU or sparse MoE): the one model every
//! family runs. The family files (`qwen3.rs` for Qwen3 dense and Llama, `qwen3_moe.rs`,
//! `qwen3_5.rs`) read their configs and build it.
//!
//! Per layer: RMSNorm -> mixer -> residual -> RMSNorm -> feed-forward -> residual, with one
//! all-reduce in each of mixer and feed-forward. A step's sequences are concatenated for every
//! linear layer and split only where state is per sequence (attention, the recurrence).

use anyhow::{Result, bail};
use candle_core::{DType, Device, Tensor};

use super::cache::{LayerCache, SequenceCache};
use super::config::ModelConfig;
use super::gated_delta_net::GatedDeltaNet;
use super::layers::{Attention, Mlp, NormWeight, RmsNorm};
use super::loader::ShardLoader;
use super::moe::SparseMoe;
use super::paged::BlockPool;
use super::parallel::{ParallelLmHead, TpGroup, VocabParallelEmbedding};
use super::quant::Weight;
use super::rope::Rotary;
use super::SequenceInput;

/// How a layer mixes information across positions.
pub enum TokenMixer {
    Attention(Attention),
    Linear(GatedDeltaNet),
}

pub enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl FeedForward {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(mlp) => mlp.forward(x),
            Self::Sparse(moe) => moe.forward(x),
        }
    }

    fn weights(&self) -> Vec<&Tensor> {
        match self {
            Self::Dense(mlp) => mlp.weights(),
            Self::Sparse(moe) => moe.weights(),
        }
    }

    fn matrices_mut(&mut self) -> Vec<&mut Weight> {
        match self {
            Self::Dense(mlp) => mlp.matrices_mut(),
            Self::Sparse(moe) => moe.matrices_mut(),
        }
    }
}

pub struct DecoderLayer {
    pub input_norm: RmsNorm,
    pub mixer: TokenMixer,
    pub post_attention_norm: RmsNorm,
    pub ffn: FeedForward,
}

impl DecoderLayer {
    fn weights(&self) -> Vec<&Tensor> {
        let mut all = vec![self.input_norm.weight(), self.post_attention_norm.weight()];
        all.extend(match &self.mixer {
            TokenMixer::Attention(attention) => attention.weights(),
            TokenMixer::Linear(linear) => linear.weights(),
        });
        all.extend(self.ffn.weights());
        all
    }

    /// Its matrices (not the norms), to gather with the other layers' (`super::arena`).
    fn matrices_mut(&mut self) -> Vec<&mut Weight> {
        let mut all = match &mut self.mixer {
            TokenMixer::Attention(attention) => attention.matrices_mut(),
            TokenMixer::Linear(linear) => linear.matrices_mut(),
        };
        all.extend(self.ffn.matrices_mut());
        all
    }
}

/// A causal LM shard built of [`DecoderLayer`]s.
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
    /// Loads the embedding, final norm and LM head around `layers`. `model` is the loader of
    /// the language model's prefix (`model` or `model.language_model`); `root` the checkpoint's
    /// top level, where `lm_head` lives.
    pub fn assemble(
        root: &ShardLoader,
        model: &ShardLoader,
        group: &TpGroup,
        config: &ModelConfig,
        layers: Vec<DecoderLayer>,
        norm_weight: NormWeight,
        rotary_dim: usize,
    ) -> Result<Self> {
        let embed = VocabParallelEmbedding::load(model, group, "embed_tokens", config.vocab_size, config.hidden_size)?;
        let norm = RmsNorm::load(model, "norm", config.hidden_size, config.rms_norm_eps, norm_weight)?;
        let lm_head = if root.contains("lm_head.weight") && !config.tie_word_embeddings {
            ParallelLmHead::load(root, group, "lm_head", config.vocab_size, config.hidden_size)?
        } else if config.tie_word_embeddings {
            ParallelLmHead::tied(&embed, group)
        } else {
            bail!("tensor \"lm_head.weight\" is missing and tie_word_embeddings is false");
        };
        let rotary = Rotary::new(rotary_dim, config.rope_theta, &config.rope_scaling, config.max_position_embeddings, root.device())?;
        Ok(Self { embed, layers, norm, lm_head, rotary, config: config.clone(), group: group.clone() })
    }

    /// The device the shard computes on.
    pub fn device(&self) -> Device {
        self.embed.weight().device()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn group(&self) -> &TpGroup {
        &self.group
    }

    /// The dtype of the embedding table (bf16 for bf16-resident weights on CPU); the compute
    /// dtype (f32) when it is held quantized.
    pub fn dtype(&self) -> DType {
        match self.embed.weight() {
            super::quant::Weight::Dense(t) => t.dtype(),
            super::quant::Weight::Panels(p) => p.dtype(),
            super::quant::Weight::Quant(_) => self.embed.compute_dtype(),
        }
    }

    pub fn weight_bytes(&self) -> usize {
        self.weight_tensors().iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }

    /// Moves the layers' matrices into one buffer of 2 MiB pages per element type
    /// ([`super::arena`]). The embedding and LM head stay: one large allocation each already,
    /// and a tied pair shares its storage.
    pub fn gather_layer_weights(&mut self) -> Result<super::arena::Gathered> {
        super::arena::gather(self.layers.iter_mut().flat_map(DecoderLayer::matrices_mut).collect())
    }

    /// Every tensor that holds a weight of this shard (a tied LM head once).
    pub fn weight_tensors(&self) -> Vec<&Tensor> {
        let mut all = self.embed.weight().tensors();
        all.push(self.norm.weight());
        if !self.config.tie_word_embeddings {
            all.extend(self.lm_head.weight().tensors());
        }
        for layer in &self.layers {
            all.extend(layer.weights());
        }
        all
    }

    /// The dtype of activations, and of the KV cache unless `--kv-cache-dtype` says otherwise.
    pub fn compute_dtype(&self) -> DType {
        self.embed.compute_dtype()
    }

    /// Bytes one more token adds to a sequence's cache on this rank, whose elements are
    /// `kv_dtype` (None: the compute dtype). Linear-attention layers add none: their state has
    /// a fixed size per sequence ([`Self::recurrent_state_bytes`]).
    pub fn kv_bytes_per_token(&self, kv_dtype: Option<DType>) -> usize {
        let elements: usize = self
            .layers
            .iter()
            .map(|layer| match &layer.mixer {
                TokenMixer::Attention(attention) => attention.kv_elements_per_token(),
                TokenMixer::Linear(_) => 0,
            })
            .sum();
        elements * kv_dtype.unwrap_or(self.compute_dtype()).size_in_bytes()
    }

    /// Bytes of one sequence's linear-attention state on this rank (conv history and memory of
    /// every Gated DeltaNet layer); 0 for models without such layers.
    pub fn recurrent_state_bytes(&self) -> usize {
        let compute = self.embed.compute_dtype().size_in_bytes();
        self.layers
            .iter()
            .map(|layer| match &layer.mixer {
                TokenMixer::Attention(_) => 0,
                TokenMixer::Linear(linear) => linear.state_bytes(compute),
            })
            .sum()
    }

    pub fn new_sequence_cache(&self) -> SequenceCache {
        SequenceCache::new(self.layers.len(), |i| matches!(self.layers[i].mixer, TokenMixer::Linear(_)))
    }

    /// Runs the new tokens of every sequence and returns the logits of each sampling
    /// sequence's last token, [sampling sequences, vocab] in f32, on the sampling rank.
    pub fn forward(
        &self,
        batch: &[SequenceInput<'_>],
        caches: &mut [&mut SequenceCache],
        pool: &mut BlockPool,
    ) -> Result<Option<Tensor>> {
        let device = self.device();
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
            let normed = layer.input_norm.forward(&hidden)?;
            let mixed = match &layer.mixer {
                TokenMixer::Attention(attention) => {
                    attention.forward(&normed, batch, &positions, &self.rotary, pool.layer_mut(index))?
                }
                TokenMixer::Linear(linear) => {
                    let mut layer_caches: Vec<&mut LayerCache> = caches.iter_mut().map(|c| &mut c.layers[index]).collect();
                    linear.forward(&normed, batch, &mut layer_caches)?
                }
            };
            hidden = (hidden + mixed)?;
            let normed = layer.post_attention_norm.forward(&hidden)?;
            hidden = (&hidden + layer.ffn.forward(&normed)?)?;
        }
        for (seq, cache) in batch.iter().zip(caches.iter_mut()) {
            cache.len = seq.start_pos + seq.tokens.len();
            cache.blocks = seq.blocks.to_vec();
        }
        // Every rank sees the same batch, so all of them agree on skipping the gather.
        if last_rows.is_empty() {
            return Ok(None);
        }
        let count = last_rows.len();
        let last = self.norm.forward(&hidden.index_select(&Tensor::from_vec(last_rows, count, &device)?, 0)?)?;
        let argmax_only: Option<Vec<&[u32]>> = batch.iter().filter(|seq| seq.sample).map(|seq| seq.argmax_only).collect();
        match argmax_only {
            Some(suppressed) => self.lm_head.forward_argmax(&last, &suppressed),
            None => self.lm_head.forward(&last),
        }
    }
}
