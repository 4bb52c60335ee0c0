//! `novainfer._native`: the Rust engine as a private Python extension module.
//!
//! The public API lives in `python/novainfer`; this module only converts types,
//! releases the GIL around engine work and maps errors (once, in [`errors`]).

mod engine;
mod errors;
mod sampling_params;
mod server;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<sampling_params::PySamplingParams>()?;
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<engine::PyTokenStream>()?;
    m.add_function(wrap_pyfunction!(server::serve, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
