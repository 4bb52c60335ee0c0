//! The rule GPU tests follow when no GPU can be opened, here and in downstream crates: skip
//! (print why, pass) on a developer's machine, but fail where a GPU was promised.
//!
//! A test that skips is green, so a GPU machine whose driver or libraries are broken would
//! otherwise report a fully passing suite that ran nothing. `scripts/gpu-test` and any CI job
//! with a GPU set [`REQUIRE_GPU_ENV`], which turns every such skip into a failure.

/// Set (to anything but `0` or nothing) to make GPU tests fail instead of skipping.
pub const REQUIRE_GPU_ENV: &str = "NOVAINFER_REQUIRE_GPU";

/// What a GPU test does when opening the device failed with "not available".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenUnavailable {
    Skip,
    Fail,
}

/// The decision for a given value of [`REQUIRE_GPU_ENV`] (`None` when unset). Any value but
/// `""` and `"0"` requires the GPU: a misspelt "true" must not quietly skip.
pub fn when_unavailable(require_gpu: Option<&str>) -> WhenUnavailable {
    match require_gpu.map(str::trim) {
        None | Some("") | Some("0") => WhenUnavailable::Skip,
        Some(_) => WhenUnavailable::Fail,
    }
}

/// [`when_unavailable`] for this process's environment.
pub fn when_unavailable_from_env() -> WhenUnavailable {
    when_unavailable(std::env::var(REQUIRE_GPU_ENV).ok().as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_unset_empty_or_zero_variable_skips() {
        assert_eq!(when_unavailable(None), WhenUnavailable::Skip);
        assert_eq!(when_unavailable(Some("")), WhenUnavailable::Skip);
        assert_eq!(when_unavailable(Some("0")), WhenUnavailable::Skip);
        for v in ["1", "true", "yes", " 1 "] {
            assert_eq!(when_unavailable(Some(v)), WhenUnavailable::Fail, "{v:?}");
        }
    }
}
