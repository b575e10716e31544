//! The `fenceline` binary: parses the command line and exits with the command's code
//! (docs/cli.md).

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    let cli = fenceline_cli::args::Cli::parse();
    std::process::ExitCode::from(fenceline_cli::run(cli).code())
}
