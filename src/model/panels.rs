//! Dense CPU weights held in column panels ([`tpserve_kernels::panels`]): f32 or bf16, packed
//! once at load, multiplied by the broadcast-form kernels at every row count.

use anyhow::{Result, bail};
use candle_core::{DType, Device, Storage, Tensor};
use tpserve_kernels::cpu_matmul::Isa;
use tpserve_kernels::panels::{self, Packed};

/// A `[rows, cols]` f32 or bf16 matrix in panels.
pub struct PanelMatrix {
    pub rows: usize,
    pub cols: usize,
    /// the packed elements, 1-D, in the weight's dtype (f32, or bf16 bit patterns)
    data: Tensor,
}

/// Runs `f` on the elements of a contiguous CPU tensor of f32 or bf16, as stored.
fn with_elements<R>(tensor: &Tensor, f: impl FnOnce(Packed) -> R) -> Result<R> {
    let (storage, layout) = tensor.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { bail!("panel weights live on the CPU") };
    let range = layout.start_offset()..layout.start_offset() + tensor.elem_count();
    Ok(match tensor.dtype() {
        DType::F32 => f(Packed::F32(&cpu.as_slice::<f32>()?[range])),
        DType::BF16 => f(Packed::Bf16(bf16_bits(&cpu.as_slice::<half::bf16>()?[range]))),
        other => bail!("no panel layout for {other:?}"),
    })
}

fn bf16_bits(values: &[half::bf16]) -> &[u16] {
    // SAFETY: half::bf16 is a #[repr(transparent)] wrapper of u16: same size, alignment and
    // validity, so the slice can be viewed as its bit patterns.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u16>(), values.len()) }
}

impl PanelMatrix {
    /// Whether the weight `w` is packed into panels on this machine: a 2-D f32 or bf16 CPU
    /// tensor, when the selected instruction set has a panel kernel (AVX-512F).
    pub fn applies(w: &Tensor) -> bool {
        w.device().is_cpu() && w.rank() == 2 && matches!(w.dtype(), DType::F32 | DType::BF16) && panels::packs_for(Isa::selected())
    }

    /// Packs a `[rows, cols]` f32 or bf16 CPU tensor.
    pub fn pack(w: &Tensor) -> Result<PanelMatrix> {
        let (rows, cols) = w.dims2()?;
        let w = w.contiguous()?;
        let (storage, layout) = w.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else { bail!("panel weights live on the CPU") };
        let range = layout.start_offset()..layout.start_offset() + rows * cols;
        let len = panels::packed_len(rows, cols, w.dtype() == DType::BF16);
        let data = match w.dtype() {
            DType::F32 => Tensor::from_vec(panels::pack_f32(&cpu.as_slice::<f32>()?[range], rows, cols), len, &Device::Cpu)?,
            DType::BF16 => Tensor::from_vec(panels::pack_bf16(&cpu.as_slice::<half::bf16>()?[range], rows, cols), len, &Device::Cpu)?,
            other => bail!("no panel layout for {other:?}"),
        };
        Ok(PanelMatrix { rows, cols, data })
    }

    /// The row-major `[rows, cols]` tensor it was packed from (to stack weights before packing
    /// them again).
    pub fn unpack(&self) -> Result<Tensor> {
        let (rows, cols) = (self.rows, self.cols);
        let (storage, _) = self.data.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else { bail!("panel weights live on the CPU") };
        Ok(match self.data.dtype() {
            DType::F32 => Tensor::from_vec(panels::unpack_f32(cpu.as_slice::<f32>()?, cols, 0..rows), (rows, cols), &Device::Cpu)?,
            DType::BF16 => Tensor::from_vec(panels::unpack_bf16(cpu.as_slice::<half::bf16>()?, cols, 0..rows), (rows, cols), &Device::Cpu)?,
            other => bail!("no panel layout for {other:?}"),
        })
    }

    /// The tensor holding the packed elements (its bytes are the resident size).
    pub fn data(&self) -> &Tensor {
        &self.data
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// `x [m, cols] @ self.T` -> `[m, rows]`, in x's dtype.
    pub fn matmul_t(&self, x: &Tensor) -> Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != self.cols {
            bail!("matmul of [{m}, {k}] by a weight of {} columns", self.cols);
        }
        let x32 = x.to_dtype(DType::F32)?.contiguous()?;
        // x is read in place (a copy per product was 3 MB a step at 16 rows).
        let (storage, layout) = x32.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else { bail!("panel weights multiply CPU activations") };
        let values = &cpu.as_slice::<f32>()?[layout.start_offset()..layout.start_offset() + m * k];
        let out = with_elements(&self.data, |packed| panels::matmul(values, m, k, packed, self.rows, Isa::selected()))?;
        Ok(Tensor::from_vec(out, (m, self.rows), &Device::Cpu)?.to_dtype(x.dtype())?)
    }

    /// Rows `ids` as f32 `[ids.len(), cols]` (an embedding lookup).
    pub fn rows_f32(&self, ids: &[u32]) -> Result<Tensor> {
        let mut out = Vec::with_capacity(ids.len() * self.cols);
        for &id in ids {
            let row = id as usize;
            if row >= self.rows {
                bail!("row {row} is out of range (the weight has {})", self.rows);
            }
            out.extend(with_elements(&self.data, |packed| packed.rows_f32(self.cols, row..row + 1))?);
        }
        Ok(Tensor::from_vec(out, (ids.len(), self.cols), &Device::Cpu)?)
    }
}
