//! The layers' matrices gathered into one buffer per element type, starting on a 2 MiB page.
//!
//! Every weight is loaded into an allocation of its own, and only the whole 2 MiB pages inside
//! an allocation can be huge (`tpserve_kernels::pages`): a matrix of a few MiB, as in small
//! models and in every quantized one, keeps much of its bytes in 4 KiB pages, and streaming
//! those costs TLB misses (a plain two-thread read on a Zen 2 guest: 25-27 GB/s from 4 KiB
//! pages, 30.5 from 2 MiB ones; the 100M test model in q8_0 had 42 of its 101 MiB in huge
//! pages). After the load, the layers' matrices of one element type are copied one after the
//! other into one buffer whose values start on a 2 MiB boundary, and become views of it. Each
//! matrix's own storage is dropped as soon as it is copied, so the load holds two copies of one
//! matrix at most. Values and shapes are unchanged; every kernel reads a weight from its
//! layout's start offset.

use anyhow::{Result, bail};
use candle_core::{DType, Device, Storage, Tensor, WithDType};
use tpserve_kernels::pages;

use super::quant::Weight;

/// What [`gather`] did: the bytes it moved, the huge pages of its buffers, and which storages
/// those buffers are (so that the weights now viewing them need no pass of their own).
#[derive(Default)]
pub struct Gathered {
    pub bytes: usize,
    pub pages: pages::HugePages,
    buffers: Vec<usize>,
}

impl Gathered {
    /// Whether `t` is a view of one of the buffers.
    pub fn holds(&self, t: &Tensor) -> bool {
        self.buffers.contains(&storage_address(t))
    }
}

/// Which storage `t` views (its address, for comparison only).
fn storage_address(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    &*storage as *const Storage as usize
}

/// Moves the host tensors of `weights` (dense matrices, and quantized blocks no other weight
/// shares, and packings of column panels) into one buffer per element type, each then
/// held in 2 MiB pages. An error leaves the weights unusable: the caller fails the load.
pub fn gather(weights: Vec<&mut Weight>) -> Result<Gathered> {
    let mut tensors: Vec<&mut Tensor> = weights.into_iter().flat_map(Weight::host_tensors_mut).collect();
    tensors.retain(|t| t.device().is_cpu() && t.is_contiguous());
    let mut gathered = Gathered::default();
    for dtype in [DType::U8, DType::F32, DType::BF16, DType::F16] {
        let mut group: Vec<&mut Tensor> = tensors.iter_mut().filter(|t| t.dtype() == dtype).map(|t| &mut **t).collect();
        // A single tensor is already one allocation: copying it would gain little.
        if group.len() < 2 {
            continue;
        }
        let buffer = match dtype {
            DType::U8 => into_one::<u8>(&mut group)?,
            DType::F32 => into_one::<f32>(&mut group)?,
            DType::BF16 => into_one::<half::bf16>(&mut group)?,
            _ => into_one::<half::f16>(&mut group)?,
        };
        gathered.bytes += buffer.elem_count() * dtype.size_in_bytes();
        // Where the allocator reused written memory, the advice before the copy did not take:
        // collapse now, once for the whole buffer (its matrices' boundary pages included).
        gathered.pages += pages::back_with_huge_pages(&buffer);
        gathered.buffers.push(storage_address(&buffer));
    }
    Ok(gathered)
}

/// Copies `tensors` (contiguous host tensors of `T`) one after the other into one buffer from
/// its first 2 MiB boundary on, and replaces each with its view there. Returns the values' range
/// of the buffer, a view whose start is on that boundary.
fn into_one<T: WithDType>(tensors: &mut [&mut Tensor]) -> Result<Tensor> {
    let size = std::mem::size_of::<T>();
    let total: usize = tensors.iter().map(|t| t.elem_count()).sum();
    // Room for the values to start on a 2 MiB boundary and for their last page to be whole.
    // The zeros before and after them are never written: in a zeroed allocation of this size,
    // fresh pages the kernel backs only when touched.
    let slack = pages::HUGE_PAGE / size;
    let mut buffer = zeroed::<T>(total + 2 * slack)?;
    let address = buffer.as_ptr() as usize;
    let start = (address.next_multiple_of(pages::HUGE_PAGE) - address) / size;
    pages::advise_untouched(&buffer[start..]);
    let mut views = Vec::with_capacity(tensors.len());
    let mut at = start;
    for t in tensors.iter_mut() {
        let n = t.elem_count();
        {
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else { bail!("a weight to gather is not on the host") };
            let from = layout.start_offset();
            buffer[at..at + n].copy_from_slice(&cpu.as_slice::<T>()?[from..from + n]);
        }
        views.push((at, t.shape().clone()));
        // Its own storage goes now (unless another tensor shares it).
        **t = Tensor::zeros(0, T::DTYPE, &Device::Cpu)?;
        at += n;
    }
    let buffer = Tensor::from_vec(buffer, total + 2 * slack, &Device::Cpu)?;
    for (t, (at, shape)) in tensors.iter_mut().zip(views) {
        **t = buffer.narrow(0, at, shape.elem_count())?.reshape(shape)?;
    }
    Ok(buffer.narrow(0, start, total)?)
}

/// `n` zeros of `T`, allocated zeroed (so that pages nobody writes are never backed).
fn zeroed<T: WithDType>(n: usize) -> Result<Vec<T>> {
    let Ok(layout) = std::alloc::Layout::array::<T>(n) else { bail!("{n} weights of {:?} do not fit in memory", T::DTYPE) };
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the layout's size is not zero (checked above) and a null pointer is handled; the
    // allocation has the layout of a `Vec<T>` of capacity `n` (`Layout::array`), as
    // `from_raw_parts` requires, and its `n` elements are zero bytes, a valid value of every
    // element type used here (u8, f32, bf16 and f16: 0 and 0.0).
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<T>();
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Ok(Vec::from_raw_parts(ptr, n, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::quant::formats::{Format, quantize_matrix};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / (1u32 << 24) as f32 - 0.5).collect()
    }

    /// Where a host tensor's elements start in memory.
    fn address(t: &Tensor) -> usize {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else { panic!("not on the host") };
        let bytes = match t.dtype() {
            DType::U8 => cpu.as_slice::<u8>().unwrap().as_ptr() as usize,
            DType::F32 => cpu.as_slice::<f32>().unwrap().as_ptr() as usize,
            DType::BF16 => cpu.as_slice::<half::bf16>().unwrap().as_ptr() as usize,
            other => panic!("{other:?}"),
        };
        bytes + layout.start_offset() * t.dtype().size_in_bytes()
    }

    fn host_tensor(w: &Weight) -> &Tensor {
        w.tensors()[0]
    }

    #[test]
    fn dense_matrices_of_a_type_become_views_of_one_buffer_with_their_values() -> Result<()> {
        let dense = |rows: usize, cols: usize, seed: u32, dtype: DType| -> Result<Weight> {
            Ok(Weight::Dense(Tensor::from_vec(values(rows * cols, seed), (rows, cols), &Device::Cpu)?.to_dtype(dtype)?))
        };
        let mut weights = [dense(7, 5, 1, DType::F32)?, dense(3, 11, 2, DType::BF16)?, dense(1, 4, 3, DType::F32)?];
        let before: Vec<(Vec<f32>, Vec<usize>)> = weights
            .iter()
            .map(|w| {
                let t = host_tensor(w);
                (t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap(), t.dims().to_vec())
            })
            .collect();
        let bf16_at = address(host_tensor(&weights[1]));
        let moved = gather(weights.iter_mut().collect())?.bytes;
        assert_eq!(moved, (35 + 4) * 4, "the two f32 matrices, not the lone bf16 one");
        for (w, (values, dims)) in weights.iter().zip(&before) {
            let t = host_tensor(w);
            assert_eq!(t.dims(), &dims[..]);
            assert_eq!(&t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, values);
        }
        // the f32 ones are consecutive in one buffer; the bf16 one did not move
        assert_eq!(address(host_tensor(&weights[2])), address(host_tensor(&weights[0])) + 35 * 4);
        assert_eq!(address(host_tensor(&weights[1])), bf16_at);
        Ok(())
    }

    /// Packings of column panels join their element type's buffer and multiply as before.
    #[test]
    fn panels_join_their_types_buffer_with_their_products() -> Result<()> {
        use crate::model::panels::PanelMatrix;
        use tpserve_kernels::panels::Products;
        let (rows, cols) = (40, 24);
        let panels = |seed: u32, dtype: DType| -> Result<Weight> {
            let t = Tensor::from_vec(values(rows * cols, seed), (rows, cols), &Device::Cpu)?.to_dtype(dtype)?;
            Ok(Weight::Panels(std::sync::Arc::new(PanelMatrix::pack(&t, Products::Exact)?)))
        };
        let mut weights = [panels(1, DType::F32)?, panels(2, DType::BF16)?, panels(3, DType::F32)?, panels(4, DType::BF16)?];
        let x = Tensor::from_vec(values(3 * cols, 9), (3, cols), &Device::Cpu)?;
        let products = |w: &Weight| -> Result<Vec<f32>> { Ok(w.matmul_t(&x)?.flatten_all()?.to_vec1()?) };
        let before = weights.iter().map(products).collect::<Result<Vec<_>>>()?;
        let packed = host_tensor(&weights[0]).elem_count();
        let moved = gather(weights.iter_mut().collect())?.bytes;
        assert_eq!(moved, 2 * packed * 4 + 2 * packed * 2, "two f32 packings and two bf16 ones");
        assert_eq!(address(host_tensor(&weights[2])), address(host_tensor(&weights[0])) + packed * 4);
        assert_eq!(address(host_tensor(&weights[3])), address(host_tensor(&weights[1])) + packed * 2);
        assert_eq!(weights.iter().map(products).collect::<Result<Vec<_>>>()?, before);
        Ok(())
    }

    #[test]
    fn quantized_products_are_unchanged_and_shared_blocks_stay() -> Result<()> {
        let (rows, cols) = (40, 64);
        let quantized = |seed: u32| Weight::from_sliced(quantize_matrix(Format::Q8_0, rows, cols, values(rows * cols, seed)), &Device::Cpu);
        let (mut a, mut b) = (quantized(1)?, quantized(2)?);
        let mut shared = quantized(3)?;
        let other_holder = shared.clone(); // as a tied embedding and LM head share their blocks
        let x = Tensor::from_vec(values(3 * cols, 9), (3, cols), &Device::Cpu)?;
        let products = |w: &Weight| -> Result<Vec<f32>> { Ok(w.matmul_t(&x)?.flatten_all()?.to_vec1()?) };
        let before = [products(&a)?, products(&b)?, products(&shared)?];
        let shared_at = address(host_tensor(&shared));
        let moved = gather(vec![&mut a, &mut b, &mut shared])?.bytes;
        assert_eq!(moved, 2 * host_tensor(&a).elem_count(), "both unshared matrices' blocks, one byte each");
        assert_eq!(address(host_tensor(&b)), address(host_tensor(&a)) + host_tensor(&a).elem_count());
        assert_eq!(address(host_tensor(&shared)), shared_at);
        assert_eq!([products(&a)?, products(&b)?, products(&shared)?], before);
        drop(other_holder);
        Ok(())
    }
}
