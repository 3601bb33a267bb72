//! Error kinds and how a binary turns them into exit codes.
//!
//! Bad input (files, columns, flags, values) is an [`InputError`]: exit code 2, a message that
//! names the file, the column and the row. Anything else (a bug, an I/O failure while writing,
//! a device fault) exits with 1.

use std::fmt;
use std::process::ExitCode;

/// A problem with what the user gave us. The message says where (file, column, row) and,
/// where it can, what to do.
#[derive(Debug)]
pub(crate) struct InputError(pub String);

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InputError {}

/// Build an input error from a message.
pub(crate) fn input_error(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(InputError(msg.into()))
}

/// `bail_input!("{}: column 'x' is missing", path)` returns an [`InputError`].
#[macro_export]
macro_rules! bail_input {
    ($($arg:tt)*) => {
        return Err($crate::error::input_error(format!($($arg)*)))
    };
}

/// Whether an error (or anything in its chain) is bad input.
pub fn is_input_error(err: &anyhow::Error) -> bool {
    err.chain().any(|e| e.is::<InputError>())
}

/// Where a rank under `tandem launch` writes the failures it saw, one JSON line each
/// (suspect, reporter, reason, time; `exit` on the line of the error its `main` ended with);
/// the launcher names the rank at fault and prints its error last from these.
pub(crate) const ERROR_FILE_ENV: &str = "TANDEM_DIST_ERROR_FILE";

/// Appends a failure line to this rank's error file; false when there is none (not under
/// `tandem launch`) or it cannot be written.
pub(crate) fn append_rank_error(
    suspect: Option<usize>,
    reporter: usize,
    reason: &str,
    exit: bool,
) -> bool {
    use std::io::Write;
    let Some(path) = std::env::var_os(ERROR_FILE_ENV) else {
        return false;
    };
    let time = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let line = serde_json::json!({
        "suspect": suspect, "reporter": reporter, "reason": reason, "time": time, "exit": exit,
    });
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| writeln!(f, "{line}"))
        .is_ok()
}

/// Run a binary's body: print the error chain on failure and map it to an exit code
/// (2 for bad input, 1 otherwise). A rank under `tandem launch` writes the error to its error
/// file instead: the launcher prints it once, as its last line, with the rank at fault.
pub fn run_main(body: impl FnOnce() -> anyhow::Result<()>) -> ExitCode {
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let msg = format!("{err:#}");
            let rank = std::env::var("RANK").ok().and_then(|r| r.parse().ok());
            if !rank.is_some_and(|r| append_rank_error(Some(r), r, &msg, true)) {
                eprintln!("error: {msg}");
            }
            if is_input_error(&err) {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
