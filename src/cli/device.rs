//! Devices on the command line: a rank's `--device cpu|cuda:N`, and `serve`'s `--device
//! cpu|cuda`, which puts rank i on cuda:i (the ranks then join an NCCL communicator, see
//! docs/gpu.md). A build without the `cuda` feature refuses CUDA with a message saying so,
//! rather than falling back to the CPU behind the user's back.

use anyhow::{Result, bail};
#[cfg(feature = "cuda")]
use anyhow::Context;
use candle_core::Device;

/// `cpu`, or `cuda:N` (`cuda` is `cuda:0`) with the cuda feature: the device and its name.
pub fn parse_device(text: &str) -> Result<(Device, String)> {
    match text {
        "cpu" => Ok((Device::Cpu, "cpu".to_owned())),
        other if other.starts_with("cuda") => {
            let ordinal = match other.strip_prefix("cuda") {
                Some("") => 0,
                Some(rest) => match rest.strip_prefix(':').map(str::parse::<usize>) {
                    Some(Ok(ordinal)) => ordinal,
                    _ => bail!("unknown device \"{other}\" (expected cpu or cuda:N)"),
                },
                None => bail!("unknown device \"{other}\" (expected cpu or cuda:N)"),
            };
            open_cuda(ordinal)
        }
        other => bail!("unknown device \"{other}\" (expected cpu or cuda:N)"),
    }
}

/// Opened at startup so that a bad ordinal or a missing driver fails at once; from then on only
/// the rank's device worker uses the device.
#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<(Device, String)> {
    let device = crate::comm::nccl::open_device(ordinal).with_context(|| format!("cannot open CUDA device {ordinal}"))?;
    Ok((device, format!("cuda:{ordinal}")))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize) -> Result<(Device, String)> {
    bail!("device \"cuda:{ordinal}\" needs a build with the cuda feature (cargo build --features cuda)")
}

/// Where `tpserve serve` runs its ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ServeDevice {
    #[default]
    Cpu,
    /// rank i on cuda:i
    Cuda,
}

impl ServeDevice {
    /// `--device` as given, or the default: cuda in a cuda build on a machine with a GPU, else
    /// cpu. CUDA needs one GPU per rank.
    pub fn choose(requested: Option<&str>, tp: usize) -> Result<Self> {
        match requested {
            None if cuda_device_count() > 0 => Self::cuda(tp),
            None | Some("cpu") => Ok(Self::Cpu),
            Some("cuda") => Self::cuda(tp),
            Some(other) => bail!("--device {other}: expected cpu or cuda (serve puts rank i on cuda:i)"),
        }
    }

    fn cuda(tp: usize) -> Result<Self> {
        if !cfg!(feature = "cuda") {
            bail!("--device cuda needs a build with the cuda feature (cargo build --release --features cuda); this build serves on cpu only (--device cpu)");
        }
        let count = cuda_device_count();
        if count < tp {
            bail!("--device cuda --tp {tp} puts rank i on cuda:i and needs {tp} GPUs; this machine has {count}");
        }
        Ok(Self::Cuda)
    }

    /// The `--device` of rank `rank`.
    pub fn rank_device(self, rank: usize) -> String {
        match self {
            Self::Cpu => "cpu".to_owned(),
            Self::Cuda => format!("cuda:{rank}"),
        }
    }
}

/// CUDA devices visible to this process (0 without the driver, or in a CPU build).
#[cfg(feature = "cuda")]
fn cuda_device_count() -> usize {
    cudarc::driver::CudaContext::device_count().map_or(0, |count| count.max(0) as usize)
}

#[cfg(not(feature = "cuda"))]
fn cuda_device_count() -> usize {
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_devices() {
        assert_eq!(ServeDevice::choose(Some("cpu"), 4).unwrap(), ServeDevice::Cpu);
        assert_eq!(ServeDevice::Cpu.rank_device(3), "cpu");
        assert_eq!(ServeDevice::Cuda.rank_device(3), "cuda:3");
        let err = ServeDevice::choose(Some("tpu"), 1).unwrap_err().to_string();
        assert!(err.contains("expected cpu or cuda"), "{err}");
        if cfg!(feature = "cuda") {
            return;
        }
        // A CPU build: the default is cpu, and cuda is refused, saying why.
        assert_eq!(ServeDevice::choose(None, 2).unwrap(), ServeDevice::Cpu);
        let err = ServeDevice::choose(Some("cuda"), 2).unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
        assert!(parse_device("cuda:1").unwrap_err().to_string().contains("cuda feature"));
    }
}
