//! Compiles the emulator and every `kernels/*.cu` as C++ (see cuemu/cuemu.h), into
//! - a static library the Rust tests link (they call kernels by their `extern "C"` names);
//! - a fake CUDA under `$OUT_DIR/fake-cuda` (`libcuda.so.1`, and `libcublas.so.13` +
//!   `libcublasLt.so.13` over it): the driver API on the emulator, for running the CUDA
//!   code paths themselves on the CPU (`cuemu-fake-cuda-dir` prints the directory).
//!
//! Each kernel file goes into its own namespace, so two files' helpers of one name (each
//! NVRTC module has its own) cannot be merged by the linker; the `extern "C"` kernels keep
//! their names and are registered by name for the fake driver's cuModuleGetFunction.
use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

fn base(emu: &Path, kernels: &Path) -> cc::Build {
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .include(emu)
        .include(kernels)
        .define("NOVAINFER_CUEMU", None)
        // CUDA's `__fmul_rn` and friends round each operation; nothing else may contract.
        .flag("-ffp-contract=off")
        // Kernels read shared bf16 arrays as 32-bit words, as CUDA allows.
        .flag("-fno-strict-aliasing")
        .opt_level(2)
        .warnings(false);
    build
}

/// The `extern "C"` kernels in a preprocessed kernel file (macros expanded, `__global__`
/// and `__launch_bounds__` gone).
fn kernel_names(preprocessed: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = preprocessed;
    while let Some(at) = rest.find("extern \"C\"") {
        rest = &rest[at + "extern \"C\"".len()..];
        let decl = rest.trim_start();
        let Some(after_void) = decl.strip_prefix("void") else {
            continue;
        };
        let name: String = after_void
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let tail = after_void.trim_start()[name.len()..].trim_start();
        if !name.is_empty() && tail.starts_with('(') && !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

fn link_shared(compiler: &cc::Tool, out: &Path, soname: &str, inputs: &[PathBuf], extra: &[&str]) {
    let mut cmd = Command::new(compiler.path());
    cmd.arg("-shared")
        .arg("-o")
        .arg(out.join(soname))
        .arg(format!("-Wl,-soname,{soname}"))
        .args(inputs)
        .args(extra);
    let status = cmd.status().expect("the C++ compiler runs");
    assert!(status.success(), "linking {soname} failed: {cmd:?}");
}

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

    let mut sources: Vec<(String, PathBuf)> = fs::read_dir(&kernels)
        .expect("kernels/ is readable")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .map(|p| {
            let stem = p
                .file_stem()
                .and_then(|s| s.to_str())
                .expect("a UTF-8 name");
            (stem.to_owned(), p.clone())
        })
        .collect();
    sources.sort();
    // The emulator's own test kernels (tests/emulator.rs).
    sources.push(("selftest".to_owned(), emu.join("selftest.cu")));

    let mut emulated = base(&emu, &kernels);
    emulated.file(emu.join("runtime.cpp"));
    for (stem, path) in &sources {
        let wrapper = out.join(format!("kernel_{stem}.cpp"));
        let head = format!(
            "#include \"cuemu.h\"\nnamespace cuemu_{stem} {{\n#include \"{}\"\n}}\n",
            path.display()
        );
        fs::write(&wrapper, &head).expect("OUT_DIR is writable");
        let expanded = base(&emu, &kernels).file(&wrapper).expand();
        let text = String::from_utf8_lossy(&expanded);
        let mut registered = head;
        registered.push_str("#include \"registry.h\"\n");
        for name in kernel_names(&text) {
            registered.push_str(&format!("CUEMU_REGISTER(cuemu_{stem}, {name});\n"));
        }
        fs::write(&wrapper, registered).expect("OUT_DIR is writable");
        emulated.file(wrapper);
    }
    let objects = emulated.compile_intermediates();

    // The static library for the Rust tests.
    let archive = out.join("libcuemu.a");
    let _ = fs::remove_file(&archive);
    let status = Command::new(emulated.get_archiver().get_program())
        .arg("crs")
        .arg(&archive)
        .args(&objects)
        .status()
        .expect("ar runs");
    assert!(status.success(), "ar failed");
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=cuemu");
    println!("cargo:rustc-link-lib=stdc++");

    // The fake CUDA libraries.
    let fake = out.join("fake-cuda");
    fs::create_dir_all(&fake).expect("OUT_DIR is writable");
    let compiler = emulated.get_compiler();
    let driver = base(&emu, &kernels)
        .file(emu.join("driver.cpp"))
        .compile_intermediates();
    let mut inputs = objects.clone();
    inputs.extend(driver);
    link_shared(&compiler, &fake, "libcuda.so.1", &inputs, &[]);
    let blas_source = emu.join("cublas.cpp");
    if blas_source.exists() {
        let blas = base(&emu, &kernels)
            .file(&blas_source)
            .compile_intermediates();
        let over_driver = [
            "-L",
            fake.to_str().expect("a UTF-8 path"),
            "-l:libcuda.so.1",
            "-Wl,-rpath,$ORIGIN",
        ];
        for soname in ["libcublasLt.so.13", "libcublas.so.13"] {
            link_shared(&compiler, &fake, soname, &blas, &over_driver);
        }
    }
    println!("cargo:rustc-env=CUEMU_FAKE_CUDA_DIR={}", fake.display());
}
