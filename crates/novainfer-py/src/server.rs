//! `serve(argv)`: the Rust HTTP server (`novainfer-server`) run in this process, with the
//! GIL released for its whole life, so `novainfer serve` and the `novainfer-server` script
//! are the same server as the standalone binary, with the same arguments.

use novainfer_server::{parse_args, serve as run_server, ServeError};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyType;

use crate::errors::{engine_error, invalid};

/// An exception of `novainfer.errors` by class name.
fn novainfer_error(py: Python<'_>, class: &str, message: String) -> PyErr {
    match py
        .import("novainfer.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from))
    {
        Ok(class) => PyErr::from_type(class, (message,)),
        Err(e) => PyRuntimeError::new_err(format!(
            "{message} (and novainfer.errors is unavailable: {e})"
        )),
    }
}

fn serve_error(py: Python<'_>, e: ServeError) -> PyErr {
    match e {
        ServeError::Load { source, .. } => engine_error(source),
        ServeError::Args(e) => invalid("argv", e.to_string()),
        ServeError::DuplicateName(_) => invalid("served_model_name", e.to_string()),
        ServeError::Resolve(e) => novainfer_error(py, "ModelNotFoundError", e.to_string()),
        ServeError::Bind { .. }
        | ServeError::Io(_)
        | ServeError::EngineFailed { .. }
        | ServeError::KvEvents(_) => novainfer_error(py, "NovaInferError", e.to_string()),
    }
}

/// Runs the server with `novainfer-server` arguments (without the program name) until
/// SIGINT/SIGTERM. `--help`/`--version` print and return; bad arguments raise
/// `InvalidParameterError` carrying clap's message.
#[pyfunction]
pub fn serve(py: Python<'_>, argv: Vec<String>) -> PyResult<()> {
    let args = match parse_args(argv) {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => {
            print!("{e}");
            return Ok(());
        }
        Err(e) => return Err(invalid("argv", e.to_string())),
    };
    // Boxed: the error crosses the detach boundary and is large.
    py.detach(|| run_server(args).map_err(Box::new))
        .map_err(|e| serve_error(py, *e))
}
