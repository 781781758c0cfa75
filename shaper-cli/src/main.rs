use clap::Parser as _;

fn main() {
    let cli = shaper_cli::cli::Cli::parse();
    if let Err(error) = shaper_cli::commands::run(cli) {
        let (code, line) = shaper_cli::error::report(&error);
        eprintln!("shaper: {line}");
        std::process::exit(code);
    }
}
