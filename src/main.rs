//! The `sdkit` command line.

mod cli;
mod progress;
mod serve;
mod sweep;
mod watch;

use clap::Parser;

fn main() {
    let args = cli::Cli::parse();
    // Warnings, and kernel tuning's progress (`--tune`: its first run can
    // spend a minute measuring before the first step).
    let filter = tracing_subscriber::EnvFilter::try_from_env("SDKIT_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("warn,sdkit_compute::backend::wgpu::tune=info")
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let code = match cli::main(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    };
    std::process::exit(code);
}
