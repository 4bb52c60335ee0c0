//! Without a GPU (or without the `cuda` feature) opening a device is a typed error whose
//! message starts "CUDA not available: " — never a panic.

use novainfer_cuda::{device_count, CudaError, GpuContext};

#[test]
fn opening_a_device_without_cuda_is_a_typed_error() {
    match GpuContext::new(0) {
        Ok(_) => println!("a CUDA device is present: nothing to check on this machine"),
        Err(e @ CudaError::NotAvailable(_)) => {
            let text = e.to_string();
            assert!(text.starts_with("CUDA not available: "), "{text}");
            println!("as expected: {text}");
            assert!(matches!(
                device_count(),
                Err(CudaError::NotAvailable(_)) | Ok(0)
            ));
        }
        Err(other) => panic!("expected NotAvailable, got {other}"),
    }
}

#[test]
fn a_missing_ordinal_is_not_available_either() {
    match GpuContext::new(1 << 20) {
        Ok(_) => panic!("no machine has a millionth GPU"),
        Err(CudaError::NotAvailable(why)) => assert!(!why.is_empty()),
        Err(other) => panic!("expected NotAvailable, got {other}"),
    }
}

/// A missing cuBLAS is a typed error naming it (cudarc itself would panic on first use).
#[cfg(feature = "cuda")]
#[test]
fn a_missing_cublas_is_named() {
    match novainfer_cuda::libs::probe_cublas() {
        Ok(()) => println!("cuBLAS is loadable here: nothing to check on this machine"),
        Err(CudaError::NotAvailable(why)) => {
            assert!(why.contains("libcublas"), "{why}");
            assert!(
                why.contains(novainfer_cuda::libs::CUDA_LIB_DIR_ENV),
                "{why}"
            );
        }
        Err(other) => panic!("expected NotAvailable, got {other}"),
    }
}
