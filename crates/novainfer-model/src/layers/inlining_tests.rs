//! The SIMD kernels' intrinsics are inlined, not called: checked on this very test binary.
//!
//! An intrinsic such as `_mm512_fmadd_ps` is an ordinary function with a target feature;
//! it inlines only into code compiled with that feature. Code that loses the feature (a
//! closure inside a `#[target_feature]` function's callee, for example) still compiles and
//! still gives the right bits, but each intrinsic becomes a call with its vectors passed
//! through memory: the AVX-512 attention kernel ran 20x slower than AVX2 that way, and
//! every bit-exactness test passed. So the optimised test binary's symbol table must hold
//! no out-of-line AVX-512 intrinsic (AVX2 ones would inline anyway: the crate's baseline,
//! x86-64-v3, has AVX2). Only meaningful with optimisations on, as `scripts/test` runs.

use std::path::Path;

/// Out-of-line intrinsics that are not ours: candle's bf16 dot product converts with
/// `_mm256_cvtpbh_ps` from a function without the AVX512-BF16 feature.
const NOT_OURS: &[&str] = &["avx512bf16"];

/// The names of the function symbols in the ELF64 file at `path` (little-endian x86-64).
fn function_symbols(path: &Path) -> Vec<String> {
    let elf = std::fs::read(path).expect("read the test binary");
    let u16_at = |at: usize| u16::from_le_bytes([elf[at], elf[at + 1]]) as usize;
    let u32_at =
        |at: usize| u32::from_le_bytes(elf[at..at + 4].try_into().expect("4 bytes")) as usize;
    let u64_at =
        |at: usize| u64::from_le_bytes(elf[at..at + 8].try_into().expect("8 bytes")) as usize;
    assert_eq!(&elf[..5], b"\x7fELF\x02", "an ELF64 file");
    let (shoff, shentsize, shnum) = (u64_at(0x28), u16_at(0x3a), u16_at(0x3c));
    let section = |i: usize| shoff + i * shentsize;
    let mut names = Vec::new();
    for i in 0..shnum {
        let sh = section(i);
        const SHT_SYMTAB: usize = 2;
        if u32_at(sh + 4) != SHT_SYMTAB {
            continue;
        }
        let (off, size, entsize) = (u64_at(sh + 24), u64_at(sh + 32), u64_at(sh + 56));
        let strtab = u64_at(section(u32_at(sh + 40)) + 24);
        for sym in (off..off + size).step_by(entsize) {
            const STT_FUNC: u8 = 2;
            if elf[sym + 4] & 0xf != STT_FUNC {
                continue;
            }
            let name = &elf[strtab + u32_at(sym)..];
            let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
            names.push(String::from_utf8_lossy(&name[..end]).into_owned());
        }
    }
    names
}

/// A function that stays out of line, so the test can tell a symbol table it read from one it
/// missed. (The test function itself is no such witness: the optimiser may inline it into the
/// harness, and did once the crate's code-generation units shifted.)
#[inline(never)]
fn symbol_table_witness(x: usize) -> usize {
    std::hint::black_box(x) + 1
}

#[test]
fn no_avx512_intrinsic_is_compiled_out_of_line() {
    let exe = std::env::current_exe().expect("the test binary's path");
    let symbols = function_symbols(&exe);
    assert_eq!(std::hint::black_box(symbol_table_witness)(1), 2);
    assert!(
        symbols.iter().any(|s| s.contains("symbol_table_witness")),
        "the symbol table was read (the witness function is in it)"
    );
    let called: Vec<&String> = symbols
        .iter()
        .filter(|s| s.contains("core_arch") && s.contains("avx512"))
        .filter(|s| !NOT_OURS.iter().any(|m| s.contains(m)))
        .collect();
    assert!(
        called.is_empty(),
        "AVX-512 intrinsics compiled as functions (called, not inlined: is an intrinsic \
         inside a closure?): {called:#?}"
    );
}
