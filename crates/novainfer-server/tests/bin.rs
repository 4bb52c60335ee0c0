//! The standalone `novainfer-server` binary: argument parsing and demo-model lookup.

use std::process::Command;

fn server() -> Command {
    Command::new(env!("CARGO_BIN_EXE_novainfer-server"))
}

#[test]
fn help_lists_the_serving_options() {
    let out = server().arg("--help").output().expect("runs");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--model",
        "--served-model-name",
        "--max-queued-requests",
        "--api-key",
        "--kv-cache-bytes",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help:\n{help}");
    }
}

#[test]
fn an_unfetched_demo_model_says_how_to_fetch_it() {
    let home = std::env::temp_dir().join(format!("novainfer-bin-test-{}", std::process::id()));
    let out = server()
        .args(["--model", "qwen2.5-coder-1.5b", "--port", "0"])
        .env("NOVAINFER_HOME", &home)
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("novainfer fetch qwen2.5-coder-1.5b"), "{err}");
}

#[test]
fn bad_arguments_fail_with_usage() {
    let out = server()
        .args(["--port", "not-a-port"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
}
