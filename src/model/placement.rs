//! Where a layer's small per-step work runs: the Gated DeltaNet's gates and chunk systems, the
//! MoE routing, the attention mask. Each has two forms that compute the same values.
//!
//! On a GPU every value stays on the device: a copy to the host per layer would stall the
//! stream and wait for all the work queued before it. On a CPU the host is the device, and one
//! loop over a few thousand values beats the tens of small tensor ops (each an allocation and a
//! pass) that replace it, so the CPU keeps its loops. The choice is made here, in one place.
//! Unit tests force the tensor form on the CPU to hold the two forms to each other, and
//! [`TENSOR_OPS_ON_CPU_ENV`] makes a whole CPU rank take the GPU's forms, so that the parity
//! tests run them end to end against the reference.

use candle_core::{DType, Device, Storage, Tensor};

/// Set to `1` (or `true`, `on`), CPU ranks take the tensor-op forms a GPU takes (read once per
/// process). For tests and benchmarks; it is slower on a CPU.
pub const TENSOR_OPS_ON_CPU_ENV: &str = "TPSERVE_TENSOR_OPS_ON_CPU";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// plain loops over host vectors (a CPU device)
    Host,
    /// tensor ops on the tensors' own device, nothing copied to the host
    Device,
}

impl Placement {
    /// The form for tensors on `device`.
    pub fn of(device: &Device) -> Self {
        if device.is_cpu() && !tensor_ops_on_cpu() { Self::Host } else { Self::Device }
    }
}

fn tensor_ops_on_cpu() -> bool {
    static SET: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SET.get_or_init(|| matches!(std::env::var(TENSOR_OPS_ON_CPU_ENV).as_deref(), Ok("1" | "true" | "on")))
}

/// Calls `f` with the elements of `t`, read in place: a contiguous f32 tensor on a CPU. None
/// for any other.
pub fn with_host_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<Option<R>> {
    if t.dtype() != DType::F32 || !t.is_contiguous() {
        return Ok(None);
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { return Ok(None) };
    let start = layout.start_offset();
    Ok(Some(f(&cpu.as_slice::<f32>()?[start..start + t.elem_count()])))
}
