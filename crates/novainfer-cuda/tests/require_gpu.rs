//! `NOVAINFER_REQUIRE_GPU=1` turns every GPU test's skip into a failure. Shown end to end:
//! this binary re-runs its own probe test in a child process with the variable set, and on
//! a machine without a usable GPU the child must fail (and say why), while the same test
//! passes (skips) in this process.

mod common;

use std::process::Command;

use novainfer_cuda::gpu_test::REQUIRE_GPU_ENV;

/// Opens the GPU the way every GPU test does. Without a GPU: a skip here, a failure in the
/// child below.
#[test]
fn probe_gpu_like_every_gpu_test() {
    let _gpu = common::gpu_or_skip("probe_gpu_like_every_gpu_test");
}

#[test]
fn require_gpu_turns_the_skip_into_a_failure() {
    if std::env::var_os("NOVAINFER_REQUIRE_GPU_CHILD").is_some() {
        return; // the child runs only the probe; never recurse
    }
    if common::gpu_opens() {
        println!("a GPU is usable here: the child would pass, nothing to show");
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let run = |require: Option<&str>| {
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--exact",
            "probe_gpu_like_every_gpu_test",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("NOVAINFER_REQUIRE_GPU_CHILD", "1");
        match require {
            Some(v) => cmd.env(REQUIRE_GPU_ENV, v),
            None => cmd.env_remove(REQUIRE_GPU_ENV),
        };
        let out = cmd.output().expect("the test binary runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let (ok, text) = run(Some("1"));
    assert!(
        !ok,
        "with {REQUIRE_GPU_ENV}=1 and no GPU the probe must fail:\n{text}"
    );
    assert!(
        text.contains(REQUIRE_GPU_ENV),
        "the failure must name the variable:\n{text}"
    );
    let (ok, text) = run(None);
    assert!(ok, "without {REQUIRE_GPU_ENV} the probe skips:\n{text}");
    assert!(text.contains("skipped: no CUDA device"), "{text}");
}
