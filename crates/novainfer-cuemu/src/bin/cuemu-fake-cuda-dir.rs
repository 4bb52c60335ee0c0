//! Prints the directory of the fake CUDA libraries (`libcuda.so.1` and cuBLAS over the
//! emulator), for LD_LIBRARY_PATH: `scripts/test` runs the CUDA tests against it.
fn main() {
    println!("{}", env!("CUEMU_FAKE_CUDA_DIR"));
}
