//! Token sampling: what a request may ask for and how the sampling rank turns a row of logits
//! into the next token.
//!
//! Below both users: the coordinator validates [`SamplingParams`] before admission, the rank
//! runs a [`Sampler`] per sequence. The modules, top down:
//! - `params`: the request's settings and their validation (client-facing messages).
//! - `sampler`: the per-sequence state and the per-step pipeline, greedy and random paths.
//! - `filters`: candidate selection for top-k / top-p and the draws over ranked or blocked rows.
//! - `kernels`: full-vocabulary lane loops (max, softmax mass, search) and the polynomial `exp`,
//!   with their one CPU-feature dispatch.

mod filters;
mod kernels;
mod params;
mod sampler;

pub use params::{GREEDY_TEMPERATURE, MAX_TOP_LOGPROBS, SamplingParams};
pub use sampler::{SampledToken, Sampler, uniform};

#[cfg(test)]
mod test_support {
    /// Deterministic test logits without depending on rand's algorithm.
    pub(super) fn random_logits(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                // Sum of uniforms: roughly normal, like real logits.
                let s: f64 = (0..4).map(|k| super::uniform(seed, (i * 4 + k) as u64)).sum();
                ((s - 2.0) as f32) * scale
            })
            .collect()
    }
}
