//! The one place where Rust errors become Python exceptions.
//!
//! The exception classes are defined in plain Python (`novainfer.errors`) so
//! they carry docstrings and can be imported without the extension; here we
//! look them up by name.

use novainfer_core::ParamError;
use novainfer_engine::tokenizer::TokenizerError;
use novainfer_engine::EngineError;
use novainfer_model::ModelError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyType;

fn raise(class: &str, message: String, param: Option<&str>) -> PyErr {
    Python::attach(|py| {
        let class = py
            .import("novainfer.errors")
            .and_then(|m| m.getattr(class))
            .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
        match class {
            Ok(class) => match param {
                Some(param) => PyErr::from_type(class, (message, param.to_owned())),
                None => PyErr::from_type(class, (message,)),
            },
            Err(e) => PyRuntimeError::new_err(format!(
                "{message} (and novainfer.errors is unavailable: {e})"
            )),
        }
    })
}

pub fn param_error(e: ParamError) -> PyErr {
    raise("InvalidParameterError", e.to_string(), Some(e.param))
}

pub fn invalid(param: &str, message: String) -> PyErr {
    raise("InvalidParameterError", message, Some(param))
}

pub fn engine_error(e: EngineError) -> PyErr {
    let message = e.to_string();
    let param = e.param().map(str::to_owned);
    let class = match &e {
        EngineError::InvalidParameter(_)
        | EngineError::EmptyPrompt
        | EngineError::PromptTokenOutOfRange { .. }
        | EngineError::Ignored { .. }
        | EngineError::AdapterNotFound { .. }
        | EngineError::AdapterExists { .. }
        | EngineError::LoraDisabled => "InvalidParameterError",
        EngineError::PromptTooLong { .. } | EngineError::InputTooLong { .. } => {
            "PromptTooLongError"
        }
        EngineError::Model(ModelError::NotFound(_)) => "ModelNotFoundError",
        EngineError::Model(ModelError::InvalidDtype(_) | ModelError::InvalidDevice(_)) => {
            "InvalidParameterError"
        }
        EngineError::Model(ModelError::DeviceUnavailable { .. }) => "DeviceUnavailableError",
        EngineError::Model(ModelError::Unsupported { .. } | ModelError::Cuda(_)) => "EngineError",
        EngineError::Model(
            ModelError::Compute(_) | ModelError::ContextOverflow { .. } | ModelError::EmptyInput,
        )
        | EngineError::Model(ModelError::TokenOutOfRange { .. }) => "EngineError",
        EngineError::Model(_) => "ModelLoadError",
        EngineError::Tokenizer(TokenizerError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            "ModelNotFoundError"
        }
        EngineError::Tokenizer(_) => "TokenizerError",
        EngineError::ChatTemplate(_) | EngineError::NoChatTemplate => "ChatTemplateError",
        EngineError::EngineStopped | EngineError::Aborted | EngineError::StepFailed { .. } => {
            "EngineError"
        }
    };
    raise(class, message, param.as_deref())
}
