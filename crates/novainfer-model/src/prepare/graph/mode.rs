//! Whether the CUDA executor replays decode steps from graphs.
//!
//! Graphs are opt-in until a GPU run has verified them (their tokens against the eager
//! path's, alone and in batches): the default is eager, `NOVAINFER_CUDA_GRAPHS=1` turns them
//! on, and `enforce_eager` (`--enforce-eager`, `LLM(enforce_eager=True)`) keeps them off
//! whatever the environment says. The CPU executor has no graphs and ignores the choice.

/// The environment variable that opts in to CUDA graphs.
pub const GRAPHS_ENV: &str = "NOVAINFER_CUDA_GRAPHS";

/// How the CUDA executor runs decode steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaGraphs {
    /// Every step launches its kernels one by one.
    #[default]
    Eager,
    /// Decode steps within the largest bucket replay a graph captured at start-up.
    Captured,
}

impl CudaGraphs {
    /// The mode for an engine: `enforce_eager` wins; otherwise `env` (the value of
    /// [`GRAPHS_ENV`], if set) opts in. A value that is neither on nor off is an error
    /// naming the variable, rather than a silent default.
    pub fn resolve(enforce_eager: bool, env: Option<&str>) -> Result<Self, String> {
        let wanted = match env.map(str::trim) {
            None | Some("") => false,
            Some(v) if ["1", "true", "on", "yes"].contains(&v.to_ascii_lowercase().as_str()) => {
                true
            }
            Some(v) if ["0", "false", "off", "no"].contains(&v.to_ascii_lowercase().as_str()) => {
                false
            }
            Some(v) => {
                return Err(format!(
                    "{GRAPHS_ENV}={v:?}: expected 1/true/on or 0/false/off"
                ))
            }
        };
        Ok(if wanted && !enforce_eager {
            Self::Captured
        } else {
            Self::Eager
        })
    }

    /// [`Self::resolve`] with this process's environment.
    pub fn from_env(enforce_eager: bool) -> Result<Self, String> {
        let env = std::env::var(GRAPHS_ENV).ok();
        Self::resolve(enforce_eager, env.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graphs_are_off_unless_asked_for() {
        assert_eq!(CudaGraphs::default(), CudaGraphs::Eager);
        assert_eq!(CudaGraphs::resolve(false, None), Ok(CudaGraphs::Eager));
        assert_eq!(CudaGraphs::resolve(false, Some("")), Ok(CudaGraphs::Eager));
        assert_eq!(CudaGraphs::resolve(false, Some("0")), Ok(CudaGraphs::Eager));
        assert_eq!(
            CudaGraphs::resolve(false, Some("1")),
            Ok(CudaGraphs::Captured)
        );
        assert_eq!(
            CudaGraphs::resolve(false, Some(" On ")),
            Ok(CudaGraphs::Captured)
        );
    }

    #[test]
    fn enforce_eager_wins_over_the_environment() {
        assert_eq!(CudaGraphs::resolve(true, Some("1")), Ok(CudaGraphs::Eager));
        assert_eq!(CudaGraphs::resolve(true, None), Ok(CudaGraphs::Eager));
    }

    #[test]
    fn a_garbled_value_is_an_error_naming_the_variable() {
        let e = CudaGraphs::resolve(false, Some("sometimes")).expect_err("garbled");
        assert!(e.contains(GRAPHS_ENV) && e.contains("sometimes"), "{e}");
        // Even with enforce_eager: a typo should not hide until the flag is dropped.
        assert!(CudaGraphs::resolve(true, Some("2")).is_err());
    }
}
