//! Collective communication between the ranks of one tensor-parallel group.
//!
//! The model code talks only to the [`Collective`] trait. Two backends implement it:
//! [`socket::SocketCollective`] (CPU ranks, TCP or Unix sockets) and, behind the `cuda`
//! feature, `nccl::NcclCollective` (CUDA ranks). Bootstrap mirrors NCCL: rank 0 creates an opaque
//! [`socket::CommId`], the coordinator hands it to every rank, and every rank calls `init`.

mod dtype;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod socket;
pub mod timed;

use std::time::Duration;

use candle_core::Tensor;

/// Why a collective failed. Every variant is terminal for the communicator: after an error the
/// group must be re-initialised with a new id (a new epoch).
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("communicator init timed out after {waited:?}: rank(s) {missing:?} of {world_size} never joined")]
    InitTimeout { waited: Duration, missing: Vec<usize>, world_size: usize },
    #[error("invalid communicator id: {0}")]
    InvalidId(String),
    #[error("peer rank {peer} failed during {op}: {reason}")]
    PeerFailed { peer: usize, op: &'static str, reason: String },
    #[error("collective {op} timed out after {waited:?} waiting for rank {peer}")]
    Timeout { op: &'static str, peer: usize, waited: Duration },
    #[error("communicator was aborted")]
    Aborted,
    #[error("collective {op}: {reason}")]
    Invalid { op: &'static str, reason: String },
    #[error("io error during {op}: {source}")]
    Io { op: &'static str, #[source] source: std::io::Error },
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

pub type CommResult<T> = std::result::Result<T, CommError>;

/// The collective operations one rank takes part in. Every rank of the group must call the same
/// operations in the same order with tensors of matching shape and dtype (all-gather and gather
/// allow the gathered dimension to differ per rank).
///
/// Every rank receives the same result. The socket backend sums in rank order, so its results are
/// also bitwise reproducible from run to run; NCCL sums in the order of its algorithm (ring or
/// tree, chosen per size), which may differ from rank order by rounding.
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum over all ranks; every rank receives the result.
    fn all_reduce_sum(&self, tensor: &Tensor) -> CommResult<Tensor>;
    /// Concatenation of every rank's tensor along `dim`, in rank order, on every rank.
    fn all_gather(&self, tensor: &Tensor, dim: usize) -> CommResult<Tensor>;
    /// Concatenation along `dim` delivered only to `root` (`Some` there, `None` elsewhere).
    fn gather(&self, tensor: &Tensor, dim: usize, root: usize) -> CommResult<Option<Tensor>>;
    /// [`Collective::gather`] when every rank knows every rank's size along `dim` (`sizes[r]`
    /// is rank r's; the other dims are the same everywhere), so the backend need not exchange
    /// shapes first. The caller guarantees the sizes, as it guarantees shapes to
    /// `all_reduce_sum`. NCCL skips its shape exchange, a host round trip per call; this default,
    /// for backends whose messages carry their shapes anyway, checks the sizes against the
    /// group and this rank's tensor and gathers.
    fn gather_sized(&self, tensor: &Tensor, dim: usize, root: usize, sizes: &[usize]) -> CommResult<Option<Tensor>> {
        known_shapes("gather", tensor.dims(), dim, sizes, self.rank(), self.world_size())?;
        self.gather(tensor, dim, root)
    }
    /// `root`'s tensor on every rank. Non-root ranks pass a tensor of the same shape and dtype.
    fn broadcast(&self, tensor: &Tensor, root: usize) -> CommResult<Tensor>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> CommResult<()>;
    /// Make every pending and future operation fail fast with [`CommError::Aborted`] (the
    /// equivalent of ncclCommAbort). Safe to call from another thread.
    fn abort(&self);
}

/// The sanity check a rank runs right after joining, before Init answers: every rank sums a
/// tensor of ones on its own device, and each element must come back as the world size. A
/// communicator that cannot reduce (a peer of another group, a wedged backend, a broken dtype
/// path) then fails Init with a reason rather than the first step of the first request.
pub fn check_sum_of_ones(comm: &dyn Collective, device: &candle_core::Device) -> CommResult<()> {
    const OP: &str = "communicator check";
    let world = comm.world_size();
    let ones = Tensor::ones(8, candle_core::DType::F32, device)?;
    let sum = comm.all_reduce_sum(&ones)?.to_device(&candle_core::Device::Cpu)?.to_vec1::<f32>()?;
    if sum.len() != 8 || sum.iter().any(|&v| v != world as f32) {
        return Err(CommError::Invalid {
            op: OP,
            reason: format!("an all-reduce of ones over {world} ranks gave {sum:?}, not {world} in each of 8 elements"),
        });
    }
    Ok(())
}

/// Every rank's shape for a gather along `dim` of known sizes: this rank's `dims` with
/// `sizes[r]` at `dim`. Fails when `sizes` does not name one size per rank, or names another
/// size for this rank than its tensor has.
pub(crate) fn known_shapes(
    op: &'static str,
    dims: &[usize],
    dim: usize,
    sizes: &[usize],
    rank: usize,
    world_size: usize,
) -> CommResult<Vec<Vec<usize>>> {
    let invalid = |reason: String| CommError::Invalid { op, reason };
    let Some(&own) = dims.get(dim) else {
        return Err(invalid(format!("dim {dim} out of range for shape {dims:?}")));
    };
    if sizes.len() != world_size {
        return Err(invalid(format!("{} sizes for a group of {world_size}", sizes.len())));
    }
    match sizes.get(rank) {
        Some(&size) if size == own => {}
        Some(&size) => return Err(invalid(format!("rank {rank}'s size along dim {dim} is {own}, not {size}"))),
        None => return Err(invalid(format!("rank {rank} is not in a group of {world_size}"))),
    }
    Ok(sizes
        .iter()
        .map(|&size| {
            let mut shape = dims.to_vec();
            shape[dim] = size;
            shape
        })
        .collect())
}

/// Set to `1` (or `true`, `on`), a TP 1 rank joins a real communicator of one rank (NCCL on a
/// GPU, the socket backend on a CPU) and runs every collective through it instead of skipping
/// it, so that one device exercises the backend's operations and dtypes.
pub const TP1_COLLECTIVES_ENV: &str = "TPSERVE_TP1_COLLECTIVES";

/// Whether [`TP1_COLLECTIVES_ENV`] is set (read once per process).
pub fn collectives_at_tp1() -> bool {
    static SET: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SET.get_or_init(|| matches!(std::env::var(TP1_COLLECTIVES_ENV).as_deref(), Ok("1" | "true" | "on")))
}

/// A single-rank group: every collective is the identity. Used at TP 1 so that the model code
/// has one path.
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, tensor: &Tensor) -> CommResult<Tensor> {
        Ok(tensor.clone())
    }
    fn all_gather(&self, tensor: &Tensor, _dim: usize) -> CommResult<Tensor> {
        Ok(tensor.clone())
    }
    fn gather(&self, tensor: &Tensor, _dim: usize, _root: usize) -> CommResult<Option<Tensor>> {
        Ok(Some(tensor.clone()))
    }
    fn broadcast(&self, tensor: &Tensor, _root: usize) -> CommResult<Tensor> {
        Ok(tensor.clone())
    }
    fn barrier(&self) -> CommResult<()> {
        Ok(())
    }
    fn abort(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A communicator whose all-reduce returns what it is told to (a broken backend).
    struct Answers(f32);

    impl Collective for Answers {
        fn rank(&self) -> usize {
            1
        }
        fn world_size(&self) -> usize {
            2
        }
        fn all_reduce_sum(&self, tensor: &Tensor) -> CommResult<Tensor> {
            Ok(tensor.affine(self.0 as f64, 0.0)?)
        }
        fn all_gather(&self, tensor: &Tensor, _dim: usize) -> CommResult<Tensor> {
            Ok(tensor.clone())
        }
        fn gather(&self, tensor: &Tensor, _dim: usize, _root: usize) -> CommResult<Option<Tensor>> {
            Ok(Some(tensor.clone()))
        }
        fn broadcast(&self, tensor: &Tensor, _root: usize) -> CommResult<Tensor> {
            Ok(tensor.clone())
        }
        fn barrier(&self) -> CommResult<()> {
            Ok(())
        }
        fn abort(&self) {}
    }

    #[test]
    fn known_shapes_put_each_size_at_the_gathered_dim() {
        let shapes = known_shapes("gather", &[3, 150], 1, &[150, 150, 148], 1, 3).unwrap();
        assert_eq!(shapes, [vec![3, 150], vec![3, 150], vec![3, 148]]);
        let wrong_count = known_shapes("gather", &[3, 150], 1, &[150, 150], 1, 3).unwrap_err().to_string();
        assert!(wrong_count.contains("2 sizes for a group of 3"), "{wrong_count}");
        let wrong_own = known_shapes("gather", &[3, 149], 1, &[150, 150, 148], 1, 3).unwrap_err().to_string();
        assert!(wrong_own.contains("rank 1's size along dim 1 is 149"), "{wrong_own}");
        let wrong_dim = known_shapes("gather", &[3, 150], 2, &[150, 150, 148], 1, 3).unwrap_err().to_string();
        assert!(wrong_dim.contains("dim 2 out of range"), "{wrong_dim}");
        // The default gather_sized checks the sizes before it gathers.
        let t = Tensor::zeros((2, 5), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        assert!(SingleRank.gather_sized(&t, 1, 0, &[5]).unwrap().is_some());
        assert!(SingleRank.gather_sized(&t, 1, 0, &[4]).is_err());
    }

    #[test]
    fn the_init_check_accepts_a_sum_and_names_a_wrong_one() {
        let cpu = candle_core::Device::Cpu;
        check_sum_of_ones(&SingleRank, &cpu).unwrap();
        check_sum_of_ones(&Answers(2.0), &cpu).unwrap();
        let err = check_sum_of_ones(&Answers(1.0), &cpu).unwrap_err().to_string();
        assert!(err.contains("communicator check") && err.contains("over 2 ranks gave [1.0"), "{err}");
    }
}
