//! Dense CPU weights held in column panels ([`tpserve_kernels::panels`]): f32 or bf16, packed
//! once at load, multiplied by the broadcast-form kernels at every row count; a bf16 one in the
//! precision the load asked for ([`Products`]).

use std::sync::OnceLock;

use anyhow::{Result, bail};
use candle_core::{DType, Device, Storage, Tensor};
use tpserve_kernels::cpu_matmul::Isa;
use tpserve_kernels::panels::{self, ColumnNorms, Packed, Products};

use super::placement::with_host_f32;

/// A `[rows, cols]` f32 or bf16 matrix in panels.
pub struct PanelMatrix {
    pub rows: usize,
    pub cols: usize,
    /// the packed elements, 1-D, in the weight's dtype (f32, or bf16 bit patterns)
    data: Tensor,
    /// how a bf16 weight's products are computed (f32 weights: always exact)
    products: Products,
    /// its columns' norms, made the first time [`PanelMatrix::argmax_logits`] needs them
    norms: OnceLock<ColumnNorms>,
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

    /// Packs a `[rows, cols]` f32 or bf16 CPU tensor, to multiply in precision `products`
    /// (which a bf16 weight only uses).
    pub fn pack(w: &Tensor, products: Products) -> Result<PanelMatrix> {
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
        let products = if w.dtype() == DType::BF16 { products } else { Products::Exact };
        Ok(PanelMatrix { rows, cols, data, products, norms: OnceLock::new() })
    }

    /// `parts` stacked by rows (fused q/k/v, gate/up) without unpacking them, when every part
    /// but the last fills its last panel (then the packings simply follow one another) and all
    /// share a dtype, a precision and a width; None otherwise.
    pub fn stack(parts: &[&PanelMatrix]) -> Result<Option<PanelMatrix>> {
        let Some(first) = parts.first() else { return Ok(None) };
        let aligned = parts[..parts.len() - 1].iter().all(|p| p.rows % panels::PANEL == 0);
        if !aligned || parts.iter().any(|p| p.cols != first.cols || p.dtype() != first.dtype() || p.products != first.products) {
            return Ok(None);
        }
        fn gather<T: Copy + candle_core::WithDType>(parts: &[&PanelMatrix]) -> Result<Tensor> {
            let len = parts.iter().map(|p| p.data.elem_count()).sum();
            // Advised for 2 MiB pages before it is written, as a packing is (`pages`).
            let mut out: Vec<T> = Vec::with_capacity(len);
            tpserve_kernels::pages::advise_unwritten(out.spare_capacity_mut());
            for p in parts {
                let (storage, layout) = p.data.storage_and_layout();
                let Storage::Cpu(cpu) = &*storage else { bail!("panel weights live on the CPU") };
                out.extend_from_slice(&cpu.as_slice::<T>()?[layout.start_offset()..layout.start_offset() + p.data.elem_count()]);
            }
            Ok(Tensor::from_vec(out, len, &Device::Cpu)?)
        }
        let data = match first.dtype() {
            DType::F32 => gather::<f32>(parts)?,
            DType::BF16 => gather::<half::bf16>(parts)?,
            other => bail!("no panel layout for {other:?}"),
        };
        Ok(Some(PanelMatrix { rows: parts.iter().map(|p| p.rows).sum(), cols: first.cols, data, products: first.products, norms: OnceLock::new() }))
    }

    /// The row-major `[rows, cols]` tensor it was packed from (to stack weights before packing
    /// them again).
    pub fn unpack(&self) -> Result<Tensor> {
        let (rows, cols) = (self.rows, self.cols);
        let (storage, layout) = self.data.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else { bail!("panel weights live on the CPU") };
        let range = layout.start_offset()..layout.start_offset() + self.data.elem_count();
        Ok(match self.data.dtype() {
            DType::F32 => Tensor::from_vec(panels::unpack_f32(&cpu.as_slice::<f32>()?[range], cols, 0..rows), (rows, cols), &Device::Cpu)?,
            DType::BF16 => Tensor::from_vec(panels::unpack_bf16(&cpu.as_slice::<half::bf16>()?[range], cols, 0..rows), (rows, cols), &Device::Cpu)?,
            other => bail!("no panel layout for {other:?}"),
        })
    }

    /// The tensor holding the packed elements (its bytes are the resident size).
    pub fn data(&self) -> &Tensor {
        &self.data
    }

    /// The same, to be replaced by a view of the same elements elsewhere (`arena::gather`): the
    /// products read the packing from its layout's start offset.
    pub fn data_mut(&mut self) -> &mut Tensor {
        &mut self.data
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    pub fn products(&self) -> Products {
        self.products
    }

    /// `x [m, cols] @ self.T` -> `[m, rows]`, in x's dtype.
    pub fn matmul_t(&self, x: &Tensor) -> Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != self.cols {
            bail!("matmul of [{m}, {k}] by a weight of {} columns", self.cols);
        }
        let x32 = x.to_dtype(DType::F32)?.contiguous()?;
        // x is read in place (a copy per product was 3 MB a step at 16 rows).
        let out = with_host_f32(&x32, |values| with_elements(&self.data, |packed| panels::matmul(values, m, k, packed, self.rows, Isa::selected(), self.products)))?;
        let Some(out) = out.transpose()? else { bail!("panel weights multiply CPU activations") };
        Ok(Tensor::from_vec(out, (m, self.rows), &Device::Cpu)?.to_dtype(x.dtype())?)
    }

    /// Logits for rows that only want their largest value (`panels::argmax_logits`): `x [m,
    /// cols] @ self.T` in f32, each row exact in the columns that can be its largest once its
    /// `masked` columns are left out, NEG_INFINITY in the others. None where the weight has no
    /// such path: f32, bf16 held for bf16 products (already that fast), or a CPU without the
    /// bf16 pair body.
    pub fn argmax_logits(&self, x: &Tensor, masked: &[&[usize]]) -> Result<Option<Tensor>> {
        let isa = Isa::selected();
        if self.dtype() != DType::BF16 || self.products != Products::Exact || !panels::argmax_available(isa) {
            return Ok(None);
        }
        let (m, k) = x.dims2()?;
        if k != self.cols || masked.len() != m {
            bail!("argmax logits of [{m}, {k}] ({} masks) by a weight of {} columns", masked.len(), self.cols);
        }
        let x32 = x.to_dtype(DType::F32)?.contiguous()?;
        let out = with_host_f32(&x32, |values| {
            with_elements(&self.data, |packed| {
                let Packed::Bf16(w) = packed else { return None };
                let norms = self.norms.get_or_init(|| ColumnNorms::of(w, self.rows, self.cols));
                Some(panels::argmax_logits(values, m, k, w, self.rows, norms, masked, isa))
            })
        })?;
        let Some(out) = out.transpose()?.flatten() else { bail!("argmax logits need bf16 panels and CPU activations") };
        Ok(Some(Tensor::from_vec(out, (m, self.rows), &Device::Cpu)?))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::quant::Weight;

    fn matrix(rows: usize, cols: usize, seed: u32, dtype: DType) -> Tensor {
        let values: Vec<f32> = (0..rows * cols).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0).collect();
        Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    /// Dense f32 and bf16 weights go into panels where the CPU has a panel kernel; stacked
    /// (fused q/k/v, gate/up) they equal the stack of the row-major tensors, and their products
    /// and rows equal candle's on the same values.
    #[test]
    fn dense_weights_are_held_in_panels_and_multiply_like_candle() {
        for dtype in [DType::F32, DType::BF16] {
            // 37 and 21 rows: neither part fills its last panel, so stacking must repack
            let (a, b) = (matrix(37, 70, 1, dtype), matrix(21, 70, 2, dtype));
            let stacked = Weight::cat_rows(vec![Weight::dense(a.clone(), Products::Exact).unwrap(), Weight::dense(b.clone(), Products::Exact).unwrap()]).unwrap();
            let want = Tensor::cat(&[&a, &b], 0).unwrap();
            assert_eq!(stacked.dims2().unwrap(), (58, 70));
            assert_eq!(stacked.format(), format!("{dtype:?}").to_lowercase());
            let Weight::Panels(p) = &stacked else {
                assert!(!panels::packs_for(Isa::selected()), "{dtype:?} not packed on a CPU with panels");
                continue;
            };
            let same = |x: &Tensor, y: &Tensor| {
                let (x, y) = (x.to_dtype(DType::F32).unwrap().flatten_all().unwrap(), y.to_dtype(DType::F32).unwrap().flatten_all().unwrap());
                assert_eq!(x.to_vec1::<f32>().unwrap(), y.to_vec1::<f32>().unwrap());
            };
            same(&p.unpack().unwrap(), &want);
            let ids = Tensor::new(&[57u32, 0, 36, 37], &Device::Cpu).unwrap();
            same(&stacked.rows_f32(&ids).unwrap(), &want.index_select(&ids, 0).unwrap());
            assert!(p.rows_f32(&[58]).is_err(), "a row past the end is an error, not a panic");
            let x = matrix(5, 70, 3, DType::F32);
            let got = stacked.matmul_t(&x).unwrap();
            let reference = x.matmul(&want.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap();
            let diff = (got - reference).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-4, "{dtype:?}: {diff}");
            assert!(stacked.matmul_t(&matrix(2, 69, 4, DType::F32)).is_err(), "a wrong width is an error");

            // Parts that fill their last panels (32 + 16 rows, then a ragged 5) stack as they are
            // packed, and equal the packing of the stacked rows.
            let parts = [matrix(32, 70, 5, dtype), matrix(16, 70, 6, dtype), matrix(5, 70, 7, dtype)];
            let held: Vec<Weight> = parts.iter().map(|t| Weight::dense(t.clone(), Products::Exact).unwrap()).collect();
            let packed: Vec<&PanelMatrix> = held.iter().map(|w| match w {
                Weight::Panels(p) => p.as_ref(),
                _ => unreachable!("packed above"),
            }).collect();
            let fast = PanelMatrix::stack(&packed).unwrap().expect("aligned parts stack in place");
            let slow = PanelMatrix::pack(&Tensor::cat(&parts, 0).unwrap(), Products::Exact).unwrap();
            same(fast.data(), slow.data());
            assert_eq!((fast.rows, fast.cols), (53, 70));
            assert!(PanelMatrix::stack(&[packed[2], packed[0]]).unwrap().is_none(), "a ragged part that is not last");
        }
    }
}
