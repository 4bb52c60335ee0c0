//! Where a model runs: the user's choice (`"auto"`, `"cpu"`, `"cuda"`, `"cuda:N"`) and the
//! device it resolves to.
//!
//! `auto` picks the first GPU when this build has CUDA and a usable GPU, driver and NVRTC are
//! present, else the CPU, and says why ([`Resolved::reason`]) so the choice can be logged. An
//! explicit `cuda` never falls back: a missing driver, library or GPU is
//! [`ModelError::DeviceUnavailable`] naming what is missing.

use std::fmt;
use std::str::FromStr;

use crate::error::{ModelError, Result};

/// A concrete device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DeviceChoice {
    /// CUDA when usable, else the CPU.
    #[default]
    Auto,
    Exactly(Device),
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Auto => f.write_str("auto"),
            DeviceChoice::Exactly(d) => d.fmt(f),
        }
    }
}

/// The spellings [`DeviceChoice`] accepts, for error messages.
pub const DEVICE_SPELLINGS: &str = "\"auto\", \"cpu\", \"cuda\" or \"cuda:N\"";

impl FromStr for DeviceChoice {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || ModelError::InvalidDevice(s.to_owned());
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Exactly(Device::Cpu)),
            "cuda" | "gpu" => Ok(Self::Exactly(Device::Cuda(0))),
            other => {
                let ordinal = other.strip_prefix("cuda:").ok_or_else(bad)?;
                // `parse` alone would accept "+1"; an ordinal is plain digits.
                if ordinal.is_empty() || !ordinal.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                ordinal
                    .parse()
                    .map(|i| Self::Exactly(Device::Cuda(i)))
                    .map_err(|_| bad())
            }
        }
    }
}

/// The outcome of [`resolve`]: the device, and in words why it was chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub device: Device,
    pub reason: String,
}

/// Whether CUDA device `ordinal` can be used here: `Err` says what is missing.
pub fn cuda_usable(ordinal: usize) -> std::result::Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::probe(ordinal)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err("this build of novainfer has no CUDA support (feature `cuda` off)".to_owned())
    }
}

/// Turns the user's choice into a device. `auto` never fails; an explicit CUDA device that
/// cannot be used is an error naming what is missing.
pub fn resolve(choice: DeviceChoice) -> Result<Resolved> {
    resolve_with(choice, cuda_usable)
}

/// [`resolve`] with the CUDA check given, so the policy is testable without a GPU.
pub fn resolve_with(
    choice: DeviceChoice,
    usable: impl Fn(usize) -> std::result::Result<(), String>,
) -> Result<Resolved> {
    match choice {
        DeviceChoice::Exactly(Device::Cpu) => Ok(Resolved {
            device: Device::Cpu,
            reason: "device=\"cpu\" was asked for".to_owned(),
        }),
        DeviceChoice::Exactly(Device::Cuda(i)) => match usable(i) {
            Ok(()) => Ok(Resolved {
                device: Device::Cuda(i),
                reason: format!("device=\"cuda:{i}\" was asked for"),
            }),
            Err(why) => Err(ModelError::DeviceUnavailable {
                device: Device::Cuda(i).to_string(),
                reason: why,
            }),
        },
        DeviceChoice::Auto => Ok(match usable(0) {
            Ok(()) => Resolved {
                device: Device::Cuda(0),
                reason: "device=\"auto\" found a usable CUDA GPU".to_owned(),
            },
            Err(why) => Resolved {
                device: Device::Cpu,
                reason: format!("device=\"auto\" runs on the CPU: {why}"),
            },
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_spelling() {
        let ok = [
            ("auto", DeviceChoice::Auto),
            ("cpu", DeviceChoice::Exactly(Device::Cpu)),
            ("CPU", DeviceChoice::Exactly(Device::Cpu)),
            ("cuda", DeviceChoice::Exactly(Device::Cuda(0))),
            ("cuda:0", DeviceChoice::Exactly(Device::Cuda(0))),
            ("cuda:3", DeviceChoice::Exactly(Device::Cuda(3))),
        ];
        for (s, want) in ok {
            assert_eq!(s.parse::<DeviceChoice>().expect(s), want, "{s}");
        }
        for bad in [
            "", "gpu:1", "cuda:", "cuda:-1", "cuda:+1", "cuda:x", "tpu", "cuda:0:1",
        ] {
            assert!(
                matches!(bad.parse::<DeviceChoice>(), Err(ModelError::InvalidDevice(s)) if s == bad),
                "{bad:?} must be refused"
            );
        }
    }

    #[test]
    fn display_round_trips() {
        for s in ["auto", "cpu", "cuda:0", "cuda:2"] {
            assert_eq!(s.parse::<DeviceChoice>().expect(s).to_string(), s);
        }
    }

    #[test]
    fn auto_falls_back_to_the_cpu_and_says_why() {
        let r = resolve_with(DeviceChoice::Auto, |_| Err("libcuda not found".into()))
            .expect("auto never fails");
        assert_eq!(r.device, Device::Cpu);
        assert!(r.reason.contains("libcuda not found"), "{}", r.reason);
        let r = resolve_with(DeviceChoice::Auto, |_| Ok(())).expect("auto");
        assert_eq!(r.device, Device::Cuda(0));
    }

    #[test]
    fn explicit_cuda_never_falls_back() {
        let err = resolve_with(DeviceChoice::Exactly(Device::Cuda(1)), |i| {
            Err(format!("only 1 device(s) present, cuda:{i} requested"))
        })
        .expect_err("no silent CPU run");
        let text = err.to_string();
        assert!(
            text.contains("cuda:1") && text.contains("only 1 device"),
            "{text}"
        );
    }

    #[test]
    fn explicit_cpu_never_probes_cuda() {
        let r = resolve_with(DeviceChoice::Exactly(Device::Cpu), |_| {
            panic!("probing CUDA for device=cpu")
        })
        .expect("cpu");
        assert_eq!(r.device, Device::Cpu);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_build_without_cuda_says_so() {
        let err = resolve(DeviceChoice::Exactly(Device::Cuda(0))).expect_err("no CUDA");
        assert!(err.to_string().contains("feature `cuda`"), "{err}");
    }
}
