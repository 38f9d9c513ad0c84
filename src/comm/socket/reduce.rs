//! Host buffers and the arithmetic of the collectives: typed buffers that become tensors
//! without a copy, byte views of tensor storage, the rank-order sum of an all-reduce and the
//! concatenation of a gather. Byte views go through `bytemuck`, so this module needs no `unsafe`.

use candle_core::{CpuStorage, DType, Device, Layout, Storage, Tensor};
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

use crate::comm::{CommError, CommResult};

/// Element types of host buffers, viewed as bytes. Plain integers and floats go through
/// `bytemuck` directly; the 16-bit floats through their `u16` bit patterns (half's own safe
/// view), so nothing depends on which of half's optional features happen to be enabled.
trait Elem: Copy + 'static {
    fn bytes(s: &[Self]) -> &[u8];
    fn bytes_mut(s: &mut [Self]) -> &mut [u8];
    /// `b` as elements; `None` when it is misaligned or not a whole number of elements.
    fn view(b: &[u8]) -> Option<&[Self]>;
}

macro_rules! pod_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            fn bytes(s: &[Self]) -> &[u8] {
                bytemuck::cast_slice(s)
            }
            fn bytes_mut(s: &mut [Self]) -> &mut [u8] {
                bytemuck::cast_slice_mut(s)
            }
            fn view(b: &[u8]) -> Option<&[Self]> {
                bytemuck::try_cast_slice(b).ok()
            }
        }
    )*};
}

macro_rules! half_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            fn bytes(s: &[Self]) -> &[u8] {
                bytemuck::cast_slice(HalfFloatSliceExt::reinterpret_cast(s))
            }
            fn bytes_mut(s: &mut [Self]) -> &mut [u8] {
                bytemuck::cast_slice_mut(HalfFloatSliceExt::reinterpret_cast_mut(s))
            }
            fn view(b: &[u8]) -> Option<&[Self]> {
                bytemuck::try_cast_slice::<u8, u16>(b).ok().map(HalfBitsSliceExt::reinterpret_cast::<Self>)
            }
        }
    )*};
}

pod_elem!(u8, u32, i16, i32, i64, f32, f64);
half_elem!(bf16, f16);

/// 16-bit floats that are summed by widening to f32. `widen`/`narrow` take equal-length slices.
trait Half16: Elem + Default {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Half16 for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Half16 for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

/// An owned, typed host buffer that becomes a tensor without a copy.
pub(super) enum Buf {
    U8(Vec<u8>),
    U32(Vec<u32>),
    I16(Vec<i16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

macro_rules! buf_dispatch {
    ($self:expr, $v:ident => $e:expr) => {
        match $self {
            Buf::U8($v) => $e,
            Buf::U32($v) => $e,
            Buf::I16($v) => $e,
            Buf::I32($v) => $e,
            Buf::I64($v) => $e,
            Buf::BF16($v) => $e,
            Buf::F16($v) => $e,
            Buf::F32($v) => $e,
            Buf::F64($v) => $e,
        }
    };
}

fn zeroed_vec<T: Clone>(op: &'static str, n: usize, zero: T) -> CommResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| CommError::Invalid {
        op,
        reason: format!("cannot allocate {n} elements: {e}"),
    })?;
    v.resize(n, zero);
    Ok(v)
}

impl Buf {
    pub(super) fn zeroed(op: &'static str, dtype: DType, n: usize) -> CommResult<Self> {
        Ok(match dtype {
            DType::U8 => Self::U8(zeroed_vec(op, n, 0)?),
            DType::U32 => Self::U32(zeroed_vec(op, n, 0)?),
            DType::I16 => Self::I16(zeroed_vec(op, n, 0)?),
            DType::I32 => Self::I32(zeroed_vec(op, n, 0)?),
            DType::I64 => Self::I64(zeroed_vec(op, n, 0)?),
            DType::BF16 => Self::BF16(zeroed_vec(op, n, bf16::ZERO)?),
            DType::F16 => Self::F16(zeroed_vec(op, n, f16::ZERO)?),
            DType::F32 => Self::F32(zeroed_vec(op, n, 0.0)?),
            DType::F64 => Self::F64(zeroed_vec(op, n, 0.0)?),
            other => {
                return Err(CommError::Invalid {
                    op,
                    reason: format!("unsupported dtype {other:?}"),
                });
            }
        })
    }

    pub(super) fn bytes(&self) -> &[u8] {
        buf_dispatch!(self, v => Elem::bytes(v.as_slice()))
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        buf_dispatch!(self, v => Elem::bytes_mut(v.as_mut_slice()))
    }

    pub(super) fn into_tensor(self, dims: &[usize]) -> CommResult<Tensor> {
        let dims = dims.to_vec();
        Ok(buf_dispatch!(self, v => Tensor::from_vec(v, dims, &Device::Cpu)?))
    }
}

/// The contiguous bytes of a CPU tensor's storage.
pub(super) fn cpu_bytes<'a>(op: &'static str, storage: &'a Storage, layout: &Layout) -> CommResult<&'a [u8]> {
    let Storage::Cpu(cpu) = storage else {
        return Err(CommError::Invalid {
            op,
            reason: "tensor is not on the CPU".into(),
        });
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| CommError::Invalid {
            op,
            reason: "tensor is not contiguous".into(),
        })?;
    macro_rules! view {
        ($v:expr) => {
            $v.get(start..end).map(Elem::bytes)
        };
    }
    let bytes = match cpu {
        CpuStorage::U8(v) => view!(v),
        CpuStorage::U32(v) => view!(v),
        CpuStorage::I16(v) => view!(v),
        CpuStorage::I32(v) => view!(v),
        CpuStorage::I64(v) => view!(v),
        CpuStorage::BF16(v) => view!(v),
        CpuStorage::F16(v) => view!(v),
        CpuStorage::F32(v) => view!(v),
        CpuStorage::F64(v) => view!(v),
        _ => {
            return Err(CommError::Invalid {
                op,
                reason: "unsupported dtype".into(),
            });
        }
    };
    bytes.ok_or_else(|| CommError::Invalid {
        op,
        reason: "tensor layout is out of its storage's bounds".into(),
    })
}

/// Sum of `parts` (one per rank, in rank order), accumulated left to right so that every rank
/// computes bit-identical results. Half types accumulate in f32 and round once at the end.
pub(super) fn reduce_sum(op: &'static str, dtype: DType, parts: &[&[u8]]) -> CommResult<Buf> {
    let Some(first) = parts.first() else {
        return Err(CommError::Invalid {
            op,
            reason: "nothing to reduce".into(),
        });
    };
    if parts.iter().any(|p| p.len() != first.len()) {
        return Err(CommError::Invalid {
            op,
            reason: "buffers of different sizes".into(),
        });
    }
    fn typed<'a, T: Elem>(op: &'static str, parts: &[&'a [u8]]) -> CommResult<Vec<&'a [T]>> {
        parts
            .iter()
            .map(|p| {
                T::view(p).ok_or_else(|| CommError::Invalid {
                    op,
                    reason: "misaligned or truncated buffer".into(),
                })
            })
            .collect()
    }
    fn native<T: Copy>(parts: &[&[T]], add: impl Fn(T, T) -> T) -> Vec<T> {
        let mut acc = parts[0].to_vec();
        for p in &parts[1..] {
            for (a, &b) in acc.iter_mut().zip(p.iter()) {
                *a = add(*a, b);
            }
        }
        acc
    }
    /// Accumulates in f32 a chunk at a time, using half's bulk (SIMD where available)
    /// conversions; the f32 adds run in rank order, so every rank gets the same bits.
    fn via_f32<T: Half16>(parts: &[&[T]]) -> Vec<T> {
        const CHUNK: usize = 4096;
        let n = parts[0].len();
        let mut out = Vec::with_capacity(n);
        let mut acc = [0f32; CHUNK];
        let mut tmp = [0f32; CHUNK];
        let mut narrow = [T::default(); CHUNK];
        let mut start = 0;
        while start < n {
            let end = (start + CHUNK).min(n);
            let len = end - start;
            let (acc, tmp, narrow) = (&mut acc[..len], &mut tmp[..len], &mut narrow[..len]);
            T::widen(&parts[0][start..end], acc);
            for p in &parts[1..] {
                T::widen(&p[start..end], tmp);
                for (a, &x) in acc.iter_mut().zip(tmp.iter()) {
                    *a += x;
                }
            }
            T::narrow(acc, narrow);
            out.extend_from_slice(narrow);
            start = end;
        }
        out
    }
    Ok(match dtype {
        DType::F32 => Buf::F32(native(&typed::<f32>(op, parts)?, |a, b| a + b)),
        DType::F64 => Buf::F64(native(&typed::<f64>(op, parts)?, |a, b| a + b)),
        DType::BF16 => Buf::BF16(via_f32(&typed::<bf16>(op, parts)?)),
        DType::F16 => Buf::F16(via_f32(&typed::<f16>(op, parts)?)),
        DType::U8 => Buf::U8(native(&typed::<u8>(op, parts)?, u8::wrapping_add)),
        DType::U32 => Buf::U32(native(&typed::<u32>(op, parts)?, u32::wrapping_add)),
        DType::I16 => Buf::I16(native(&typed::<i16>(op, parts)?, i16::wrapping_add)),
        DType::I32 => Buf::I32(native(&typed::<i32>(op, parts)?, i32::wrapping_add)),
        DType::I64 => Buf::I64(native(&typed::<i64>(op, parts)?, i64::wrapping_add)),
        other => {
            return Err(CommError::Invalid {
                op,
                reason: format!("cannot sum dtype {other:?}"),
            });
        }
    })
}

/// Concatenates row-major chunks (one per rank, in rank order) along `dim`.
pub(super) fn concat(
    op: &'static str,
    dtype: DType,
    parts: &[(&[u8], Vec<usize>)],
    dim: usize,
) -> CommResult<(Buf, Vec<usize>)> {
    let Some((_, first_dims)) = parts.first() else {
        return Err(CommError::Invalid {
            op,
            reason: "nothing to gather".into(),
        });
    };
    let es = dtype.size_in_bytes();
    let mut out_dims = first_dims.clone();
    out_dims[dim] = parts.iter().map(|(_, d)| d[dim]).sum();
    let outer: usize = first_dims[..dim].iter().product();
    let total: usize = out_dims.iter().product();
    let mut out = Buf::zeroed(op, dtype, total)?;
    let dst = out.bytes_mut();
    let mut pos = 0;
    for o in 0..outer {
        for (bytes, dims) in parts {
            let inner = dims[dim..].iter().product::<usize>() * es;
            let src = bytes
                .get(o * inner..(o + 1) * inner)
                .ok_or_else(|| CommError::Invalid {
                    op,
                    reason: "chunk shorter than its shape".into(),
                })?;
            let d = dst
                .get_mut(pos..pos + inner)
                .ok_or_else(|| CommError::Invalid {
                    op,
                    reason: "gathered chunks overflow the output".into(),
                })?;
            d.copy_from_slice(src);
            pos += inner;
        }
    }
    Ok((out, out_dims))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concat_middle_dim() {
        // [2, 1] and [2, 2] along dim 1 -> [2, 3]
        let a: Vec<u8> = vec![1, 2];
        let b: Vec<u8> = vec![3, 4, 5, 6];
        let (out, dims) = concat("t", DType::U8, &[(&a, vec![2, 1]), (&b, vec![2, 2])], 1).unwrap();
        assert_eq!(dims, vec![2, 3]);
        assert_eq!(out.bytes(), &[1, 3, 4, 2, 5, 6]);
    }

    #[test]
    fn byte_views_round_trip_and_refuse_misalignment() {
        let v = [bf16::from_f32(1.5), bf16::from_f32(-2.0)];
        let b = bf16::bytes(&v);
        assert_eq!(b.len(), 4);
        assert_eq!(bf16::view(b), Some(&v[..]));
        assert_eq!(f32::view(&[0u8; 6]), None);
        let sum = reduce_sum("t", DType::BF16, &[b, b]).unwrap();
        assert_eq!(sum.bytes(), bf16::bytes(&[bf16::from_f32(3.0), bf16::from_f32(-4.0)]));
    }
}
