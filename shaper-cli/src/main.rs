//! The `shaper` command: argument definitions (`cli`), one small module per command that
//! turns arguments into calls of the `shaper` library (`commands`), and output.

mod class_args;
mod cli;
mod commands;
mod config_file;
#[cfg(test)]
mod doc_figures;
#[cfg(test)]
mod docs;
#[cfg(test)]
mod guards;
mod rows;

use clap::Parser as _;
use shaper::error::{report, EXIT_USAGE};

fn main() {
    // `shaper stats | head` should end quietly like any Unix tool, not panic on EPIPE.
    // SAFETY: resetting SIGPIPE to its default before any thread starts.
    let _ = unsafe {
        nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGPIPE,
            nix::sys::signal::SigHandler::SigDfl,
        )
    };
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) if !error.use_stderr() => error.exit(), // --help, --version
        Err(error) => {
            eprintln!("shaper: {}", one_line_clap_error(&error.to_string()));
            std::process::exit(EXIT_USAGE);
        }
    };
    let level = match cli.verbose {
        0 => log::LevelFilter::Info,
        1 => log::LevelFilter::Debug,
        _ => log::LevelFilter::Trace,
    };
    env_logger::Builder::new()
        .filter_level(level)
        .parse_default_env()
        .format_target(false)
        .init();
    if let Err(error) = commands::run(cli) {
        let (code, line) = report(&error);
        eprintln!("shaper: {line}");
        std::process::exit(code);
    }
}

/// clap's multi-line errors as one line: the message plus any hint, without the usage.
fn one_line_clap_error(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more information")
        })
        .map(|l| l.trim_start_matches("error: "))
        .collect::<Vec<_>>()
        .join(" ")
}
