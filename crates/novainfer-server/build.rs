//! Rebuild when the Web UI's static files change: they are embedded with `include_dir!`.
fn main() {
    println!("cargo:rerun-if-changed=ui");
}
