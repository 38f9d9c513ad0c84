//! Sparse mixture-of-experts MLP (Qwen3 MoE, Qwen3.5 MoE), tensor-parallel.
//!
//! The router is replicated: its input is the all-reduced hidden state, bit-identical on every
//! rank, so every rank picks the same experts with the same weights for every token. Each
//! expert is split on its intermediate dimension like a dense MLP, so every rank runs every
//! chosen expert on its slice. A rank adds up its partial outputs of the routed experts (each
//! scaled by its routing weight) and of the shared expert (scaled by its sigmoid gate); the
//! scalings are per token and identical on every rank, so one all-reduce completes the block.

use anyhow::{Result, bail};
use candle_core::{DType, Tensor};
use serde_json::Value;

use super::config::Fields;
use super::loader::ShardLoader;
use super::parallel::TpGroup;

/// Hyper-parameters of a sparse MoE block.
#[derive(Debug, Clone)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// experts per token (num_experts_per_tok)
    pub top_k: usize,
    /// moe_intermediate_size
    pub intermediate_size: usize,
    /// shared_expert_intermediate_size, when the block has a gated shared expert
    pub shared_intermediate_size: Option<usize>,
    /// whether the chosen experts' probabilities are renormalised to sum to one
    pub norm_topk_prob: bool,
}

impl MoeConfig {
    /// Qwen3 MoE: transformers saves the expert count as num_local_experts (num_experts is its
    /// alias); renormalisation follows norm_topk_prob (default false); no shared expert.
    pub fn qwen3_moe(text: &Value) -> Result<Self> {
        let fields = Fields(text);
        let num_experts = match fields.opt_usize("num_experts")? {
            Some(n) => n,
            None => fields.usize("num_local_experts")?,
        };
        Self {
            num_experts,
            top_k: fields.usize("num_experts_per_tok")?,
            intermediate_size: fields.usize("moe_intermediate_size")?,
            shared_intermediate_size: None,
            norm_topk_prob: fields.opt_bool("norm_topk_prob")?.unwrap_or(false),
        }
        .validated()
    }

    /// Qwen3.5 MoE: the router always renormalises, and every block has a shared expert.
    pub fn qwen3_5_moe(text: &Value) -> Result<Self> {
        let fields = Fields(text);
        Self {
            num_experts: fields.usize("num_experts")?,
            top_k: fields.usize("num_experts_per_tok")?,
            intermediate_size: fields.usize("moe_intermediate_size")?,
            shared_intermediate_size: Some(fields.usize("shared_expert_intermediate_size")?),
            norm_topk_prob: true,
        }
        .validated()
    }

    fn validated(self) -> Result<Self> {
        if self.num_experts == 0 {
            bail!("num_experts must be positive");
        }
        if self.top_k == 0 || self.top_k > self.num_experts {
            bail!(
                "num_experts_per_tok ({}) must be between 1 and num_experts ({})",
                self.top_k,
                self.num_experts
            );
        }
        if self.intermediate_size == 0 {
            bail!("moe_intermediate_size must be positive");
        }
        if self.shared_intermediate_size == Some(0) {
            bail!("shared_expert_intermediate_size must be positive");
        }
        Ok(self)
    }

    /// Fails, naming the field, when an expert cannot be split across the group.
    pub fn check_divisible(&self, group: &TpGroup) -> Result<()> {
        group.check_divisible("moe_intermediate_size", self.intermediate_size)?;
        if let Some(shared) = self.shared_intermediate_size {
            group.check_divisible("shared_expert_intermediate_size", shared)?;
        }
        Ok(())
    }
}

/// This rank's slice of one SwiGLU expert; its output is partial until summed over ranks.
struct ExpertSlice {
    gate_up: Tensor, // [2 * local_intermediate, hidden]: gate rows, then up rows
    down: Tensor,    // [hidden, local_intermediate]
}

impl ExpertSlice {
    /// Loads rows `rows` of `{prefix}.gate_proj` and `{prefix}.up_proj` and the same columns of
    /// `{prefix}.down_proj`.
    fn load(loader: &ShardLoader, prefix: &str, hidden: usize, intermediate: usize, field: &str, group: &TpGroup) -> Result<Self> {
        let rows = group.part(field, intermediate)?;
        let gate = loader.matmul_slice(&format!("{prefix}.gate_proj.weight"), &[intermediate, hidden], 0, std::slice::from_ref(&rows))?;
        let up = loader.matmul_slice(&format!("{prefix}.up_proj.weight"), &[intermediate, hidden], 0, std::slice::from_ref(&rows))?;
        let down = loader.matmul_slice(&format!("{prefix}.down_proj.weight"), &[hidden, intermediate], 1, &[rows])?;
        Ok(Self { gate_up: Tensor::cat(&[gate, up], 0)?, down })
    }

    /// x [tokens, hidden] -> this rank's partial [tokens, hidden]
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let local = self.down.dim(1)?;
        let gate_up = linear(x, &self.gate_up)?;
        let activated = (candle_nn::ops::silu(&gate_up.narrow(1, 0, local)?)? * gate_up.narrow(1, local, local)?)?;
        linear(&activated, &self.down)
    }
}

/// `x @ weight.T`, through the decode kernel when it applies (a token routed to an expert is
/// a few rows).
fn linear(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    super::parallel::matmul_transposed(x, weight)
}

/// A sparse MoE block: top-k routed experts plus, optionally, a shared expert behind a sigmoid
/// gate. One all-reduce per block.
pub struct SparseMoe {
    router: Tensor, // [experts, hidden], replicated
    experts: Vec<ExpertSlice>,
    shared: Option<(ExpertSlice, Tensor)>, // the shared expert and its gate [1, hidden]
    top_k: usize,
    norm_topk_prob: bool,
    group: TpGroup,
}

impl SparseMoe {
    /// Loads the block under `loader` (a layer's `mlp`). Experts may be stored one tensor per
    /// projection and expert (`experts.E.gate_proj.weight`, as transformers saves Qwen3 MoE and
    /// the text-only Qwen3.5 MoE) or packed (`experts.gate_up_proj` [experts, 2 * intermediate,
    /// hidden] and `experts.down_proj` [experts, hidden, intermediate], as the Qwen3.5 MoE hub
    /// checkpoints are).
    pub fn load(loader: &ShardLoader, group: &TpGroup, hidden: usize, config: &MoeConfig) -> Result<Self> {
        let (e, inter) = (config.num_experts, config.intermediate_size);
        let router = loader.tensor("gate.weight", &[e, hidden])?;
        let experts = if loader.contains("experts.gate_up_proj") {
            let rows = group.part("moe_intermediate_size", inter)?;
            let upper = rows.start + inter..rows.end + inter;
            let gate_up = loader.matmul_slice("experts.gate_up_proj", &[e, 2 * inter, hidden], 1, &[rows.clone(), upper])?;
            let down = loader.matmul_slice("experts.down_proj", &[e, hidden, inter], 2, &[rows])?;
            (0..e)
                .map(|i| Ok(ExpertSlice { gate_up: gate_up.get(i)?.contiguous()?, down: down.get(i)?.contiguous()? }))
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..e)
                .map(|i| ExpertSlice::load(loader, &format!("experts.{i}"), hidden, inter, "moe_intermediate_size", group))
                .collect::<Result<Vec<_>>>()?
        };
        let shared = match config.shared_intermediate_size {
            Some(size) => Some((
                ExpertSlice::load(loader, "shared_expert", hidden, size, "shared_expert_intermediate_size", group)?,
                loader.tensor("shared_expert_gate.weight", &[1, hidden])?,
            )),
            None => None,
        };
        Ok(Self { router, experts, shared, top_k: config.top_k, norm_topk_prob: config.norm_topk_prob, group: group.clone() })
    }

    pub fn weights(&self) -> Vec<&Tensor> {
        let mut all = vec![&self.router];
        for expert in self.experts.iter().chain(self.shared.iter().map(|(s, _)| s)) {
            all.extend([&expert.gate_up, &expert.down]);
        }
        all.extend(self.shared.iter().map(|(_, gate)| gate));
        all
    }

    /// x [tokens, hidden] -> [tokens, hidden], summed over ranks.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let device = x.device();
        let mut out = x.zeros_like()?;
        // Experts in index order, each adding into the output, as transformers accumulates them.
        for (expert, routed) in self.experts.iter().zip(self.route(x)?) {
            if routed.is_empty() {
                continue;
            }
            let (tokens, weights): (Vec<u32>, Vec<f32>) = routed.into_iter().unzip();
            let n = tokens.len();
            let index = Tensor::from_vec(tokens, n, device)?;
            let weights = Tensor::from_vec(weights, (n, 1), device)?.to_dtype(x.dtype())?;
            let partial = expert.forward(&x.index_select(&index, 0)?)?.broadcast_mul(&weights)?;
            out = out.index_add(&index, &partial, 0)?;
        }
        if let Some((shared, gate)) = &self.shared {
            let gate = candle_nn::ops::sigmoid(&linear(x, gate)?)?; // [tokens, 1]
            out = (out + shared.forward(x)?.broadcast_mul(&gate)?)?;
        }
        self.group.all_reduce(&out)
    }

    /// For every expert, the tokens routed to it and their weights: softmax over all experts in
    /// f32, the top k, renormalised when configured.
    fn route(&self, x: &Tensor) -> Result<Vec<Vec<(u32, f32)>>> {
        let logits = linear(x, &self.router)?.to_dtype(DType::F32)?;
        let probs = candle_nn::ops::softmax_last_dim(&logits)?.to_vec2::<f32>()?;
        let mut routes = vec![Vec::new(); self.experts.len()];
        let mut order: Vec<usize> = Vec::with_capacity(self.experts.len());
        for (token, row) in probs.iter().enumerate() {
            order.clear();
            order.extend(0..row.len());
            // Stable: on an exact tie the lower expert index wins.
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            let chosen = &order[..self.top_k];
            let total: f32 = chosen.iter().map(|&e| row[e]).sum();
            for &e in chosen {
                let weight = if self.norm_topk_prob { row[e] / total } else { row[e] };
                routes[e].push((token as u32, weight));
            }
        }
        Ok(routes)
    }
}
