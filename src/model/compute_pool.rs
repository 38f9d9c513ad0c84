//! The CPU threads a rank computes on.
//!
//! A parallel loop started from a thread outside rayon's pool is injected into the pool, and the
//! caller sleeps on a latch until a pool thread has finished it: a futex wake-up there and back
//! for every matrix product, about 120 of them per decoded token of a small model. Running the
//! device worker itself on a pool thread makes those loops start and end in the pool (the
//! worker takes a share of the work and the others steal the rest), with no sleep in between.

/// A rayon pool of `RAYON_NUM_THREADS` threads (as the global pool; `--threads` sets it),
/// named `{name}-{i}`.
pub fn pool(name: &str) -> std::io::Result<rayon::ThreadPool> {
    let name = name.to_owned();
    rayon::ThreadPoolBuilder::new().thread_name(move |i| format!("{name}-{i}")).build().map_err(std::io::Error::other)
}

/// Runs `work` on a thread of a new [`pool`] and returns its result; the pool ends with it.
/// Every parallel loop inside `work`, candle's included, runs on that pool.
pub fn run<R: Send>(name: &str, work: impl FnOnce() -> R + Send) -> std::io::Result<R> {
    Ok(pool(name)?.install(work))
}
