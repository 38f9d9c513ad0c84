//! Weight rows interleaved eight at a time ("x8"): the resident layout of the 32-value block
//! formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) and of Q4_K, Q5_K and Q6_K (their group-blocks and
//! products in [`super::interleaved_k`]), and their matrix products.
//!
//! In GGML's row layout a dot product pays, for every 32-value block, a horizontal sum and
//! scalar arithmetic on f16 scales; that bookkeeping, not the integer products, was most of a
//! block's cost. Here block `b` of eight consecutive rows is stored together, arranged so that a
//! 256-bit register holds four values of each of the eight rows, one row per 32-bit lane.
//! Broadcasting four activation bytes to every lane then yields the eight rows' partial sums
//! lane by lane: no horizontal sums, and the eight rows' scales widen in one instruction and
//! multiply as one vector. llama.cpp's repacked CPU layouts (`q4_0_8x8`) rest on the same idea.
//! On AVX-512 VNNI two consecutive groups share a 512-bit register (group g in the low half,
//! g + 1 in the high one; the groups of a matrix are contiguous, so the halves are two loads a
//! group apart): the same broadcast activation bytes then feed sixteen rows per `vpdpbusd`.
//! Past eight activation rows, Q8_0 takes two such pairs at once, so that each broadcast feeds
//! two `vpdpbusd` (see [`QUAD_ROWS`]).
//! A whole decode step of a 100M Qwen3 shape, against the 256-bit body on the same CPU (Ice
//! Lake, 2 threads, in one process, alternating): Q8_0 1.18x at one activation row, 1.28x at
//! sixteen; Q4_1 1.08x and 1.13x; Q5_0 1.14x and 1.18x.
//!
//! A group-block (block `b` of rows `8g..8g+8`) has exactly the bytes of those eight GGML
//! blocks, so a matrix keeps its size:
//!
//! | format | d, f16 x8 | m, f16 x8 | 5th bits | values |
//! |--------|-----------|-----------|----------|--------|
//! | Q4_0   | 16        |           |          | 128    |
//! | Q4_1   | 16        | 16        |          | 128    |
//! | Q5_0   | 16        |           | 32       | 128    |
//! | Q5_1   | 16        | 16        | 32       | 128    |
//! | Q8_0   | 16        |           |          | 256    |
//! | IQ4_NL | 16        |           |          | 128    |
//!
//! - 4- and 5-bit values: 32-byte chunk `u` (0..4) holds in lane `r` bytes `4u..4u+4` of row r's
//!   packed nibbles, whose low nibbles are values `4u..4u+4` and high nibbles `16+4u..16+4u+4`.
//!   Register `t` (0..8: chunk `t % 4`, low nibbles for `t < 4`, high ones after) thus pairs with
//!   activation values `4t..4t+4`.
//! - 5th bits: 32-bit word `t` has bit `4r + i` set when value `4t + i` of row r has its 5th bit.
//! - Q8_0: 32-byte chunk `t` (0..8) holds bytes `4t..4t+4` of row r in lane r.
//! - IQ4_NL: as Q4_0 (the same bytes); each nibble indexes the 16 signed levels, which one
//!   `vpshufb` looks up for a whole register. They then multiply as Q8_0's bytes do (on
//!   512-bit vectors, the table holds the levels plus 128, as Q8_0's values go in there).
//!
//! Rows past the last whole group stay in row layout after the groups and go through
//! [`super::kernels`] (for the K-quants, [`super::kquant`]'s row kernels). A product's additions
//! happen in the same order on every path and for every batch size, so every path equals
//! [`group_portable`] ([`super::interleaved_k::group_portable`] for the K-quants) bit for bit,
//! and a row's result does not depend on the batch it is in.

use rayon::prelude::*;

use super::formats::{Format, row_bytes};
use super::iq4::LEVELS;
use super::kernels::{self, ActQ8, Path, quantize_act};
use super::interleaved_k::{self, KQuant};
use super::kquant::{ActQ8K, quantize_act_k};
use crate::output::Output;

/// Activation values from which a product quantizes its rows in parallel (64 rows of 1,024),
/// whatever their number of rows (see [`quantized`]).
const PARALLEL_QUANTIZATION: usize = 1 << 16;
/// Rows per interleaved group: one per 32-bit lane of a 256-bit register.
pub const GROUP: usize = 8;
/// Groups per parallel task (32 rows, as the row-layout kernels). Even, so that only the last
/// task can have an odd group left over from its pairs.
const GROUPS_PER_TASK: usize = 4;
const _: () = assert!(GROUPS_PER_TASK % 2 == 0);
/// Most activation rows a pair of groups takes at once on 512-bit vectors: 8 integer and 8
/// float accumulators, against 4 (8 in all) before. Each weight vector loaded (and, for Q8_0,
/// biased) serves twice the rows, and twice the chains of `vpdpbusd` run side by side. A
/// whole 100M step, Ice Lake, 2 threads, alternating in one process: 1.05-1.19x at 16 rows,
/// 1.01-1.10x at 32, 1.06-1.14x at 512 for Q8_0, Q4_1 and Q5_0 (unchanged at 4 rows or
/// fewer, which take the same body as before).
const PAIR_ROWS: usize = 8;
/// Most activation rows two pairs (a task's four groups, Q8_0) take at once: 12 integer and 12
/// float accumulators. A broadcast activation word then feeds two `vpdpbusd`, and a block of
/// 96 of them loads 96 times, where one pair at eight rows loads 98 times for 64: bound by
/// the two loads a thread issues a cycle, the pair body ran at 5.0 G `vpdpbusd` a second
/// (Zen 5, in L1, with its scales), two pairs at four rows 5.7 and at six 6.3.
const QUAD_ROWS: usize = 6;
/// Fewest activation rows that take two pairs: those a pair takes in more than one pass. At one
/// row the second pair's weights stream from memory beside the first's (100M Q8_0 step 2.41
/// -> 2.60 ms, Zen 5); at eight, one pass against two (6 + 2 rows), the same (3.78 and 3.74);
/// at twelve 5.04 -> 4.45-4.58, at sixteen 6.60 -> 5.94-6.04.
const QUAD_MIN_ROWS: usize = PAIR_ROWS + 1;
/// The most sums a pass of one or two pairs returns: a row of lanes per activation row.
const PASS_LANES: usize = if 2 * GROUP * PAIR_ROWS > 4 * GROUP * QUAD_ROWS { 2 * GROUP * PAIR_ROWS } else { 4 * GROUP * QUAD_ROWS };
const QK: usize = 32;

/// The formats held interleaved (resident): the model packs every one of them (the K-quants
/// of [`KQuant`] among them).
pub fn packable(dtype: Format) -> bool {
    use Format::*;
    matches!(dtype, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Iq4Nl) || KQuant::of(dtype).is_some()
}

/// Where the parts of a format's blocks are: in a GGML block and in a group-block.
#[derive(Clone, Copy, Debug)]
struct Parts {
    /// an offset `m` per block (Q4_1, Q5_1)
    offset: bool,
    /// a 5th bit per value (Q5_0, Q5_1)
    high: bool,
    /// one signed byte per value (Q8_0)
    eight_bit: bool,
}

impl Parts {
    fn of(dtype: Format) -> Parts {
        use Format::*;
        match dtype {
            Q4_0 | Iq4Nl => Parts { offset: false, high: false, eight_bit: false },
            Q4_1 => Parts { offset: true, high: false, eight_bit: false },
            Q5_0 => Parts { offset: false, high: true, eight_bit: false },
            Q5_1 => Parts { offset: true, high: true, eight_bit: false },
            Q8_0 => Parts { offset: false, high: false, eight_bit: true },
            other => panic!("{other:?} is not held interleaved"),
        }
    }

    // In a GGML block: d, then m, then the 5th bits (u32), then the values.
    fn block_m(self) -> usize {
        2
    }
    fn block_qh(self) -> usize {
        2 + 2 * self.offset as usize
    }
    fn block_qs(self) -> usize {
        self.block_qh() + 4 * self.high as usize
    }

    // In a group-block: the same parts, eight at a time.
    fn group_m(self) -> usize {
        16
    }
    fn group_qh(self) -> usize {
        16 + 16 * self.offset as usize
    }
    fn group_qs(self) -> usize {
        self.group_qh() + 32 * self.high as usize
    }
    fn group_bytes(self) -> usize {
        self.group_qs() + if self.eight_bit { 256 } else { 128 }
    }
}

/// Interleaves the eight GGML blocks `rows` into group-block `out`.
fn pack_block(p: Parts, rows: [&[u8]; GROUP], out: &mut [u8]) {
    for (r, blk) in rows.iter().enumerate() {
        out[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
        if p.offset {
            out[p.group_m() + 2 * r..p.group_m() + 2 * r + 2].copy_from_slice(&blk[p.block_m()..p.block_m() + 2]);
        }
        let qs = &blk[p.block_qs()..];
        let chunks = if p.eight_bit { 8 } else { 4 };
        for c in 0..chunks {
            let at = p.group_qs() + 32 * c + 4 * r;
            out[at..at + 4].copy_from_slice(&qs[4 * c..4 * c + 4]);
        }
    }
    if p.high {
        for t in 0..8 {
            let mut word = 0u32;
            for (r, blk) in rows.iter().enumerate() {
                let qh = u32::from_le_bytes(blk[p.block_qh()..p.block_qh() + 4].try_into().expect("4 bytes"));
                word |= ((qh >> (4 * t)) & 0xF) << (4 * r);
            }
            out[p.group_qh() + 4 * t..p.group_qh() + 4 * t + 4].copy_from_slice(&word.to_le_bytes());
        }
    }
}

/// Row `r`'s GGML block out of group-block `group` (the inverse of [`pack_block`]).
fn unpack_block(p: Parts, group: &[u8], r: usize, out: &mut [u8]) {
    out[..2].copy_from_slice(&group[2 * r..2 * r + 2]);
    if p.offset {
        out[p.block_m()..p.block_m() + 2].copy_from_slice(&group[p.group_m() + 2 * r..p.group_m() + 2 * r + 2]);
    }
    let chunks = if p.eight_bit { 8 } else { 4 };
    for c in 0..chunks {
        let at = p.group_qs() + 32 * c + 4 * r;
        out[p.block_qs() + 4 * c..p.block_qs() + 4 * c + 4].copy_from_slice(&group[at..at + 4]);
    }
    if p.high {
        let mut qh = 0u32;
        for t in 0..8 {
            let word = u32::from_le_bytes(group[p.group_qh() + 4 * t..p.group_qh() + 4 * t + 4].try_into().expect("4 bytes"));
            qh |= ((word >> (4 * r)) & 0xF) << (4 * t);
        }
        out[p.block_qh()..p.block_qh() + 4].copy_from_slice(&qh.to_le_bytes());
    }
}

/// A row-major `[rows, cols]` matrix of `dtype` blocks in the interleaved layout (same size).
pub fn pack(dtype: Format, rows: usize, cols: usize, bytes: &[u8]) -> Vec<u8> {
    assert!(packable(dtype), "{dtype:?} has no interleaved layout");
    let (ts, rb) = (dtype.type_size(), row_bytes(dtype, cols));
    assert_eq!(bytes.len(), rows * rb, "{} bytes are not [{rows}, {cols}] of {dtype:?}", bytes.len());
    let blocks = cols / dtype.block_size();
    let groups = rows / GROUP;
    // a group-block has the bytes of its eight blocks
    let gbytes = GROUP * ts;
    // Advised for 2 MiB pages before the zeros are written (`pages`): a resident weight, read
    // every step, that the load need not copy into huge pages afterwards.
    let mut out = Vec::with_capacity(bytes.len());
    crate::pages::advise_unwritten(out.spare_capacity_mut());
    out.resize(bytes.len(), 0u8);
    let (grouped, tail) = out.split_at_mut(groups * GROUP * rb);
    grouped.par_chunks_mut(GROUP * rb.max(1)).enumerate().for_each(|(g, out)| {
        for b in 0..blocks {
            let rows = std::array::from_fn(|r| &bytes[(g * GROUP + r) * rb + b * ts..(g * GROUP + r) * rb + (b + 1) * ts]);
            let out = &mut out[b * gbytes..(b + 1) * gbytes];
            if let Some(kq) = KQuant::of(dtype) {
                interleaved_k::pack_block(kq, rows, out);
            } else {
                pack_block(Parts::of(dtype), rows, out);
            }
        }
    });
    tail.copy_from_slice(&bytes[groups * GROUP * rb..]);
    out
}

/// Row `row` of an interleaved matrix, as GGML row-layout bytes.
pub fn row(dtype: Format, rows: usize, cols: usize, packed: &[u8], row: usize) -> Vec<u8> {
    assert!(packable(dtype), "{dtype:?} has no interleaved layout");
    let (ts, rb) = (dtype.type_size(), row_bytes(dtype, cols));
    let gbytes = GROUP * ts;
    assert!(row < rows && packed.len() == rows * rb);
    let groups = rows / GROUP;
    if row >= groups * GROUP {
        return packed[row * rb..(row + 1) * rb].to_vec();
    }
    let (g, r) = (row / GROUP, row % GROUP);
    let group = &packed[g * GROUP * rb..(g + 1) * GROUP * rb];
    let mut out = vec![0u8; rb];
    for (b, blk) in out.chunks_exact_mut(ts).enumerate() {
        let group = &group[b * gbytes..(b + 1) * gbytes];
        if let Some(kq) = KQuant::of(dtype) {
            interleaved_k::unpack_block(kq, group, r, blk);
        } else {
            unpack_block(Parts::of(dtype), group, r, blk);
        }
    }
    out
}

/// The row-major GGML bytes of an interleaved matrix (the inverse of [`pack`]), a group of
/// eight rows per task: joining matrices at load (`cat_rows`) unpacks every byte of them.
pub fn unpack(dtype: Format, rows: usize, cols: usize, packed: &[u8]) -> Vec<u8> {
    assert!(packable(dtype), "{dtype:?} has no interleaved layout");
    let (ts, rb) = (dtype.type_size(), row_bytes(dtype, cols));
    assert_eq!(packed.len(), rows * rb, "{} bytes are not [{rows}, {cols}] of {dtype:?}", packed.len());
    let gbytes = GROUP * ts;
    let groups = rows / GROUP;
    let mut out = vec![0u8; packed.len()];
    let (grouped, tail) = out.split_at_mut(groups * GROUP * rb);
    grouped.par_chunks_mut(GROUP * rb.max(1)).enumerate().for_each(|(g, out)| {
        let group = &packed[g * GROUP * rb..(g + 1) * GROUP * rb];
        for (r, row) in out.chunks_exact_mut(rb).enumerate() {
            for (b, blk) in row.chunks_exact_mut(ts).enumerate() {
                let group = &group[b * gbytes..(b + 1) * gbytes];
                match KQuant::of(dtype) {
                    Some(kq) => interleaved_k::unpack_block(kq, group, r, blk),
                    None => unpack_block(Parts::of(dtype), group, r, blk),
                }
            }
        }
    });
    tail.copy_from_slice(&packed[groups * GROUP * rb..]);
    out
}

/// `x [m, k] @ w.T` for `w` `[n, k]` interleaved (see [`pack`]): returns `[m, n]`.
pub fn matmul(x: &[f32], m: usize, k: usize, dtype: Format, w: &[u8], n: usize, path: Path) -> Vec<f32> {
    assert!(path.available(), "this CPU has no {path:?} path");
    let rb = row_bytes(dtype, k);
    assert_eq!(w.len(), n * rb, "weight bytes do not match [{n}, {k}] of {dtype:?}");
    assert_eq!(x.len(), m * k);
    assert!(packable(dtype), "{dtype:?} has no interleaved layout");
    if m == 0 {
        return Vec::new();
    }
    let k_quant = KQuant::of(dtype);
    let groups = n / GROUP;
    let grouped_rows = groups * GROUP;
    // 512-bit vectors take two groups at once (a group's eight rows in each half), and the
    // activation rows in batches of PAIR_ROWS (QUAD_ROWS where two pairs go at once) laid out
    // for them; a task's odd group left over takes one group at a time.
    let pairs = path == Path::Avx512Vnni && k_quant.is_none() && groups >= 2;
    let singles = !pairs || groups % 2 == 1;
    // From QUAD_MIN_ROWS rows on, Q8_0 takes two pairs (a whole task) at once, and the pairs
    // of a task's last groups come in batches of QUAD_ROWS too.
    let quads = pairs && dtype == Format::Q8_0 && m >= QUAD_MIN_ROWS;
    let acts: Vec<ActQ8> = if k_quant.is_none() && singles { quantized(x, m, k, quantize_act) } else { Vec::new() };
    let acts: Vec<&ActQ8> = acts.iter().collect();
    // Q8_K rows, slower to make, are quantized in parallel at any batch: at 16 rows, serially,
    // the K-quant products took 1.0-1.5x the time, most often about 1.3x (Zen 5).
    let acts_k: Vec<ActQ8K> = if k_quant.is_some() { x.par_chunks_exact(k).map(quantize_act_k).collect() } else { Vec::new() };
    let acts_k: Vec<&ActQ8K> = acts_k.iter().collect();
    let batch_rows = if quads { QUAD_ROWS } else { PAIR_ROWS };
    let batches: Vec<PairActs> = if pairs { quantized(x, m, batch_rows * k, |rows| PairActs::quantize(rows, k)) } else { Vec::new() };
    // Not zeroed first: the groups' tasks and the tail rows below write every element.
    let mut values = Vec::with_capacity(m * n);
    let out = Output::uninit(&mut values.spare_capacity_mut()[..m * n], n);
    // Rayon's pieces of at most eight tasks (256 weight rows), so that a thread out of work
    // finds some to take at the end of a product: left to itself, rayon ran up to a quarter of a
    // [4096x768] product's 128 tasks in one piece (a 16-row q8_0 step of the 100M shape: 5.8%
    // of both threads' samples idle while the other finished its piece). A task is a
    // microsecond or two at 16 rows, so one job each cost what it saved (1 row 3% slower).
    // That step, alternating step by step in one process, medians of 100: 16 rows 6.0%, 4.3%
    // and 1.1% less time, one row the same (+1.5%, -1.3%, +0.4%).
    (0..groups.div_ceil(GROUPS_PER_TASK)).into_par_iter().with_max_len(8).for_each(|task| {
        let end = ((task + 1) * GROUPS_PER_TASK).min(groups);
        let mut g = task * GROUPS_PER_TASK;
        while g < end {
            let span = if quads && g + 3 < end {
                4
            } else if pairs && g + 1 < end {
                2
            } else {
                1
            };
            let groups_bytes = &w[g * GROUP * rb..(g + span) * GROUP * rb];
            if span > 1 {
                // The next task's first groups, past this task's end, are most often this
                // thread's too (rayon splits the tasks in contiguous ranges).
                let at = |g: usize| (g * GROUP * rb).min(grouped_rows * rb);
                let next = &w[at(g + span)..at(g + 2 * span)];
                pairs_dot(dtype, span / 2, groups_bytes, &batches, next, |done, sums| {
                    // SAFETY: activation rows done.. of the batch (< m) and weight rows
                    // g * GROUP..(g + span) * GROUP < n, in this task's groups: no other task
                    // writes them.
                    unsafe { store(out, g * GROUP, done, span * GROUP, sums) }
                });
            } else {
                let mut done = 0;
                while done < m {
                    let take = (m - done).min(4);
                    let mut sums = [[0f32; GROUP]; 4];
                    let batch = match k_quant {
                        Some(kq) => Acts::K(kq, &acts_k[done..done + take]),
                        None => Acts::Q8(&acts[done..done + take]),
                    };
                    group_dot(path, dtype, groups_bytes, batch, &mut sums[..take]);
                    // SAFETY: as above, for the one group g.
                    unsafe { store(out, g * GROUP, done, GROUP, sums[..take].as_flattened()) };
                    done += take;
                }
            }
            g += span;
        }
    });
    if grouped_rows < n {
        let tail_rows = n - grouped_rows;
        let tail = kernels::matmul(x, m, k, dtype, &w[grouped_rows * rb..], tail_rows, path);
        // SAFETY: activation rows 0..m, weight rows grouped_rows..n: inside `out`, and the
        // tasks above are done.
        unsafe { store(out, grouped_rows, 0, tail_rows, &tail) };
    }
    // SAFETY: every element is written: the tasks cover columns 0..grouped_rows of every
    // activation row (each group's `store`s, `done` running up to m), the tail's `store`
    // columns grouped_rows..n.
    unsafe { values.set_len(m * n) };
    values
}

/// Activation rows `first_row..` of `out` get `values`, `width` of them a row, in columns
/// `first_col..`.
///
/// # Safety
/// Those elements are inside `out` and only the calling task writes them.
unsafe fn store(out: Output, first_col: usize, first_row: usize, width: usize, values: &[f32]) {
    for (j, row) in values.chunks_exact(width).enumerate() {
        // SAFETY: as the caller promises.
        unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), out.at(first_col, first_row + j, 0), width) }
    }
}

/// Up to four activation rows of a product: 8-bit per 32 values (the 32-value formats) or
/// Q8_K (the K-quants).
#[derive(Clone, Copy)]
enum Acts<'a> {
    Q8(&'a [&'a ActQ8]),
    K(KQuant, &'a [&'a ActQ8K]),
}

/// One group's eight rows against up to four activation rows: `out[j][r]` is row r dotted with
/// activation row j. The one place a path is taken for the 32-value formats
/// ([`interleaved_k::group_dot`] for the K-quants).
fn group_dot(path: Path, dtype: Format, group: &[u8], acts: Acts, out: &mut [[f32; GROUP]]) {
    let acts = match acts {
        Acts::Q8(acts) => acts,
        Acts::K(kq, acts) => return interleaved_k::group_dot(path, kq, group, acts, out),
    };
    let blocks = acts[0].d.len();
    assert!(acts.len() <= 4 && acts.len() == out.len());
    assert!(group.len() == blocks * Parts::of(dtype).group_bytes());
    assert!(acts.iter().all(|a| a.d.len() == blocks && a.s.len() == blocks && a.qs.len() == blocks * QK));
    match path {
        Path::Portable => group_portable(dtype, group, acts, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `matmul` asserted this CPU has the path; the group holds `blocks`
        // group-blocks of `dtype` and every activation row `blocks` blocks (asserted above).
        Path::Avx2 => unsafe { x86::group_avx2(dtype, group.as_ptr(), blocks, acts, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, with AVX-512 VNNI and VL checked by `Path::available`.
        Path::Avx512Vnni => unsafe { x86::group_vnni(dtype, group.as_ptr(), blocks, acts, out) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => group_portable(dtype, group, acts, out),
    }
}

/// Up to [`PAIR_ROWS`] quantized activation rows arranged for the 512-bit pair body: block by
/// block, the rows' 32 bytes one after another, then their scales `d`, their scaled sums `s`
/// and their `-128 * sums` (where Q8_0's and IQ4_NL's integer sums start, see
/// `x86::pair_body`), so that every operand of a block lies at a fixed offset from one pointer.
/// Read from the rows' own vectors, the Q8_0 body reloaded three pointers a row a block from
/// the stack and shifted and broadcast each bias: 230 instructions a block for its 64
/// `vpdpbusd`, 150 now, 5-10% faster at 8 and 16 rows (`quant_matvec --batches`, one thread).
/// With the rows quantized straight into it, and a small batch on the calling thread, a
/// 16-row product on two threads (Zen 5, weights in cache): [768x768] 47 -> 24 µs, [768x1280]
/// 60 -> 35, [768x4096] 148 -> 97.
struct PairActs {
    rows: usize,
    blocks: usize,
    /// `blocks` records of [`PairActs::record`] bytes
    bytes: Vec<u8>,
}

impl PairActs {
    /// Bytes of a block's record for `rows` rows: 32 values and three 4-byte numbers a row.
    const fn record(rows: usize) -> usize {
        (QK + 12) * rows
    }

    /// Quantizes `x` (1 to [`PAIR_ROWS`] rows of `k` values) into its records, each row's
    /// blocks as [`quantize_act`] makes them.
    fn quantize(x: &[f32], k: usize) -> PairActs {
        let rows = x.len() / k;
        let blocks = k / QK;
        assert!((1..=PAIR_ROWS).contains(&rows) && x.len() == rows * k && k % QK == 0);
        let record = Self::record(rows);
        let mut bytes = vec![0u8; blocks * record];
        for (j, row) in x.chunks_exact(k).enumerate() {
            kernels::quantize_act_blocks(row, |b, values, d, sum| {
                let (values_at, numbers) = (b * record + QK * j, b * record + QK * rows + 4 * j);
                for (to, &q) in bytes[values_at..values_at + QK].iter_mut().zip(values) {
                    *to = q as u8;
                }
                // |sum| <= 32 * 128, so -128 * sum fits an i32 with room to spare.
                for (i, number) in [d.to_ne_bytes(), (d * sum as f32).to_ne_bytes(), (-128 * sum).to_ne_bytes()].iter().enumerate() {
                    let at = numbers + 4 * rows * i;
                    bytes[at..at + 4].copy_from_slice(number);
                }
            });
        }
        PairActs { rows, blocks, bytes }
    }
}

/// `pairs` pairs of consecutive groups (`groups`: their bytes) against every batch of
/// activation rows on 512-bit vectors, one pass a batch; `stored(first_row, sums)` gets each
/// pass's sums, a row after another of `2 * GROUP * pairs` lanes: the lanes of [`group_dot`]
/// for each group in turn. Meanwhile it asks for `next` (the bytes of the groups after these,
/// or none) to be brought in, an equal share of it per pass and per block. The hardware
/// prefetchers alone kept too few of the weights' cache lines in flight: a pair's first pass
/// waited on memory, and at more than eight rows the later passes, which find the pair in
/// cache, left the memory idle. Zen 5, 2 threads, 100M Qwen3 shape in Q8_0, ms a step,
/// alternating runs: 2.96-3.24 -> 2.57-2.85 at one row, 5.82-6.38 -> 4.15-4.62 at eight,
/// 10.5-12.2 -> 7.1-8.5 at sixteen; SmolLM2 Q4_1 at one row 3.63-3.84 -> 2.51-2.81. (Two
/// pairs ahead measured the same.) The hint is non-temporal: the weights are read once a
/// step, and so asked for they keep less of the caches from the rest of the step; against
/// L2's hint, a step's median over 8 alternating runs 2.49 -> 2.41 ms at one row, 4.21 -> 4.04
/// at eight, the same at sixteen. Two pairs at 16 rows take three passes (6, 6 and 4 rows),
/// each with less time per byte than one pair's: asking only in the last pass, a 100M Q8_0
/// step took 7.10 ms against one pair's 5.81 (2 threads, alternating); with the share spread
/// over every pass, 5.62 against 6.11, and a prefill of 512 rows 103 against 118 ms. (For one
/// pair the spread measured the same as the last pass: Q4_1, 16 rows, 5.53 and 5.52 ms.)
fn pairs_dot(dtype: Format, pairs: usize, groups: &[u8], batches: &[PairActs], next: &[u8], mut stored: impl FnMut(usize, &[f32])) {
    let lines = next.len().div_ceil(64);
    let mut done = 0;
    for (pass, acts) in batches.iter().enumerate() {
        let blocks = acts.blocks;
        assert!(groups.len() == 2 * pairs * blocks * Parts::of(dtype).group_bytes());
        assert!(acts.rows <= if pairs == 1 { PAIR_ROWS } else { QUAD_ROWS });
        let share = |pass: usize| (pass * lines / batches.len() * 64).min(next.len());
        let ahead = &next[share(pass)..share(pass + 1)];
        let mut sums = [0f32; PASS_LANES];
        let sums = &mut sums[..acts.rows * 2 * GROUP * pairs];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `matmul` asserted this CPU has the path, and takes pairs only on the AVX-512
        // VNNI one (F, BW, VL, VNNI), two pairs only for Q8_0; `groups` holds `2 * pairs`
        // groups of `blocks` group-blocks of `dtype`, `acts` `blocks` records of its rows
        // (`PairActs::quantize`, as many as the body takes) and `sums` a row of lanes each.
        unsafe {
            x86::pairs_vnni(dtype, pairs, groups.as_ptr(), blocks, acts.bytes.as_ptr(), acts.rows, sums, ahead)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no AVX-512 path off x86-64 ({dtype:?}, {} bytes, {} rows, {} outputs, {} ahead)", groups.len(), acts.rows, sums.len(), ahead.len());
        stored(done, sums);
        done += acts.rows;
    }
}

/// `quantize` of each `chunk` values of `x` (`m` rows: a row, or a batch of rows a chunk), in
/// order. More than [`PAIR_ROWS`] rows, or a large batch, are quantized in parallel: done
/// serially they were a tenth of a 16-row Q8_0 product, with the other thread idle. Measured
/// alone, waking the other thread for 16 rows of 768 took longer than the work (11.4 µs in
/// parallel, 8.3 serially, Zen 5), but the product that follows wakes it anyway, and finds it
/// awake: a whole 100M Q8_0 step, alternating, 2 threads, serial below 65,536 values against
/// parallel past eight rows, 16 rows 6.33 -> 5.65 ms, 32 rows 11.35 -> 10.70 (on the AVX2
/// path, one group at a time, 16 rows 14.02 -> 13.18). A few rows stay on the calling thread:
/// at two rows on the AVX2 path, one task a row, parallel measured 2.59 -> 2.70 ms.
fn quantized<T: Send>(x: &[f32], m: usize, chunk: usize, quantize: impl Fn(&[f32]) -> T + Sync + Send) -> Vec<T> {
    if m > PAIR_ROWS || x.len() >= PARALLEL_QUANTIZATION {
        x.par_chunks(chunk).map(quantize).collect()
    } else {
        x.chunks(chunk).map(quantize).collect()
    }
}

/// The scalar reference: per block and lane, `acc = fma(isum, d_w * d_x, acc)` then
/// `acc = fma(c_w, s_x, acc)` (`c_w`: `-8 d_w`, `-16 d_w`, or `m_w`; none for Q8_0 and IQ4_NL,
/// whose values are signed), which is what every SIMD path computes lane by lane.
pub fn group_portable(dtype: Format, group: &[u8], acts: &[&ActQ8], out: &mut [[f32; GROUP]]) {
    let p = Parts::of(dtype);
    let signed = p.eight_bit || dtype == Format::Iq4Nl;
    let f16 = |gb: &[u8], at: usize| half::f16::from_le_bytes([gb[at], gb[at + 1]]).to_f32();
    for o in out.iter_mut() {
        *o = [0.0; GROUP];
    }
    let mut values = [0i32; QK];
    for (b, gb) in group.chunks_exact(p.group_bytes()).enumerate() {
        for r in 0..GROUP {
            let d = f16(gb, 2 * r);
            let c = match dtype {
                Format::Q4_0 => -8.0 * d,
                Format::Q5_0 => -16.0 * d,
                _ if p.offset => f16(gb, p.group_m() + 2 * r),
                _ => 0.0,
            };
            // Row r's 32 values of this block: value 4t + i is byte i of lane r in register t.
            for t in 0..8 {
                let high = if p.high {
                    u32::from_le_bytes(gb[p.group_qh() + 4 * t..p.group_qh() + 4 * t + 4].try_into().expect("4 bytes")) >> (4 * r)
                } else {
                    0
                };
                for i in 0..4 {
                    values[4 * t + i] = if p.eight_bit {
                        gb[p.group_qs() + 32 * t + 4 * r + i] as i8 as i32
                    } else {
                        let byte = gb[p.group_qs() + 32 * (t % 4) + 4 * r + i];
                        let nibble = if t < 4 { byte & 15 } else { byte >> 4 };
                        if dtype == Format::Iq4Nl {
                            LEVELS[nibble as usize] as i32
                        } else {
                            (nibble as u32 | ((high >> i) & 1) << 4) as i32
                        }
                    };
                }
            }
            for (act, o) in acts.iter().zip(out.iter_mut()) {
                let x = &act.qs[b * QK..(b + 1) * QK];
                let isum: i32 = values.iter().zip(x).map(|(&w, &x)| w * x as i32).sum();
                o[r] = (isum as f32).mul_add(d * act.d[b], o[r]);
                if !signed {
                    o[r] = c.mul_add(act.s[b], o[r]);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::quant::formats::Format;

    use super::super::kernels::x86::{IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, high_bits, levels};
    use super::{ActQ8, GROUP, Parts, QK};

    /// How far ahead of the group-block being read [`body`] prefetches: the hardware prefetcher
    /// alone left a decode step's first loads of each group-block waiting on memory. A whole
    /// 100M step at one activation row against none (Zen 2, 2 threads, by turns): 1,024 bytes
    /// 1.05x (Q8_0) and 1.22x (Q4_0), 512 1.07x and 1.16x, 2,048 0.93x and 1.11x.
    const PREFETCH_AHEAD: usize = 1024;

    /// One instantiation per format and batch size (1..=4 activation rows), compiled for the
    /// features of `$features`.
    macro_rules! group_fn {
        ($name:ident, $vnni:expr, $features:literal) => {
            /// Eight interleaved rows against `acts` (1 to 4 rows): `out[j][r]`.
            ///
            /// # Safety
            /// The CPU has the enabled features; `group` points to `blocks` group-blocks of
            /// `dtype` (a packable format); every activation row holds `blocks` blocks.
            #[target_feature(enable = $features)]
            pub unsafe fn $name(dtype: Format, group: *const u8, blocks: usize, acts: &[&ActQ8], out: &mut [[f32; GROUP]]) {
                // SAFETY: forwarded contract.
                unsafe {
                    match dtype {
                        Format::Q4_0 => rows::<$vnni, Q4_0>(group, blocks, acts, out),
                        Format::Q4_1 => rows::<$vnni, Q4_1>(group, blocks, acts, out),
                        Format::Q5_0 => rows::<$vnni, Q5_0>(group, blocks, acts, out),
                        Format::Q5_1 => rows::<$vnni, Q5_1>(group, blocks, acts, out),
                        Format::Q8_0 => rows::<$vnni, Q8_0>(group, blocks, acts, out),
                        Format::Iq4Nl => rows::<$vnni, IQ4_NL>(group, blocks, acts, out),
                        other => unreachable!("{other:?} is not held interleaved (packable() admits the others)"),
                    }
                }
            }
        };
    }
    group_fn!(group_avx2, false, "avx2,fma,f16c");
    group_fn!(group_vnni, true, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni");

    /// Dispatches on the batch size so that each size gets its own unrolled body.
    ///
    /// # Safety
    /// As [`group_avx2`].
    #[inline(always)]
    unsafe fn rows<const VNNI: bool, const F: u8>(group: *const u8, blocks: usize, acts: &[&ActQ8], out: &mut [[f32; GROUP]]) {
        // SAFETY: forwarded contract; each arm passes exactly its number of rows.
        unsafe {
            match acts.len() {
                1 => body::<VNNI, F, 1>(group, blocks, [acts[0]], out),
                2 => body::<VNNI, F, 2>(group, blocks, [acts[0], acts[1]], out),
                3 => body::<VNNI, F, 3>(group, blocks, [acts[0], acts[1], acts[2]], out),
                _ => body::<VNNI, F, 4>(group, blocks, [acts[0], acts[1], acts[2], acts[3]], out),
            }
        }
    }

    /// Four activation bytes `at..at+4` of a row, in every 32-bit lane.
    #[inline(always)]
    unsafe fn broadcast4(act: &ActQ8, at: usize) -> __m256i {
        // SAFETY: the caller keeps `at + 4` within `act.qs`; the load is unaligned.
        unsafe { _mm256_set1_epi32(act.qs.as_ptr().add(at).cast::<i32>().read_unaligned()) }
    }

    /// `acc + ` the i32 lane sums of the u8 x i8 products of `w` and `x` (four per lane): VNNI's
    /// `vpdpbusd`, or AVX2's `vpmaddubsw` + `vpmaddwd` (pairs of products never overflow i16:
    /// the values are at most 128 and the activations at most 127 in magnitude).
    #[inline(always)]
    unsafe fn dot_acc<const VNNI: bool>(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
        // SAFETY: the caller enables AVX2, and AVX-512 VNNI + VL when VNNI.
        unsafe {
            if VNNI {
                _mm256_dpbusd_epi32(acc, w, x)
            } else {
                _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
            }
        }
    }

    /// The lane-wise dot products of `R` activation rows with one group's eight rows.
    ///
    /// # Safety
    /// As [`group_avx2`], with `R` equal to the number of rows of `out`.
    #[inline(always)]
    unsafe fn body<const VNNI: bool, const F: u8, const R: usize>(
        group: *const u8,
        blocks: usize,
        acts: [&ActQ8; R],
        out: &mut [[f32; GROUP]],
    ) {
        let p = parts_of::<F>();
        let gbytes = p.group_bytes();
        // SAFETY (whole block): AVX2, FMA and F16C (and VNNI when asked) are enabled by every
        // caller; group-block b < blocks is in bounds of `group`, activation bytes
        // b * 32 + 4t + 4 <= blocks * 32 of every row (the caller's contract).
        unsafe {
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..blocks {
                let gb = group.add(b * gbytes);
                // PREFETCH_AHEAD bytes on, a block's lines a block (and one more, for a block
                // across two lines). A prefetch never faults: past the matrix it is wasted.
                for line in 0..gbytes.div_ceil(64) + 1 {
                    _mm_prefetch::<_MM_HINT_T0>(gb.wrapping_add(PREFETCH_AHEAD + 64 * line).cast());
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(gb.cast()));
                let c = match F {
                    Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
                    Q5_0 => _mm256_mul_ps(d, _mm256_set1_ps(-16.0)),
                    Q4_1 | Q5_1 => _mm256_cvtph_ps(_mm_loadu_si128(gb.add(p.group_m()).cast())),
                    _ => _mm256_setzero_ps(),
                };
                let qs = gb.add(p.group_qs());
                let x0 = b * QK;
                let mut isum = [_mm256_setzero_si256(); R];
                if F == Q8_0 {
                    for t in 0..8 {
                        let w = _mm256_loadu_si256(qs.add(32 * t).cast());
                        // u8 x i8 products: |w| against x carrying w's sign.
                        let magnitude = _mm256_sign_epi8(w, w);
                        for j in 0..R {
                            let x = _mm256_sign_epi8(broadcast4(acts[j], x0 + 4 * t), w);
                            isum[j] = dot_acc::<VNNI>(isum[j], magnitude, x);
                        }
                    }
                } else if F == IQ4_NL {
                    // The nibbles' levels are signed bytes: they multiply as Q8_0's do.
                    let (low, table) = (_mm256_set1_epi8(0x0F), levels());
                    for u in 0..4 {
                        let chunk = _mm256_loadu_si256(qs.add(32 * u).cast());
                        let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(chunk, low));
                        let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(chunk, 4), low));
                        for (w, at) in [(lo, x0 + 4 * u), (hi, x0 + 16 + 4 * u)] {
                            let magnitude = _mm256_sign_epi8(w, w);
                            for j in 0..R {
                                let x = _mm256_sign_epi8(broadcast4(acts[j], at), w);
                                isum[j] = dot_acc::<VNNI>(isum[j], magnitude, x);
                            }
                        }
                    }
                } else {
                    let low = _mm256_set1_epi8(0x0F);
                    let mut pairs = [_mm256_setzero_si256(); R];
                    for u in 0..4 {
                        let chunk = _mm256_loadu_si256(qs.add(32 * u).cast());
                        let mut lo = _mm256_and_si256(chunk, low);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16(chunk, 4), low);
                        if F == Q5_0 || F == Q5_1 {
                            let qh = gb.add(p.group_qh());
                            lo = _mm256_or_si256(lo, high_bits(qh.add(4 * u)));
                            hi = _mm256_or_si256(hi, high_bits(qh.add(4 * (u + 4))));
                        }
                        for j in 0..R {
                            let (xlo, xhi) = (broadcast4(acts[j], x0 + 4 * u), broadcast4(acts[j], x0 + 16 + 4 * u));
                            if VNNI {
                                isum[j] = _mm256_dpbusd_epi32(isum[j], lo, xlo);
                                isum[j] = _mm256_dpbusd_epi32(isum[j], hi, xhi);
                            } else {
                                pairs[j] = _mm256_add_epi16(pairs[j], _mm256_maddubs_epi16(lo, xlo));
                                pairs[j] = _mm256_add_epi16(pairs[j], _mm256_maddubs_epi16(hi, xhi));
                            }
                        }
                        // AVX2 widens the i16 pair sums to i32 before they can overflow: a pair
                        // is at most 2 * 15 * 127 (4-bit) or 2 * 31 * 127 (5-bit), so eight
                        // 4-bit pairs or four 5-bit ones fit in an i16.
                        let widen = if F == Q5_0 || F == Q5_1 { u % 2 == 1 } else { u == 3 };
                        if !VNNI && widen {
                            for j in 0..R {
                                isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(pairs[j], _mm256_set1_epi16(1)));
                                pairs[j] = _mm256_setzero_si256();
                            }
                        }
                    }
                }
                for j in 0..R {
                    let scale = _mm256_mul_ps(d, _mm256_set1_ps(*acts[j].d.get_unchecked(b)));
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), scale, acc[j]);
                    if F != Q8_0 && F != IQ4_NL {
                        acc[j] = _mm256_fmadd_ps(c, _mm256_set1_ps(*acts[j].s.get_unchecked(b)), acc[j]);
                    }
                }
            }
            for j in 0..R {
                _mm256_storeu_ps(out[j].as_mut_ptr(), acc[j]);
            }
        }
    }

    /// The group-block layout of format `F` (a kernels::x86 format constant).
    #[inline(always)]
    fn parts_of<const F: u8>() -> Parts {
        Parts::of(match F {
            Q4_0 => Format::Q4_0,
            Q4_1 => Format::Q4_1,
            Q5_0 => Format::Q5_0,
            Q5_1 => Format::Q5_1,
            IQ4_NL => Format::Iq4Nl,
            _ => Format::Q8_0,
        })
    }

    /// `P` pairs of consecutive groups (`P` = 1: sixteen rows; 2: four groups' 32 rows) against
    /// `rows` activation rows (1 to [`super::PAIR_ROWS`] for one pair, [`super::QUAD_ROWS`] for
    /// two) on 512-bit vectors: group g in lanes 0..8 and group g + 1 in lanes 8..16 of a
    /// pair's vector, each lane the same arithmetic as [`body`]'s; `next`'s bytes are asked for
    /// meanwhile (`super::pairs_dot`). `out` holds, row by row, each pair's sixteen lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW, VL and VNNI (and AVX2, FMA, F16C); `groups` points to `2 * P`
    /// consecutive groups of `blocks` group-blocks of `dtype` (a packable 32-value format);
    /// `acts` to `blocks` records of `rows` activation rows (`super::PairActs`); `out` has
    /// `rows * P * 2 * GROUP` values.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn pairs_vnni(dtype: Format, pairs: usize, groups: *const u8, blocks: usize, acts: *const u8, rows: usize, out: &mut [f32], next: &[u8]) {
        // SAFETY: forwarded contract.
        unsafe {
            match (dtype, pairs) {
                (Format::Q4_0, 1) => pair_rows::<Q4_0, 1>(groups, blocks, acts, rows, out, next),
                (Format::Q4_1, 1) => pair_rows::<Q4_1, 1>(groups, blocks, acts, rows, out, next),
                (Format::Q5_0, 1) => pair_rows::<Q5_0, 1>(groups, blocks, acts, rows, out, next),
                (Format::Q5_1, 1) => pair_rows::<Q5_1, 1>(groups, blocks, acts, rows, out, next),
                (Format::Q8_0, 1) => pair_rows::<Q8_0, 1>(groups, blocks, acts, rows, out, next),
                (Format::Iq4Nl, 1) => pair_rows::<IQ4_NL, 1>(groups, blocks, acts, rows, out, next),
                (Format::Q8_0, 2) => pair_rows::<Q8_0, 2>(groups, blocks, acts, rows, out, next),
                (other, pairs) => unreachable!("{other:?} is not held interleaved in 32-value groups {pairs} pairs at a time"),
            }
        }
    }

    /// `P` pairs: dispatches on the batch size, as [`rows`] (up to 8 rows for one pair, 6 for
    /// two).
    ///
    /// # Safety
    /// As [`pairs_vnni`].
    #[inline(always)]
    unsafe fn pair_rows<const F: u8, const P: usize>(groups: *const u8, blocks: usize, acts: *const u8, rows: usize, out: &mut [f32], next: &[u8]) {
        // SAFETY: forwarded contract; each arm is its number of rows.
        unsafe {
            match rows {
                1 => pair_body::<F, 1, P>(groups, blocks, acts, out, next),
                2 => pair_body::<F, 2, P>(groups, blocks, acts, out, next),
                3 => pair_body::<F, 3, P>(groups, blocks, acts, out, next),
                4 => pair_body::<F, 4, P>(groups, blocks, acts, out, next),
                5 => pair_body::<F, 5, P>(groups, blocks, acts, out, next),
                6 => pair_body::<F, 6, P>(groups, blocks, acts, out, next),
                7 if P == 1 => pair_body::<F, 7, 1>(groups, blocks, acts, out, next),
                _ if P == 1 => pair_body::<F, 8, 1>(groups, blocks, acts, out, next),
                _ => unreachable!("{rows} rows for {P} pairs"),
            }
        }
    }

    /// The lane-wise dot products of `R` activation rows with `P` pairs of groups. There is no
    /// `vpsignb` on 512-bit vectors, so Q8_0's values go in as `w + 128` (a u8, one xor
    /// shared by every activation row), IQ4_NL's as their levels plus 128 (one `vpshufb` of
    /// a biased table), and each block's integer sum starts at `-128 * sum(x)`: the same i32
    /// (the additions wrap, in any order), hence the same result, as [`body`]'s. With two
    /// pairs, each activation word broadcast feeds both: a thread issues two loads a cycle, and
    /// one pair at eight rows loads 98 times a Q8_0 block for its 64 `vpdpbusd` (a weight
    /// vector is two 256-bit halves), two pairs at six rows 96 times for 96.
    ///
    /// # Safety
    /// As [`pairs_vnni`], with `R` its `rows` and `P` its `pairs`.
    #[inline(always)]
    unsafe fn pair_body<const F: u8, const R: usize, const P: usize>(groups: *const u8, blocks: usize, acts: *const u8, out: &mut [f32], next: &[u8]) {
        let p = parts_of::<F>();
        let gbytes = p.group_bytes();
        // group g + 1's group-block b is one whole group after group g's, and the next pair's
        // two groups after that
        let second = blocks * gbytes;
        // a block's record (`PairActs`): R rows' 32 bytes, then R each of d, s and -128 * sums
        let record = super::PairActs::record(R);
        let (d_at, s_at, bias_at) = (QK * R, (QK + 4) * R, (QK + 8) * R);
        let share = prefetch_share(next, blocks);
        // SAFETY (whole block): AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C are enabled by the
        // caller; group-block b < blocks of each of the 2P groups is in bounds (`second` bytes
        // apart), and so is record b of the activations, whose offsets stay inside its
        // `record` bytes; `out` has R * P vectors.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); P]; R];
            // IQ4_NL's sixteen levels plus 128, in each 128-bit lane (`vpshufb` looks up within one)
            let biased_levels = if F == IQ4_NL {
                _mm512_broadcast_i32x4(_mm_loadu_si128(super::LEVELS.map(|l| (l as i16 + 128) as u8).as_ptr().cast()))
            } else {
                _mm512_setzero_si512()
            };
            for b in 0..blocks {
                for line in (b * share..((b + 1) * share).min(next.len())).step_by(64) {
                    // A prefetch reads nothing and cannot fault; SSE is part of x86-64.
                    _mm_prefetch::<_MM_HINT_NTA>(next.as_ptr().add(line).cast());
                }
                let x = acts.add(b * record);
                // (loops, not closures: see the note on the helpers below)
                let mut gb = [groups; P];
                let mut d = [_mm512_setzero_ps(); P];
                let mut c = [_mm512_setzero_ps(); P];
                for q in 0..P {
                    gb[q] = groups.add(2 * q * second + b * gbytes);
                    d[q] = both_f16(gb[q], second);
                    c[q] = match F {
                        Q4_0 => _mm512_mul_ps(d[q], _mm512_set1_ps(-8.0)),
                        Q5_0 => _mm512_mul_ps(d[q], _mm512_set1_ps(-16.0)),
                        Q4_1 | Q5_1 => both_f16(gb[q].add(p.group_m()), second),
                        _ => _mm512_setzero_ps(),
                    };
                }
                let mut isum = [[_mm512_setzero_si512(); P]; R];
                if F == Q8_0 || F == IQ4_NL {
                    for j in 0..R {
                        isum[j] = [broadcast4_512(x.add(bias_at + 4 * j)); P];
                    }
                }
                if F == Q8_0 {
                    let bias = _mm512_set1_epi8(-128);
                    for t in 0..8 {
                        let mut w = [bias; P];
                        for q in 0..P {
                            w[q] = _mm512_xor_si512(both(gb[q].add(p.group_qs() + 32 * t), second), bias);
                        }
                        for j in 0..R {
                            let a = broadcast4_512(x.add(QK * j + 4 * t));
                            for q in 0..P {
                                isum[j][q] = _mm512_dpbusd_epi32(isum[j][q], w[q], a);
                            }
                        }
                    }
                } else if F == IQ4_NL {
                    // The nibbles look up their levels plus 128 (u8), as Q8_0's values go in.
                    let low = _mm512_set1_epi8(0x0F);
                    for u in 0..4 {
                        let (mut lo, mut hi) = ([low; P], [low; P]);
                        for q in 0..P {
                            let chunk = both(gb[q].add(p.group_qs() + 32 * u), second);
                            lo[q] = _mm512_shuffle_epi8(biased_levels, _mm512_and_si512(chunk, low));
                            hi[q] = _mm512_shuffle_epi8(biased_levels, _mm512_and_si512(_mm512_srli_epi16::<4>(chunk), low));
                        }
                        dot_halves(&mut isum, &lo, &hi, x, u);
                    }
                } else {
                    let low = _mm512_set1_epi8(0x0F);
                    for u in 0..4 {
                        let (mut lo, mut hi) = ([low; P], [low; P]);
                        for q in 0..P {
                            let chunk = both(gb[q].add(p.group_qs() + 32 * u), second);
                            lo[q] = _mm512_and_si512(chunk, low);
                            hi[q] = _mm512_and_si512(_mm512_srli_epi16::<4>(chunk), low);
                            if F == Q5_0 || F == Q5_1 {
                                let qh = gb[q].add(p.group_qh());
                                lo[q] = _mm512_or_si512(lo[q], both_high_bits(qh.add(4 * u), second));
                                hi[q] = _mm512_or_si512(hi[q], both_high_bits(qh.add(4 * (u + 4)), second));
                            }
                        }
                        dot_halves(&mut isum, &lo, &hi, x, u);
                    }
                }
                for j in 0..R {
                    let da = _mm512_set1_ps(x.add(d_at + 4 * j).cast::<f32>().read_unaligned());
                    for q in 0..P {
                        acc[j][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j][q]), _mm512_mul_ps(d[q], da), acc[j][q]);
                        if F != Q8_0 && F != IQ4_NL {
                            acc[j][q] = _mm512_fmadd_ps(c[q], _mm512_set1_ps(x.add(s_at + 4 * j).cast::<f32>().read_unaligned()), acc[j][q]);
                        }
                    }
                }
            }
            for j in 0..R {
                for q in 0..P {
                    _mm512_storeu_ps(out.as_mut_ptr().add((j * P + q) * 2 * GROUP), acc[j][q]);
                }
            }
        }
    }

    /// A 4-bit chunk's products: `lo` (values 4u..4u+4 of each row) and `hi` (16+4u..16+4u+4)
    /// of each pair with the activation rows' matching words, added into `isum`.
    ///
    /// # Safety
    /// AVX-512 F and VNNI are enabled by the caller; `x` is a `PairActs` record of `R` rows.
    #[inline(always)]
    unsafe fn dot_halves<const R: usize, const P: usize>(isum: &mut [[__m512i; P]; R], lo: &[__m512i; P], hi: &[__m512i; P], x: *const u8, u: usize) {
        // SAFETY: as the caller promises: row j's 32 values are at QK * j of the record.
        unsafe {
            for j in 0..R {
                let (a_lo, a_hi) = (broadcast4_512(x.add(QK * j + 4 * u)), broadcast4_512(x.add(QK * j + 16 + 4 * u)));
                for q in 0..P {
                    isum[j][q] = _mm512_dpbusd_epi32(isum[j][q], lo[q], a_lo);
                    isum[j][q] = _mm512_dpbusd_epi32(isum[j][q], hi[q], a_hi);
                }
            }
        }
    }

    // The helpers of `pair_body` are functions, not closures: a closure in an `#[inline(always)]`
    // body is compiled without its caller's target features, and one (the fifth bits) was
    // called, not inlined, which made Q5_0 ten times slower.

    /// Bytes of `next` a block asks for, whole cache lines: an equal share of it over `blocks`.
    #[inline(always)]
    fn prefetch_share(next: &[u8], blocks: usize) -> usize {
        next.len().div_ceil(64 * blocks) * 64
    }

    /// 32 bytes at `at` (lanes 0..8) and at `at + second` (lanes 8..16).
    ///
    /// # Safety
    /// AVX-512 F is enabled by the caller; 32 readable bytes at both places.
    #[inline(always)]
    unsafe fn both(at: *const u8, second: usize) -> __m512i {
        // SAFETY: as the caller promises; unaligned loads.
        unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(at.cast())), _mm256_loadu_si256(at.add(second).cast())) }
    }

    /// Eight f16 at `at` (lanes 0..8) and at `at + second` (lanes 8..16), widened.
    ///
    /// # Safety
    /// AVX-512 F and AVX2 are enabled by the caller; 16 readable bytes at both places.
    #[inline(always)]
    unsafe fn both_f16(at: *const u8, second: usize) -> __m512 {
        // SAFETY: as the caller promises; unaligned loads.
        unsafe { _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(_mm_loadu_si128(at.cast())), _mm_loadu_si128(at.add(second).cast()))) }
    }

    /// [`high_bits`] of the words at `at` (lanes 0..8) and `at + second` (lanes 8..16).
    ///
    /// # Safety
    /// AVX-512 F and AVX2 are enabled by the caller; 4 readable bytes at both places.
    #[inline(always)]
    unsafe fn both_high_bits(at: *const u8, second: usize) -> __m512i {
        // SAFETY: as the caller promises.
        unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(high_bits(at)), high_bits(at.add(second))) }
    }

    /// The four bytes at `at` (activation values or a number of a `PairActs` record), in every
    /// 32-bit lane of a 512-bit vector.
    ///
    /// # Safety
    /// AVX-512 F is enabled by the caller; four readable bytes at `at`.
    #[inline(always)]
    unsafe fn broadcast4_512(at: *const u8) -> __m512i {
        // SAFETY: as the caller promises; the load is unaligned.
        unsafe { _mm512_set1_epi32(at.cast::<i32>().read_unaligned()) }
    }

}

#[cfg(test)]
pub(super) mod tests {
    use super::super::formats::dequantize;
    use super::*;
    use crate::test_values::{assert_within_activation_rounding, blocks, values};

    const FORMATS: [Format; 6] = [Format::Q4_0, Format::Q4_1, Format::Q5_0, Format::Q5_1, Format::Q8_0, Format::Iq4Nl];

    /// Packing `[rows, cols]` of `dtype` keeps the size and rearranges a whole group, and
    /// `unpack` and `row` give GGML's bytes back, for row counts around the group size.
    pub(in crate::quant) fn check_packing(dtype: Format, cols: usize, seed: u64) {
        for rows in [1, 7, 8, 9, 16, 21] {
            let bytes = blocks(dtype, rows, cols, seed + rows as u64);
            let packed = pack(dtype, rows, cols, &bytes);
            assert_eq!(packed.len(), bytes.len());
            if rows >= GROUP {
                assert_ne!(packed, bytes, "{dtype:?}: a whole group is rearranged");
            }
            assert_eq!(unpack(dtype, rows, cols, &packed), bytes, "{dtype:?} rows {rows}");
            let rb = row_bytes(dtype, cols);
            for r in 0..rows {
                assert_eq!(row(dtype, rows, cols, &packed, r), bytes[r * rb..(r + 1) * rb], "{dtype:?} rows {rows} row {r}");
            }
        }
    }

    #[test]
    fn packing_keeps_the_size_and_unpacks_to_the_same_rows() {
        for dtype in FORMATS {
            check_packing(dtype, 96, 0);
        }
    }

    /// Runs `check` on every path this CPU has (the portable one among them) and says which ran.
    pub(in crate::quant) fn on_every_path(what: &str, check: impl Fn(Path)) {
        let ran: Vec<Path> = Path::ALL.into_iter().filter(|p| p.available()).collect();
        assert!(ran.contains(&Path::Portable));
        for &path in &ran {
            check(path);
        }
        eprintln!("{what} paths tested on this CPU: {ran:?}");
    }

    /// The x8 product of `bytes` (`[n, k]` of `dtype`) with `x` (`[m, k]`) on `path`, checked
    /// element by element: a grouped row equals the portable reference bit for bit, `more(at,
    /// i, j, got, reference, tail)` adds the caller's checks (`tail`: a row past the last whole
    /// group, in row layout), a row's result is the same alone as in its batch, and it is within
    /// the activation rounding of the dequantized product.
    pub(in crate::quant) fn check_products(
        dtype: Format,
        path: Path,
        (m, k, n): (usize, usize, usize),
        bytes: &[u8],
        x: &[f32],
        at: &str,
        more: impl Fn(&str, usize, usize, f32, f32, bool),
    ) {
        let packed = pack(dtype, n, k, bytes);
        let mut wd = vec![0f32; n * k];
        dequantize(dtype, bytes, &mut wd);
        let got = matmul(x, m, k, dtype, &packed, n, path);
        let reference = matmul(x, m, k, dtype, &packed, n, Path::Portable);
        for i in 0..m {
            let xi = &x[i * k..(i + 1) * k];
            let alone = matmul(xi, 1, k, dtype, &packed, n, path);
            for j in 0..n {
                let (g, want) = (got[i * n + j], reference[i * n + j]);
                let at = format!("{at} [{i},{j}]");
                let tail = j >= n / GROUP * GROUP;
                if !tail {
                    assert_eq!(g.to_bits(), want.to_bits(), "{at}: {g} vs reference {want}");
                }
                more(&at, i, j, g, want, tail);
                assert_eq!(g.to_bits(), alone[j].to_bits(), "{at}: batch {g} vs alone {}", alone[j]);
                assert_within_activation_rounding(g, &wd[j * k..(j + 1) * k], xi, &at);
            }
        }
    }

    /// Every path this CPU has equals the scalar reference bit for bit on the grouped rows, on
    /// every format and batch size (tail rows: to rounding); the reference is within activation rounding of the dequantized product; and
    /// a row's result is the same alone or in a batch. Past eight rows Q8_0 takes two pairs at
    /// once (13 rows of 4 groups: passes of 6, 6 and 1; 10 rows of 6 groups: two pairs, then
    /// one; 11 rows of 3 groups: a pair in batches of 6, then one group). The last shape is a batch large enough to be quantized in parallel, with a group
    /// left over from the pairs.
    #[test]
    fn every_path_equals_the_reference_and_the_dequantized_product() {
        on_every_path("interleaved kernel", |path| {
            for dtype in FORMATS {
                for &(m, k, n) in &[(1, 32, 8), (1, 576, 37), (3, 96, 16), (4, 64, 24), (6, 160, 19), (7, 64, 40), (9, 1536, 8), (13, 96, 32), (10, 64, 48), (11, 64, 24), (70, 1024, 40)] {
                    let bytes = blocks(dtype, n, k, (m * k + n) as u64);
                    let x = values(m * k, 7 + k as u64);
                    let at = format!("{path:?} {dtype:?} m{m} k{k} n{n}");
                    check_products(dtype, path, (m, k, n), &bytes, &x, &at, |at, _, _, g, want, tail| {
                        if tail {
                            // a tail row, in row layout: the row kernels' own order
                            assert!((g - want).abs() <= 1e-4 * (1.0 + want.abs()), "{at}: {g} vs reference {want}");
                        }
                    });
                }
            }
        });
    }
}
