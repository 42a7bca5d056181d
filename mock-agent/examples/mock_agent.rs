//! Runs the mock agent from the command line (`--state-dir D [--resume ID]`) for manual and tmux-driven checks.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use turnstile_mock_agent::{run, Args};

fn parse_args() -> Result<Args> {
    let mut state_dir = None;
    let mut resume = None;
    let mut argv = std::env::args().skip(1);
    while let Some(flag) = argv.next() {
        match flag.as_str() {
            "--state-dir" => {
                state_dir = Some(PathBuf::from(
                    argv.next().context("--state-dir needs a value")?,
                ))
            }
            "--resume" => resume = Some(argv.next().context("--resume needs a value")?),
            other => {
                bail!("unknown argument {other:?}; usage: mock_agent --state-dir D [--resume ID]")
            }
        }
    }
    Ok(Args {
        state_dir: state_dir.context("--state-dir is required")?,
        resume,
    })
}

fn main() -> Result<()> {
    let code = run(parse_args()?)?;
    std::process::exit(code);
}
