//! `suanli bench ...`

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCmd {}

pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {}
}
