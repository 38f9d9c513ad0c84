//! SwiGLU's activation, shared by the dense MLP ([`super::layers::Mlp`]) and the MoE experts.

use anyhow::Result;
use candle_core::Tensor;
use tpserve_kernels::activation::silu_mul;

/// `silu(gate) * up` of a fused gate/up output `[tokens, 2 * width]` (gate first): one pass on
/// a CPU in f32 (`tpserve_kernels::activation`), candle's ops on any other device or dtype.
pub fn swiglu(gate_up: &Tensor) -> Result<Tensor> {
    if let Some(activated) = silu_mul(gate_up)? {
        return Ok(activated);
    }
    let width = gate_up.dim(1)? / 2;
    Ok((candle_nn::ops::silu(&gate_up.narrow(1, 0, width)?)? * gate_up.narrow(1, width, width)?)?)
}
