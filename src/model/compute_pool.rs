//! The CPU threads a rank computes on.
//!
//! A parallel loop started from a thread outside rayon's pool is injected into the pool, and the
//! caller sleeps on a latch until a pool thread has finished it: a futex wake-up there and back
//! for every matrix product, about 120 of them per decoded token of a small model. Running the
//! device worker itself on a pool thread makes those loops start and end in the pool (the
//! worker takes a share of the work and the others steal the rest), with no sleep in between.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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

/// Keeps the pool's other threads polling for work until dropped: held over a CPU forward pass,
/// whose hundred or so parallel loops a step (four products a layer, its attention, ...) are
/// separated by serial stretches (norms, cache writes) long enough for rayon's idle threads to
/// fall asleep. A sleeping thread is woken by a futex call from the thread that starts the
/// next loop, and takes about 25 µs to run again on the development VM (a one-way wake between
/// two threads; docs/performance.md), while that loop's first tasks run on one thread alone.
///
/// Each other thread runs a job that takes the pool's pending work as it appears
/// (`rayon::yield_now`) and otherwise yields the CPU (`sched_yield`, as rayon's own idle loop
/// does), so a process sharing the cores (the coordinator, in a one-host deployment) still runs.
/// Started on a thread outside the pool, or with one thread, it does nothing.
pub struct KeepWarm {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    done: AtomicBool,
    /// threads polling now
    polling: AtomicUsize,
}

impl KeepWarm {
    pub fn start() -> Self {
        let shared = Arc::new(Shared::default());
        if let Some(starter) = rayon::current_thread_index() {
            for _ in 1..rayon::current_num_threads() {
                let shared = shared.clone();
                rayon::spawn(move || {
                    // The starting thread may pick up one of these jobs itself while it waits
                    // inside a parallel loop; it must not poll until its own pass ends.
                    if rayon::current_thread_index() == Some(starter) {
                        return;
                    }
                    shared.polling.fetch_add(1, Ordering::Relaxed);
                    while !shared.done.load(Ordering::Acquire) {
                        if rayon::yield_now() != Some(rayon::Yield::Executed) {
                            std::thread::yield_now();
                        }
                    }
                    shared.polling.fetch_sub(1, Ordering::Relaxed);
                });
            }
        }
        Self { shared }
    }
}

impl Drop for KeepWarm {
    fn drop(&mut self) {
        self.shared.done.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::time::{Duration, Instant};

    fn wait_for_no_polling(shared: &Shared) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while shared.polling.load(Ordering::Relaxed) != 0 {
            assert!(Instant::now() < deadline, "a thread still polls after its KeepWarm was dropped");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The other thread polls while the guard lives, takes part in the parallel loops it
    /// meets, and stops polling when the guard is dropped; on a thread outside any pool the
    /// guard does nothing.
    #[test]
    fn the_other_threads_poll_while_the_guard_lives_and_stop_after() {
        let outside = KeepWarm::start();
        assert_eq!(rayon::current_thread_index(), None);
        assert_eq!(Arc::strong_count(&outside.shared), 1, "a job was spawned from outside the pool");
        let pool = pool("warm-test").unwrap();
        let (sum, polled, threads, shared) = pool.install(|| {
            let warm = KeepWarm::start();
            let shared = warm.shared.clone();
            let deadline = Instant::now() + Duration::from_secs(10);
            while shared.polling.load(Ordering::Relaxed) < rayon::current_num_threads() - 1 {
                assert!(Instant::now() < deadline, "no thread started polling");
                std::thread::yield_now();
            }
            let polled = shared.polling.load(Ordering::Relaxed);
            let threads = std::sync::Mutex::new(std::collections::BTreeSet::new());
            // Tasks that sleep leave the CPU to the polling thread even on a loaded machine.
            let sum: usize = (0..256usize)
                .into_par_iter()
                .with_max_len(1)
                .map(|i| {
                    threads.lock().unwrap().insert(rayon::current_thread_index());
                    std::thread::sleep(Duration::from_micros(200));
                    i
                })
                .sum();
            drop(warm);
            (sum, polled, threads.into_inner().unwrap().len(), shared)
        });
        assert_eq!(sum, 255 * 256 / 2);
        if pool.current_num_threads() > 1 {
            assert_eq!(polled, pool.current_num_threads() - 1);
            assert!(threads > 1, "the polling thread took no part in the loop");
        }
        wait_for_no_polling(&shared);
    }
}
