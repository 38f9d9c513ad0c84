//! Weights in 2 MiB pages.
//!
//! Decode reads every weight once per step, hundreds of megabytes in order. With 4 KiB pages
//! that stream crosses a page, a TLB walk and a restart of the hardware prefetcher every 4 KiB.
//! Linux's transparent huge pages remove both, but distributions ship them as `madvise` (only
//! where a program asks), so a loaded model sat in 4 KiB pages. A plain parallel read of 1 GiB
//! on the 2-core development machine: 25.0–25.5 GB/s in 4 KiB pages, 27.0–27.3 in 2 MiB pages;
//! a whole decode step's f32 matrices through the kernels, 2–4% less time at one row and 6–8%
//! less at 16 rows (interleaved A/B in one process).
//!
//! [`advise_unwritten`] asks for them on a buffer before it is first written (the loader's
//! weights, copied from the checkpoint): `MADV_HUGEPAGE` marks the range, and its page faults
//! then take huge pages directly. [`back_with_huge_pages`] asks for them on memory already
//! written (a weight converted to another dtype, or any the loader did not advise):
//! `MADV_HUGEPAGE`, then `MADV_COLLAPSE` (Linux 6.1+) moves it into huge pages now, and where
//! that fails the kernel's khugepaged may still do it later. Collapsing copies every page: 280
//! MiB took 0.22–0.49 s here, against 0.11–0.14 s to pass over the same weights already in huge
//! pages. Only the whole 2 MiB pages inside an allocation are advised, so no neighbouring
//! allocation is touched; a weight smaller than 2 MiB has none, which is why the model gathers
//! its layers' matrices into one buffer that starts on a 2 MiB boundary after the load
//! (`tpserve::model::arena`, advised by [`advise_untouched`]). Nothing changes where THP is
//! `never`, or off Linux. `TPSERVE_HUGE_PAGES=off` turns the advice off (for comparisons).

use candle_core::{DType, Storage, Tensor};

/// The size of a huge page (x86-64 Linux transparent huge pages): 2 MiB.
pub const HUGE_PAGE: usize = 2 << 20;

/// What [`back_with_huge_pages`] did for some tensors, in bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HugePages {
    /// inside whole 2 MiB pages of the tensors' allocations, and so advised
    pub advised: usize,
    /// moved into huge pages at once (the rest is left to khugepaged)
    pub collapsed: usize,
}

impl std::ops::AddAssign for HugePages {
    fn add_assign(&mut self, other: Self) {
        self.advised += other.advised;
        self.collapsed += other.collapsed;
    }
}

/// Whether huge pages are asked for (`TPSERVE_HUGE_PAGES` is not `off`; read once).
pub fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("TPSERVE_HUGE_PAGES").map_or(true, |v| v != "off"))
}

/// Asks the kernel to hold the CPU tensor `t`'s elements in 2 MiB pages (see the module note).
/// Best effort: a tensor on another device, in a dtype without a slice view, or too small, is
/// left as it is. The contents never change.
pub fn back_with_huge_pages(t: &Tensor) -> HugePages {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { return HugePages::default() };
    let elements = layout.start_offset()..layout.start_offset() + t.elem_count();
    let bytes: Option<&[u8]> = match t.dtype() {
        DType::F32 => cpu.as_slice::<f32>().ok().and_then(|s| s.get(elements)).map(as_bytes),
        DType::BF16 => cpu.as_slice::<half::bf16>().ok().and_then(|s| s.get(elements)).map(as_bytes),
        DType::F16 => cpu.as_slice::<half::f16>().ok().and_then(|s| s.get(elements)).map(as_bytes),
        DType::U8 => cpu.as_slice::<u8>().ok().and_then(|s| s.get(elements)),
        _ => None,
    };
    bytes.map_or_else(HugePages::default, advise)
}

/// Asks for 2 MiB pages on `values`, allocated zeroed and not yet touched (fresh zero pages the
/// kernel has not backed), as [`advise_unwritten`] does for spare capacity: their whole huge
/// pages then fault in as huge pages on their first write. Returns the bytes advised.
pub fn advise_untouched<T: candle_core::WithDType>(values: &[T]) -> usize {
    mark(as_bytes(values)).1
}

/// Asks for 2 MiB pages on memory not yet written (a buffer's spare capacity), before its first
/// write faults it in: `MADV_HUGEPAGE` on the whole huge pages inside it, so that the kernel
/// backs them with huge pages as they fault in, without the copy a collapse of written memory
/// costs. Returns the bytes advised (0 where nothing was, as off Linux or when turned off).
pub fn advise_unwritten<T>(spare: &mut [std::mem::MaybeUninit<T>]) -> usize {
    // SAFETY: the pointer and length describe memory `spare` borrows; the slice of bytes is
    // only used for its address range, never read.
    let bytes = unsafe { std::slice::from_raw_parts(spare.as_ptr().cast::<u8>(), std::mem::size_of_val(spare)) };
    mark(bytes).1
}

fn as_bytes<T: Copy>(values: &[T]) -> &[u8] {
    // SAFETY: the element types passed here (u8, f32, bf16, f16: candle's element types) are
    // plain numbers without padding, so their memory is that many initialised bytes, which live
    // as long as `values`.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

/// The whole 2 MiB pages inside `bytes`: (first address, length), the length 0 when none.
fn whole_huge_pages(bytes: &[u8]) -> (usize, usize) {
    let start = bytes.as_ptr() as usize;
    let first = start.next_multiple_of(HUGE_PAGE);
    let end = (start + bytes.len()) / HUGE_PAGE * HUGE_PAGE;
    (first, end.saturating_sub(first))
}

/// `MADV_HUGEPAGE` on the whole huge pages inside `bytes`: (first address, bytes marked).
#[cfg(target_os = "linux")]
fn mark(bytes: &[u8]) -> (usize, usize) {
    let (first, len) = whole_huge_pages(bytes);
    if len == 0 || !enabled() {
        return (first, 0);
    }
    // SAFETY: [first, first + len) lies inside `bytes`, memory this process owns and keeps
    // mapped while the borrow lasts. The advice marks the range and changes nothing it holds.
    let marked = unsafe { libc::madvise(first as *mut libc::c_void, len, libc::MADV_HUGEPAGE) } == 0;
    (first, if marked { len } else { 0 })
}

#[cfg(target_os = "linux")]
fn advise(bytes: &[u8]) -> HugePages {
    let (first, len) = mark(bytes);
    if len == 0 {
        return HugePages::default();
    }
    // SAFETY: as in `mark`. COLLAPSE copies the range's pages into huge pages under the kernel's
    // locks, the contents unchanged; on pages already huge it has nothing to do.
    let collapsed = unsafe { libc::madvise(first as *mut libc::c_void, len, libc::MADV_COLLAPSE) } == 0;
    HugePages { advised: len, collapsed: if collapsed { len } else { 0 } }
}

#[cfg(not(target_os = "linux"))]
fn mark(_bytes: &[u8]) -> (usize, usize) {
    (0, 0)
}

#[cfg(not(target_os = "linux"))]
fn advise(_bytes: &[u8]) -> HugePages {
    HugePages::default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn only_whole_huge_pages_inside_the_range_are_taken() {
        let buffer = vec![0u8; 5 * HUGE_PAGE];
        let start = buffer.as_ptr() as usize;
        let skip = start.next_multiple_of(HUGE_PAGE) - start;
        // From a page boundary: every whole page, not the partial tail.
        let (first, len) = whole_huge_pages(&buffer[skip..skip + 2 * HUGE_PAGE + 100]);
        assert_eq!((first, len), (start + skip, 2 * HUGE_PAGE));
        // One byte past a boundary: the first page is partial and left out.
        let (first, len) = whole_huge_pages(&buffer[skip + 1..skip + 3 * HUGE_PAGE]);
        assert_eq!((first, len), (start + skip + HUGE_PAGE, 2 * HUGE_PAGE));
        // Smaller than a page: nothing.
        assert_eq!(whole_huge_pages(&buffer[skip + 1..skip + HUGE_PAGE]).1, 0);
    }

    /// Memory advised before its first write takes the values written into it, and a buffer of
    /// several pages gets the advice.
    #[test]
    fn unwritten_memory_advised_then_written_holds_its_values() {
        let n = 3 * HUGE_PAGE / 4;
        let mut values: Vec<f32> = Vec::with_capacity(n);
        let advised = advise_unwritten(values.spare_capacity_mut());
        values.extend((0..n).map(|i| i as f32 * 0.25 - 3.0));
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if cfg!(target_os = "linux") && enabled() && !thp.is_empty() && !thp.contains("[never]") {
            assert!(advised >= 2 * HUGE_PAGE, "{advised}");
        }
        assert!(values.iter().enumerate().all(|(i, &v)| v == i as f32 * 0.25 - 3.0));
    }

    /// The advice never changes a tensor's values, and a weight of several pages gets some.
    #[test]
    fn advice_keeps_the_values() {
        let values: Vec<f32> = (0..3 * HUGE_PAGE / 4).map(|i| i as f32 * 0.5 - 7.0).collect();
        let t = Tensor::from_vec(values.clone(), (3 * HUGE_PAGE / 4 / 512, 512), &Device::Cpu).unwrap();
        let done = back_with_huge_pages(&t);
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if cfg!(target_os = "linux") && enabled() && !thp.is_empty() && !thp.contains("[never]") {
            // 6 MiB of f32 hold at least two whole 2 MiB pages wherever they start.
            assert!(done.advised >= 2 * HUGE_PAGE, "{done:?}");
        }
        assert_eq!(t.flatten_all().unwrap().to_vec1::<f32>().unwrap(), values);
        let bf16 = t.to_dtype(DType::BF16).unwrap();
        let before = bf16.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
        back_with_huge_pages(&bf16);
        assert_eq!(bf16.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap(), before);
    }
}
