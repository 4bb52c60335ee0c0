//! Compiles the emulator runtime and every `kernels/*.cu` as C++ (see cuemu/cuemu.h). Each
//! kernel file goes into its own namespace, so two files' helpers of one name (each NVRTC
//! module has its own) cannot be merged by the linker; the `extern "C"` kernels keep their
//! names.
use std::{env, fs, path::PathBuf};

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let kernels = manifest
        .join("../../kernels")
        .canonicalize()
        .expect("kernels/ exists");
    let emu = manifest.join("cuemu");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets it"));
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed={}", emu.display());

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .include(&emu)
        .include(&kernels)
        .define("NOVAINFER_CUEMU", None)
        // CUDA's `__fmul_rn` and friends round each operation; nothing else may contract.
        .flag("-ffp-contract=off")
        // Kernels read shared bf16 arrays as 32-bit words, as CUDA allows.
        .flag("-fno-strict-aliasing")
        .opt_level(2)
        .warnings(false)
        .file(emu.join("runtime.cpp"));
    let mut names: Vec<_> = fs::read_dir(&kernels)
        .expect("kernels/ is readable")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    names.sort();
    for path in names {
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("a UTF-8 name");
        let wrapper = out.join(format!("kernel_{stem}.cpp"));
        let text = format!(
            "#include \"cuemu.h\"\nnamespace cuemu_{stem} {{\n#include \"{}\"\n}}\n",
            path.display()
        );
        fs::write(&wrapper, text).expect("OUT_DIR is writable");
        build.file(wrapper);
    }
    // The emulator's own test kernels (tests/emulator.rs).
    let selftest = out.join("kernel_selftest.cpp");
    let text = format!(
        "#include \"cuemu.h\"\nnamespace cuemu_selftest {{\n#include \"{}\"\n}}\n",
        emu.join("selftest.cu").display()
    );
    fs::write(&selftest, text).expect("OUT_DIR is writable");
    build.file(selftest);
    build.compile("cuemu");
}
