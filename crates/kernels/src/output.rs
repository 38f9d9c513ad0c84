//! The output `[m, n]` of a product `x [m, k] @ w.T`, written in place by parallel tasks that
//! each own a range of weight rows, i.e. of output columns.

/// A product's output shared by its tasks: the task whose weight rows start at `first` writes
/// columns `first..` of every row and nothing else, so no two tasks write the same element, and
/// results land in place (no transposition afterwards).
#[derive(Clone, Copy)]
pub(crate) struct Output {
    ptr: *mut f32,
    n: usize,
}

// SAFETY: an Output is handed only to the tasks of one product, which write disjoint elements
// (see the type's comment) of a buffer that outlives them (`new` borrows it for the product).
unsafe impl Send for Output {}
// SAFETY: as above.
unsafe impl Sync for Output {}

impl Output {
    /// Over `values`, `[m, n]` row-major. The caller keeps `values` alive and unread until the
    /// tasks are done. (The products write every element into `uninit` buffers; tests write
    /// into zeroed ones.)
    #[cfg(test)]
    pub(crate) fn new(values: &mut [f32], n: usize) -> Output {
        assert!(if n == 0 { values.is_empty() } else { values.len() % n == 0 }, "{} values are not rows of {n}", values.len());
        Output { ptr: values.as_mut_ptr(), n }
    }

    /// Over `values`, `[m, n]` row-major and not yet written: for a product whose tasks write
    /// every element, so that the buffer need not be zeroed first. The caller keeps `values`
    /// alive and unread until the tasks are done.
    pub(crate) fn uninit(values: &mut [std::mem::MaybeUninit<f32>], n: usize) -> Output {
        assert!(if n == 0 { values.is_empty() } else { values.len() % n == 0 }, "{} values are not rows of {n}", values.len());
        Output { ptr: values.as_mut_ptr().cast(), n }
    }

    /// Columns per row.
    pub(crate) fn n(self) -> usize {
        self.n
    }

    /// The element (x row `c`, weight row `first + r`).
    ///
    /// # Safety
    /// `c < m`, `first + r < n`, and only the task owning weight row `first + r` writes it.
    pub(crate) unsafe fn at(self, first: usize, c: usize, r: usize) -> *mut f32 {
        // SAFETY: in bounds of the [m, n] buffer, as the caller promises.
        unsafe { self.ptr.add(c * self.n + first + r) }
    }
}
