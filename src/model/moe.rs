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
use rayon::prelude::*;
use serde_json::Value;

use super::activation::swiglu;
use super::config::Fields;
use super::loader::ShardLoader;
use super::parallel::TpGroup;
use super::placement::Placement;
use super::quant::Weight;

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
/// Held as the load holds its matrices (`ShardLoader::weight_from`): in the `--quantize` format,
/// else dense (in column panels on a CPU that has them).
struct ExpertSlice {
    gate_up: Weight, // [2 * local_intermediate, hidden]: gate rows, then up rows
    down: Weight,    // [hidden, local_intermediate]
}

impl ExpertSlice {
    /// Loads rows `rows` of `{prefix}.gate_proj` and `{prefix}.up_proj` and the same columns of
    /// `{prefix}.down_proj`.
    fn load(loader: &ShardLoader, prefix: &str, hidden: usize, intermediate: usize, field: &str, group: &TpGroup) -> Result<Self> {
        let rows = group.part(field, intermediate)?;
        let gate = loader.matmul_slice(&format!("{prefix}.gate_proj.weight"), &[intermediate, hidden], 0, std::slice::from_ref(&rows))?;
        let up = loader.matmul_slice(&format!("{prefix}.up_proj.weight"), &[intermediate, hidden], 0, std::slice::from_ref(&rows))?;
        let down = loader.matmul_slice(&format!("{prefix}.down_proj.weight"), &[hidden, intermediate], 1, &[rows])?;
        Ok(Self { gate_up: loader.weight_from(Tensor::cat(&[gate, up], 0)?)?, down: loader.weight_from(down)? })
    }

    /// x [tokens, hidden] -> this rank's partial [tokens, hidden]
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let activated = swiglu(&self.gate_up.matmul_t(x)?)?; // gate_up holds gate then up
        self.down.matmul_t(&activated)
    }
}

/// `x @ weight.T` for the router and the shared expert's gate (one or a few output columns,
/// row-major: the decode kernel when it applies).
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
    /// the text-only Qwen3.5 MoE), packed (`experts.gate_up_proj` [experts, 2 * intermediate,
    /// hidden] and `experts.down_proj` [experts, hidden, intermediate], as the Qwen3.5 MoE hub
    /// checkpoints are), or stacked one tensor per projection (`experts.gate_proj` and
    /// `experts.up_proj` [experts, intermediate, hidden], `experts.down_proj`: a GGUF's
    /// `ffn_*_exps`, kept in its blocks).
    pub fn load(loader: &ShardLoader, group: &TpGroup, hidden: usize, config: &MoeConfig) -> Result<Self> {
        let (e, inter) = (config.num_experts, config.intermediate_size);
        let router = loader.tensor("gate.weight", &[e, hidden])?;
        let experts = if loader.contains("experts.gate_up_proj") || loader.contains("experts.gate_proj") {
            // Packed or stacked: every expert's rows of one tensor (or of gate's and up's,
            // joined) read at once, then down's columns.
            let rows = group.part("moe_intermediate_size", inter)?;
            let gate_up = if loader.contains("experts.gate_up_proj") {
                let upper = rows.start + inter..rows.end + inter;
                loader.stacked_matmul_weights(&["experts.gate_up_proj"], &[e, 2 * inter, hidden], 0, &[rows.clone(), upper])?
            } else {
                loader.stacked_matmul_weights(&["experts.gate_proj", "experts.up_proj"], &[e, inter, hidden], 0, std::slice::from_ref(&rows))?
            };
            let down = loader.stacked_matmul_weights(&["experts.down_proj"], &[e, hidden, inter], 1, &[rows])?;
            gate_up.into_iter().zip(down).map(|(gate_up, down)| ExpertSlice { gate_up, down }).collect()
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

    /// Its experts' matrices, to gather with the other layers' (`super::arena`).
    pub fn matrices_mut(&mut self) -> Vec<&mut Weight> {
        let shared = self.shared.iter_mut().map(|(s, _)| s);
        self.experts.iter_mut().chain(shared).flat_map(|e| [&mut e.gate_up, &mut e.down]).collect()
    }

    pub fn weights(&self) -> Vec<&Tensor> {
        let mut all = vec![&self.router];
        for expert in self.experts.iter().chain(self.shared.iter().map(|(s, _)| s)) {
            all.extend(expert.gate_up.tensors());
            all.extend(expert.down.tensors());
        }
        all.extend(self.shared.iter().map(|(_, gate)| gate));
        all
    }

    /// x [tokens, hidden] -> [tokens, hidden], summed over ranks.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let routes = self.route(x)?;
        let weights = routes.weights.to_dtype(x.dtype())?;
        // Each chosen expert's tokens: (expert, their indices, their routing weights).
        let mut chosen = Vec::new();
        let mut offset = 0;
        for (expert, &count) in self.experts.iter().zip(&routes.counts) {
            if count > 0 {
                chosen.push((expert, routes.tokens.narrow(0, offset, count)?, weights.narrow(0, offset, count)?));
                offset += count;
            }
        }
        let partial = |(expert, index, weights): &(&ExpertSlice, Tensor, Tensor)| -> Result<Tensor> {
            Ok(expert.forward(&x.index_select(index, 0)?)?.broadcast_mul(weights)?)
        };
        let shared = |(shared, gate): &(ExpertSlice, Tensor)| -> Result<Tensor> {
            let gate = candle_nn::ops::sigmoid(&linear(x, gate)?)?; // [tokens, 1]
            Ok(shared.forward(x)?.broadcast_mul(&gate)?)
        };
        // On a CPU the experts run side by side, one per thread at a time: a decode step's
        // experts are a few small products each, too short to split well over the threads and
        // each a fork and join of its own when run one after another. Each product's result
        // does not depend on the thread that computes it, and the sums below keep their order.
        let (partials, shared) = match Placement::of(x.device()) {
            Placement::Host => rayon::join(
                || chosen.par_iter().map(partial).collect::<Result<Vec<_>>>(),
                || self.shared.as_ref().map(shared).transpose(),
            ),
            Placement::Device => (chosen.iter().map(partial).collect(), self.shared.as_ref().map(shared).transpose()),
        };
        // Experts in index order, each adding into the output, as transformers accumulates them.
        let mut out = x.zeros_like()?;
        for ((_, index, _), partial) in chosen.iter().zip(partials?) {
            out = out.index_add(index, &partial, 0)?;
        }
        if let Some(shared) = shared? {
            out = (out + shared)?;
        }
        self.group.all_reduce(&out)
    }

    /// Softmax over all experts in f32, the top k, renormalised when configured.
    fn route(&self, x: &Tensor) -> Result<Routes> {
        let logits = linear(x, &self.router)?.to_dtype(DType::F32)?;
        let probs = candle_nn::ops::softmax_last_dim(&logits)?;
        match Placement::of(x.device()) {
            Placement::Host => Routes::on_host(&probs, self.top_k, self.norm_topk_prob),
            Placement::Device => Routes::with_tensor_ops(&probs, self.top_k, self.norm_topk_prob),
        }
    }
}

/// The tokens routed to each expert and their routing weights, grouped by expert in index
/// order and by token within an expert: expert e's are the `counts[e]` entries after those of
/// the experts before it. The forward pass takes each expert's as one slice.
struct Routes {
    tokens: Tensor,  // [tokens * top_k] u32
    weights: Tensor, // [tokens * top_k, 1] f32
    counts: Vec<usize>,
}

impl Routes {
    /// From the probabilities [tokens, experts] as a host loop (a CPU's: one sort per token
    /// beats the tensor ops).
    fn on_host(probs: &Tensor, top_k: usize, norm_topk_prob: bool) -> Result<Self> {
        let (device, experts) = (probs.device(), probs.dim(1)?);
        let probs = probs.to_vec2::<f32>()?;
        let mut routes = vec![Vec::new(); experts];
        let mut order: Vec<usize> = Vec::with_capacity(experts);
        for (token, row) in probs.iter().enumerate() {
            order.clear();
            order.extend(0..row.len());
            // Stable: on an exact tie the lower expert index wins.
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            let chosen = &order[..top_k.min(experts)];
            let total: f32 = chosen.iter().map(|&e| row[e]).sum();
            for &e in chosen {
                let weight = if norm_topk_prob { row[e] / total } else { row[e] };
                routes[e].push((token as u32, weight));
            }
        }
        let counts = routes.iter().map(Vec::len).collect();
        let (tokens, weights): (Vec<u32>, Vec<f32>) = routes.into_iter().flatten().unzip();
        let n = tokens.len();
        Ok(Self {
            tokens: Tensor::from_vec(tokens, n, device)?,
            weights: Tensor::from_vec(weights, (n, 1), device)?,
            counts,
        })
    }

    /// The same with the top k and their weights as tensor ops on the probabilities' device (a
    /// GPU's). The host gets one copy: the chosen experts' ids (tokens x k u32, never the
    /// probabilities), because it sizes each expert's matmul. It groups them by expert and
    /// sends back two index vectors, copies it does not wait for.
    fn with_tensor_ops(probs: &Tensor, top_k: usize, norm_topk_prob: bool) -> Result<Self> {
        let (tokens, experts) = probs.dims2()?;
        let k = top_k.min(experts);
        let chosen = probs.arg_sort_last_dim(false)?.narrow(1, 0, k)?.contiguous()?; // [tokens, k] u32
        let mut weights = probs.gather(&chosen, 1)?; // [tokens, k]
        if norm_topk_prob {
            weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
        }
        let (slots, counts) = group_by_expert(&chosen.flatten_all()?.to_vec1::<u32>()?, experts)?;
        let token_of_slot: Vec<u32> = slots.iter().map(|&slot| slot / k as u32).collect();
        let slots = Tensor::from_vec(slots, tokens * k, probs.device())?;
        Ok(Self {
            tokens: Tensor::from_vec(token_of_slot, tokens * k, probs.device())?,
            weights: weights.flatten_all()?.index_select(&slots, 0)?.unsqueeze(1)?,
            counts,
        })
    }
}

/// A counting sort of the chosen expert ids ([tokens * k], token-major): the slots
/// (token * k + j) grouped by expert in index order, token order kept within an expert, and
/// each expert's count.
fn group_by_expert(ids: &[u32], experts: usize) -> Result<(Vec<u32>, Vec<usize>)> {
    let mut counts = vec![0usize; experts];
    for &id in ids {
        match counts.get_mut(id as usize) {
            Some(count) => *count += 1,
            None => bail!("the router chose expert {id} of {experts}"),
        }
    }
    // Where each expert's slots begin.
    let mut next: Vec<usize> = counts
        .iter()
        .scan(0, |start, &count| {
            *start += count;
            Some(*start - count)
        })
        .collect();
    let mut slots = vec![0u32; ids.len()];
    for (slot, &id) in ids.iter().enumerate() {
        slots[next[id as usize]] = slot as u32;
        next[id as usize] += 1;
    }
    Ok((slots, counts))
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// The tensor-op routing (a GPU's) picks the same experts for the same tokens, in the same
    /// order, as the host loop (a CPU's), with the same weights to float rounding; with and
    /// without renormalisation, for one token and for many.
    #[test]
    fn routing_with_tensor_ops_equals_the_host_loop() -> Result<()> {
        for (tokens, experts, top_k) in [(1, 4, 2), (37, 16, 4), (64, 128, 8)] {
            let logits = Tensor::randn(0f32, 2.0, (tokens, experts), &Device::Cpu)?;
            let probs = candle_nn::ops::softmax_last_dim(&logits)?;
            for norm in [false, true] {
                let host = Routes::on_host(&probs, top_k, norm)?;
                let device = Routes::with_tensor_ops(&probs, top_k, norm)?;
                let label = format!("{tokens} tokens, {experts} experts, top {top_k}, renormalised {norm}");
                assert_eq!(host.counts, device.counts, "{label}: counts");
                assert_eq!(host.tokens.to_vec1::<u32>()?, device.tokens.to_vec1::<u32>()?, "{label}: tokens");
                let diff: f32 = (&host.weights - &device.weights)?.abs()?.flatten_all()?.max(0)?.to_scalar()?;
                assert!(diff < 1e-6, "{label}: weights differ by {diff}");
            }
        }
        Ok(())
    }

    #[test]
    fn chosen_experts_group_by_expert_in_token_order() -> Result<()> {
        // Three tokens, top 2: token 0 chose experts 2 and 0, token 1 experts 0 and 1, token 2
        // experts 2 and 1.
        let (slots, counts) = group_by_expert(&[2, 0, 0, 1, 2, 1], 4)?;
        assert_eq!(counts, [2, 2, 2, 0]);
        assert_eq!(slots, [1, 2, 3, 5, 0, 4]);
        let err = group_by_expert(&[0, 4], 4).unwrap_err();
        assert!(err.to_string().contains("expert 4 of 4"), "{err}");
        Ok(())
    }
}
