//! A GGUF file's header: its metadata and its tensor directory, read from the mapped file.
//!
//! candle's reader refuses a whole file over one tensor type it does not know, and llama.cpp
//! writes more types than candle reads (IQ4_XS and IQ4_NL among the most downloaded). This
//! reader records each tensor's type as stored; only reading a tensor of a type tpserve cannot
//! use fails, naming the tensor and its type. Layout (GGUF v2 and v3, little-endian): magic,
//! version, tensor count, metadata count, the metadata as (key, type, value), the tensor
//! directory as (name, dims innermost first, type, offset), then the tensor data at the next
//! multiple of `general.alignment` (32 unless set).

use std::collections::HashMap;

use anyhow::{Context, Result, bail};
use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::Value;
use tpserve_kernels::quant::iq4::Iq4;

/// How a tensor's values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// a type candle's GGML module reads (f32, f16, bf16, the 32-value and K-quant blocks)
    Ggml(GgmlDType),
    /// IQ4_NL or IQ4_XS, read by [`tpserve_kernels::quant::iq4`]
    Iq4(Iq4),
    /// a type tpserve does not read: its GGML id and name
    Other(u32, &'static str),
}

impl Stored {
    fn of(id: u32) -> Self {
        match id {
            20 => Stored::Iq4(Iq4::Nl),
            23 => Stored::Iq4(Iq4::Xs),
            id => ggml(id).map_or(Stored::Other(id, other_name(id)), Stored::Ggml),
        }
    }

    /// (values per block, bytes per block); None for a type tpserve does not read.
    pub fn block(self) -> Option<(usize, usize)> {
        match self {
            Stored::Ggml(d) => Some((d.block_size(), d.type_size())),
            Stored::Iq4(kind) => Some((kind.block_size(), kind.type_size())),
            Stored::Other(..) => None,
        }
    }

    pub fn name(self) -> String {
        match self {
            Stored::Ggml(d) => format!("{d:?}").to_lowercase(),
            Stored::Iq4(kind) => kind.name().to_owned(),
            Stored::Other(id, name) => format!("{name} (GGML type {id})"),
        }
    }
}

/// The candle type of a GGML id, where candle reads it.
fn ggml(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// ggml's name of a type id tpserve does not read (for the message that refuses it).
fn other_name(id: u32) -> &'static str {
    match id {
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        21 => "IQ3_S",
        22 => "IQ2_S",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "an unknown type",
    }
}

/// One tensor of the directory.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub stored: Stored,
    /// row-major (outermost first, as Hugging Face orders them)
    pub dims: Vec<usize>,
    /// from the start of the tensor data
    pub offset: u64,
}

/// The header of a GGUF file.
#[derive(Debug)]
pub struct Header {
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    /// where the tensor data starts in the file
    pub data_offset: u64,
}

/// Deepest nesting of metadata arrays read (llama.cpp writes at most arrays of arrays).
const MAX_DEPTH: usize = 4;

impl Header {
    /// Parses the header at the start of `bytes` (the whole file).
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(4)? != b"GGUF" {
            bail!("it does not start with \"GGUF\"");
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            bail!("GGUF version {version} is not read (versions 2 and 3 are; re-convert it with a current llama.cpp)");
        }
        let tensor_count = r.count(24)?;
        let metadata_count = r.count(13)?;
        let mut metadata = HashMap::with_capacity(metadata_count);
        for _ in 0..metadata_count {
            let key = r.string()?;
            let kind = r.u32()?;
            let value = r.value(kind, 0).with_context(|| format!("metadata \"{key}\""))?;
            metadata.insert(key, value);
        }
        let mut tensors = HashMap::with_capacity(tensor_count);
        for _ in 0..tensor_count {
            let name = r.string()?;
            let rank = r.u32()? as usize;
            if rank > 4 {
                bail!("tensor \"{name}\" has {rank} dimensions (GGUF allows 4)");
            }
            let mut dims = (0..rank).map(|_| r.u64().map(|d| d as usize)).collect::<Result<Vec<_>>>()?;
            dims.reverse();
            let stored = Stored::of(r.u32()?);
            let offset = r.u64()?;
            tensors.insert(name, TensorInfo { stored, dims, offset });
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(Value::U8(a)) if *a > 0 => *a as u64,
            Some(Value::U16(a)) if *a > 0 => *a as u64,
            Some(Value::U32(a)) if *a > 0 => *a as u64,
            Some(Value::U64(a)) if *a > 0 => *a,
            Some(other) => bail!("general.alignment is {other:?}, not a positive integer"),
        };
        let data_offset = (r.at as u64).div_ceil(alignment) * alignment;
        Ok(Self { metadata, tensors, data_offset })
    }
}

/// A cursor over the file's bytes; every read is checked against the end.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&end| end <= self.bytes.len());
        let Some(end) = end else { bail!("the header runs past the file's end ({} bytes)", self.bytes.len()) };
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of items at least `min_bytes` each, checked against the bytes left so that a
    /// corrupt count fails here instead of in an allocation.
    fn count(&mut self, min_bytes: usize) -> Result<usize> {
        let count = self.u64()?;
        let left = (self.bytes.len() - self.at) as u64;
        if count.saturating_mul(min_bytes as u64) > left {
            bail!("the header declares {count} entries, more than the {left} bytes left can hold");
        }
        Ok(count as usize)
    }

    fn string(&mut self) -> Result<String> {
        let len = self.count(1)?;
        String::from_utf8(self.take(len)?.to_vec()).context("a string is not UTF-8")
    }

    /// A metadata value of GGUF value type `kind`.
    fn value(&mut self, kind: u32, depth: usize) -> Result<Value> {
        Ok(match kind {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(self.array::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth >= MAX_DEPTH {
                    bail!("arrays nested deeper than {MAX_DEPTH}");
                }
                let element = self.u32()?;
                let len = self.count(1)?;
                Value::Array((0..len).map(|_| self.value(element, depth + 1)).collect::<Result<_>>()?)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => bail!("unknown metadata value type {other}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    /// A v3 header: one u32, one string array and a nested array of metadata, then the tensors
    /// `(name, dims innermost first, type id)`.
    fn header(tensors: &[(&str, &[u64], u32)]) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend(3u64.to_le_bytes());
        string(&mut out, "llama.block_count");
        out.extend(4u32.to_le_bytes());
        out.extend(7u32.to_le_bytes());
        string(&mut out, "tokenizer.ggml.tokens");
        out.extend(9u32.to_le_bytes());
        out.extend(8u32.to_le_bytes());
        out.extend(2u64.to_le_bytes());
        string(&mut out, "a");
        string(&mut out, "bc");
        string(&mut out, "nested");
        out.extend(9u32.to_le_bytes());
        out.extend(9u32.to_le_bytes());
        out.extend(1u64.to_le_bytes());
        out.extend(6u32.to_le_bytes());
        out.extend(1u64.to_le_bytes());
        out.extend(1.5f32.to_le_bytes());
        for (i, (name, dims, id)) in tensors.iter().enumerate() {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(id.to_le_bytes());
            out.extend((i as u64 * 4096).to_le_bytes());
        }
        out
    }

    #[test]
    fn reads_metadata_and_every_tensor_type_as_stored() {
        let bytes = header(&[("a.weight", &[256, 3], 23), ("b.weight", &[32, 2], 20), ("c.weight", &[64], 0), ("d.weight", &[256, 1], 16)]);
        let h = Header::parse(&bytes).unwrap();
        assert!(matches!(h.metadata["llama.block_count"], Value::U32(7)));
        let Value::Array(tokens) = &h.metadata["tokenizer.ggml.tokens"] else { panic!() };
        assert!(matches!(&tokens[1], Value::String(s) if s == "bc"));
        let Value::Array(outer) = &h.metadata["nested"] else { panic!() };
        assert!(matches!(&outer[0], Value::Array(inner) if matches!(inner[0], Value::F32(v) if v == 1.5)));
        let a = &h.tensors["a.weight"];
        assert_eq!((a.stored, a.dims.clone(), a.offset), (Stored::Iq4(Iq4::Xs), vec![3, 256], 0));
        assert_eq!(h.tensors["b.weight"].stored, Stored::Iq4(Iq4::Nl));
        assert_eq!(h.tensors["c.weight"].stored, Stored::Ggml(GgmlDType::F32));
        assert_eq!(h.tensors["d.weight"].stored.name(), "IQ2_XXS (GGML type 16)");
        assert_eq!(h.tensors["d.weight"].stored.block(), None);
        assert_eq!(h.data_offset, (bytes.len() as u64).div_ceil(32) * 32);
    }

    #[test]
    fn refuses_truncated_and_corrupt_headers() {
        let bytes = header(&[("a.weight", &[32, 2], 8)]);
        for cut in [3, 10, 30, bytes.len() - 1] {
            assert!(Header::parse(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut huge = bytes.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(format!("{:#}", Header::parse(&huge).unwrap_err()).contains("declares"));
        let mut v1 = bytes;
        v1[4] = 1;
        assert!(format!("{:#}", Header::parse(&v1).unwrap_err()).contains("version 1"));
    }
}
