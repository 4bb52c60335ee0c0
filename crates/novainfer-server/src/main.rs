//! The `novainfer-server` binary: parse arguments, serve until interrupted.

use clap::Parser;
use novainfer_server::{serve, ServeArgs};

fn main() -> anyhow::Result<()> {
    serve(ServeArgs::parse())?;
    Ok(())
}
