//! A collective wrapper that measures the time ranks spend communicating (for metrics).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use candle_core::Tensor;

use super::{Collective, CommResult};
use crate::metrics::RankMetrics;

pub struct TimedCollective {
    inner: Arc<dyn Collective>,
    metrics: Arc<RankMetrics>,
}

impl TimedCollective {
    pub fn new(inner: Arc<dyn Collective>, metrics: Arc<RankMetrics>) -> Self {
        Self { inner, metrics }
    }

    fn timed<T>(&self, op: impl FnOnce(&dyn Collective) -> T) -> T {
        let started = Instant::now();
        let result = op(self.inner.as_ref());
        self.metrics.collective_nanos.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.metrics.collective_calls.fetch_add(1, Ordering::Relaxed);
        result
    }
}

impl Collective for TimedCollective {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&self, tensor: &Tensor) -> CommResult<Tensor> {
        self.timed(|c| c.all_reduce_sum(tensor))
    }
    fn all_gather(&self, tensor: &Tensor, dim: usize) -> CommResult<Tensor> {
        self.timed(|c| c.all_gather(tensor, dim))
    }
    fn gather(&self, tensor: &Tensor, dim: usize, root: usize) -> CommResult<Option<Tensor>> {
        self.timed(|c| c.gather(tensor, dim, root))
    }
    fn gather_sized(&self, tensor: &Tensor, dim: usize, root: usize, sizes: &[usize]) -> CommResult<Option<Tensor>> {
        self.timed(|c| c.gather_sized(tensor, dim, root, sizes))
    }
    fn broadcast(&self, tensor: &Tensor, root: usize) -> CommResult<Tensor> {
        self.timed(|c| c.broadcast(tensor, root))
    }
    fn barrier(&self) -> CommResult<()> {
        self.timed(|c| c.barrier())
    }
    fn abort(&self) {
        self.inner.abort()
    }
}
