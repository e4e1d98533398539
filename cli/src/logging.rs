//! Log output of the long-running commands (`server`, `agent`, `dev`): stderr, filtered by
//! `SUANLI_LOG`, as text (ANSI colours only when stderr is a terminal) or as JSON lines.

use std::io::IsTerminal;
use std::sync::OnceLock;

/// `--log-format`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines; coloured only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields, spans).
    Json,
}

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Records the format chosen on the command line (once, in `main`).
pub fn set_format(f: LogFormat) {
    let _ = FORMAT.set(f);
}

/// Logs to stderr, filtered by `SUANLI_LOG` (default `default`), in the chosen format.
pub fn init(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SUANLI_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match FORMAT.get().copied().unwrap_or_default() {
        LogFormat::Text => b.with_ansi(std::io::stderr().is_terminal()).try_init(),
        LogFormat::Json => b.json().with_current_span(true).with_span_list(false).try_init(),
    };
}
