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

/// Run a binary's body: print the error chain on failure and map it to an exit code
/// (2 for bad input, 1 otherwise).
pub fn run_main(body: impl FnOnce() -> anyhow::Result<()>) -> ExitCode {
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            if is_input_error(&err) {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
