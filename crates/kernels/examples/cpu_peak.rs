//! The arithmetic ceilings of this CPU's vector units, which bound a batched step once
//! its weights stop being the bound: fused multiply-adds of f32 (`vfmadd231ps`, 8 multiply-adds
//! each) and the two integer multiplies of the AVX2 8-bit products (`vpmaddubsw`, 32 u8 x i8
//! products summed in pairs; `vpmaddwd`, 16 i16 products summed in pairs). Each loop runs ten
//! independent chains of one instruction, enough to cover its latency, on one thread and then on
//! every thread of the pool at once, and a loop of both integer multiplies side by side (which
//! runs no faster than either alone where they share a pipe). It prints instructions per second
//! per thread and what they make for all threads: GFLOP/s of f32, and 8-bit products per second
//! when each 32 take one `vpmaddubsw` and one `vpmaddwd` (the AVX2 Q8_0 products of
//! `quant::interleaved`). Where the CPU has AVX-512, the 512-bit ceilings follow: `vfmadd231ps`,
//! VNNI's `vpdpbusd` (64 8-bit products, the pair body of `quant::interleaved`) and avx512_bf16's
//! `vdpbf16ps` (the bf16 pair products of `panels`), each where the CPU has it.
//! A figure, not a test.
//!
//!     cargo run --release -p tpserve-kernels --example cpu_peak

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Instructions each thread runs per loop.
    pub const COUNT: u64 = 400_000_000;

    /// Ten chains of `$step` (`$c` the chain, `$a` the operand), `COUNT / 10` steps each;
    /// returns a value that depends on every chain, so that none is optimised away.
    macro_rules! chains {
        ($name:ident, $feature:literal, |$i:ident| $init:expr, $operand:expr, |$c:ident, $a:ident| $step:expr, |$f:ident| $fold:expr) => {
            /// # Safety
            /// The CPU has the features enabled here.
            #[target_feature(enable = $feature)]
            pub unsafe fn $name() -> i64 {
                let $a = $operand;
                let mut chains = [0; 10].map(|_| $a);
                for ($i, chain) in chains.iter_mut().enumerate() {
                    *chain = $init;
                }
                let [mut c0, mut c1, mut c2, mut c3, mut c4, mut c5, mut c6, mut c7, mut c8, mut c9] = chains;
                for _ in 0..COUNT / 10 {
                    for $c in [&mut c0, &mut c1, &mut c2, &mut c3, &mut c4, &mut c5, &mut c6, &mut c7, &mut c8, &mut c9] {
                        *$c = $step;
                    }
                }
                [c0, c1, c2, c3, c4, c5, c6, c7, c8, c9].into_iter().map(|$f| $fold).sum()
            }
        };
    }

    chains!(fma, "avx2,fma", |i| _mm256_set1_ps(i as f32 * 1e-3), _mm256_set1_ps(0.999), |c, a| _mm256_fmadd_ps(*c, a, a), |c| _mm256_cvtss_f32(c) as i64);
    chains!(maddubs, "avx2", |i| _mm256_set1_epi8(i as i8), _mm256_set1_epi8(3), |c, a| _mm256_maddubs_epi16(*c, a), |c| _mm256_extract_epi32::<0>(c) as i64);
    chains!(madd, "avx2", |i| _mm256_set1_epi16(i as i16), _mm256_set1_epi16(3), |c, a| _mm256_madd_epi16(*c, a), |c| _mm256_extract_epi32::<0>(c) as i64);

    // The 512-bit ceilings where the CPU has AVX-512: f32 FMAs, VNNI's 8-bit products (64 u8 x i8
    // products summed in fours, `quant::interleaved`'s pair body) and avx512_bf16's pair products
    // (32 bf16 pairs, `panels::Products::Bf16`).
    chains!(fma512, "avx512f", |i| _mm512_set1_ps(i as f32 * 1e-3), _mm512_set1_ps(0.999), |c, a| _mm512_fmadd_ps(*c, a, a), |c| _mm512_reduce_add_ps(c) as i64);
    chains!(dpbusd512, "avx512f,avx512vnni", |i| _mm512_set1_epi32(i as i32), _mm512_set1_epi8(3), |c, a| _mm512_dpbusd_epi32(*c, a, a), |c| _mm512_reduce_add_epi32(c) as i64);
    chains!(dpbf16512, "avx512f,avx512bf16", |i| _mm512_set1_ps(i as f32 * 1e-3), _mm512_castsi512_ps(_mm512_set1_epi16(0x3f80)), |c, a| {
        // SAFETY: __m512 and __m512bh are both 64 bytes of plain bits.
        let pairs = unsafe { std::mem::transmute::<__m512, __m512bh>(a) };
        _mm512_dpbf16_ps(*c, pairs, pairs)
    }, |c| _mm512_reduce_add_ps(c) as i64);

    /// Five chains of `vpmaddubsw` beside five of `vpmaddwd`: as fast as either alone where the
    /// two share one pipe, twice as fast where they do not.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn mixed() -> i64 {
        let a = _mm256_set1_epi8(3);
        let mut bytes = [1, 2, 3, 4, 5].map(|i| _mm256_set1_epi8(i));
        let mut words = [1, 2, 3, 4, 5].map(|i| _mm256_set1_epi16(i));
        for _ in 0..COUNT / 10 {
            for (b, w) in bytes.iter_mut().zip(words.iter_mut()) {
                *b = _mm256_maddubs_epi16(*b, a);
                *w = _mm256_madd_epi16(*w, a);
            }
        }
        bytes.into_iter().chain(words).map(|c| _mm256_extract_epi32::<0>(c) as i64).sum()
    }

    /// Four chains each of `vpmaddubsw` and `vpmaddwd` (the 8-bit product's pair) beside
    /// `FMAS` chains of `vfmadd231ps`: whether f32 multiply-adds issue beside the integer
    /// multiplies (on a second pipe) or take their slots. `COUNT` integer multiplies in all.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn int_and_fma<const FMAS: usize>() -> i64 {
        let a = _mm256_set1_epi8(3);
        let f = _mm256_set1_ps(0.999);
        let mut bytes = [1, 2, 3, 4].map(|i| _mm256_set1_epi8(i));
        let mut words = [1, 2, 3, 4].map(|i| _mm256_set1_epi16(i));
        let mut floats = [0; FMAS].map(|_| f);
        for (i, x) in floats.iter_mut().enumerate() {
            *x = _mm256_set1_ps(i as f32 * 1e-3);
        }
        for _ in 0..COUNT / 8 {
            for (b, w) in bytes.iter_mut().zip(words.iter_mut()) {
                *b = _mm256_maddubs_epi16(*b, a);
                *w = _mm256_madd_epi16(*w, a);
            }
            for x in floats.iter_mut() {
                *x = _mm256_fmadd_ps(*x, f, f);
            }
        }
        let floats: i64 = floats.into_iter().map(|c| _mm256_cvtss_f32(c) as i64).sum();
        bytes.into_iter().chain(words).map(|c| _mm256_extract_epi32::<0>(c) as i64).sum::<i64>() + floats
    }
}

#[cfg(target_arch = "x86_64")]
fn main() {
    use std::time::Instant;

    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
        println!("this CPU has no AVX2 and FMA: nothing to measure");
        return;
    }
    let threads = rayon::current_num_threads();
    // Instructions per second per thread of `f` on `n` threads at once.
    let rate = |f: unsafe fn() -> i64, n: usize| {
        let started = Instant::now();
        let sink: i64 = (0..n)
            .map(|_| {
                std::thread::spawn(move || {
                    // SAFETY: AVX2 and FMA were detected above, and each 512-bit loop runs only
                    // where its features were.
                    unsafe { f() }
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("a measuring thread"))
            .sum();
        std::hint::black_box(sink);
        x86::COUNT as f64 / started.elapsed().as_secs_f64()
    };
    println!("256-bit arithmetic ceilings, 1 and {threads} threads (giga-instructions a second per thread):");
    let mut all = [0f64; 4];
    let loops = [("vfmadd231ps", x86::fma as unsafe fn() -> i64), ("vpmaddubsw", x86::maddubs), ("vpmaddwd", x86::madd), ("both, mixed", x86::mixed)];
    for (i, (name, f)) in loops.into_iter().enumerate() {
        let (one, every) = (rate(f, 1), rate(f, threads));
        all[i] = every * threads as f64;
        println!("  {name:>12}: {:.2} alone, {:.2} each of {threads}", one / 1e9, every / 1e9);
    }
    println!("f32 FMA: {:.0} GFLOP/s on {threads} threads", all[0] * 16.0 / 1e9);
    // Each 32 products take one vpmaddubsw and one vpmaddwd: half the mixed loop's rate.
    println!("8-bit products (a vpmaddubsw and a vpmaddwd per 32): {:.0} G/s on {threads} threads", all[3] / 2.0 * 32.0 / 1e9);
    // The integer pair beside FMAs: where they issue on another pipe, the integer rate holds
    // and the FMAs come on top (a Q8_0 batch could give some rows to f32 FMAs over the same
    // 8-bit values, whose sums of 32 products f32 holds exactly).
    // (name, whether the CPU has it, results an instruction, what they are, the loop)
    let wide = [
        ("vfmadd231ps", true, 32.0, "f32 FLOP", x86::fma512 as unsafe fn() -> i64),
        ("vpdpbusd", is_x86_feature_detected!("avx512vnni"), 64.0, "8-bit products", x86::dpbusd512),
        ("vdpbf16ps", is_x86_feature_detected!("avx512bf16"), 64.0, "bf16 FLOP", x86::dpbf16512),
    ];
    if is_x86_feature_detected!("avx512f") {
        println!("512-bit arithmetic ceilings, 1 and {threads} threads (giga-instructions a second per thread):");
        for (name, present, per, unit, f) in wide {
            if present {
                let (one, every) = (rate(f, 1), rate(f, threads));
                println!("  {name:>12}: {:.2} alone, {:.2} each of {threads}: {:.0} G {unit} a second on {threads} threads", one / 1e9, every / 1e9, every * threads as f64 * per / 1e9);
            }
        }
    }
    println!("integer multiplies beside FMAs, {threads} threads (giga-instructions a second per thread):");
    let mixes = [(0, x86::int_and_fma::<0> as unsafe fn() -> i64), (4, x86::int_and_fma::<4>), (8, x86::int_and_fma::<8>)];
    for (fmas, f) in mixes {
        let every = rate(f, threads);
        let fma_rate = every * fmas as f64 / 8.0;
        println!(
            "  8 integer + {fmas} FMA a round: {:.2} integer, {:.2} FMA each; 8-bit products {:.0} G/s + f32 multiply-adds {:.0} G/s",
            every / 1e9,
            fma_rate / 1e9,
            every * threads as f64 / 2.0 * 32.0 / 1e9,
            fma_rate * threads as f64 * 8.0 / 1e9
        );
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("cpu_peak measures x86-64 vector instructions only");
}
