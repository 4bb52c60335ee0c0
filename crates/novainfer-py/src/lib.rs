//! `novainfer._native`: the Rust engine as a private Python extension module.
//!
//! The public API lives in `python/novainfer`; this module only converts types,
//! releases the GIL around engine work and maps errors (once, in [`errors`]).

mod engine;
mod errors;
mod sampling_params;
mod server;

use pyo3::prelude::*;

/// None when CUDA GPU `ordinal` can run a model here, else what is missing (driver, NVRTC,
/// cuBLAS, a GPU, or CUDA support in this build).
#[pyfunction]
#[pyo3(signature = (ordinal=0))]
fn cuda_unavailable_reason(py: Python<'_>, ordinal: usize) -> Option<String> {
    py.detach(|| novainfer_model::device::cuda_usable(ordinal).err())
}

/// This machine's memory read bandwidth in bytes per second, measured with the engine's CPU
/// thread pool (`RAYON_NUM_THREADS` threads) over a buffer of `mib` MiB, the fastest of `passes`
/// passes in each of the probe's two prefetch forms (`memory_bandwidth::read_bandwidth`).
#[pyfunction]
#[pyo3(signature = (mib=512, passes=5))]
fn read_bandwidth(py: Python<'_>, mib: usize, passes: usize) -> PyResult<f64> {
    if !(1..=1 << 16).contains(&mib) {
        return Err(errors::invalid(
            "mib",
            format!("read_bandwidth reads 1 to 65536 MiB, not {mib}"),
        ));
    }
    if passes == 0 {
        return Err(errors::invalid(
            "passes",
            "read_bandwidth needs at least one pass".into(),
        ));
    }
    let bw = py.detach(|| novainfer_model::memory_bandwidth::read_bandwidth(mib << 20, passes));
    Ok(bw.best_bytes_per_s)
}

/// The CPU kernel choices this process has made so far, one line each as logged (kernel
/// family and problem, the implementation chosen, how: by timing, forced or the only one).
#[pyfunction]
fn kernel_selections() -> Vec<String> {
    novainfer_model::kernel_select::selections()
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The engine's logs (warnings, and `debug` traces such as the draft policy's) reach Python
    // users who ask for them; `serve` sets this up either way.
    if std::env::var_os("RUST_LOG").is_some() {
        novainfer_server::init_tracing();
    }
    m.add_class::<sampling_params::PySamplingParams>()?;
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<engine::PyTokenStream>()?;
    m.add_function(wrap_pyfunction!(server::serve, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_unavailable_reason, m)?)?;
    m.add_function(wrap_pyfunction!(read_bandwidth, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_selections, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
