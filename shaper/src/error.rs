//! Exit codes: 2 for bad usage (the command line is wrong), 1 for runtime failures
//! (the system refused, or the state does not allow it).

use std::fmt;

#[derive(Debug)]
pub(crate) struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

#[derive(Debug)]
pub(crate) struct RuntimeError(pub String);

impl fmt::Display for RuntimeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RuntimeError {}

pub fn usage(message: impl Into<String>) -> anyhow::Error {
    UsageError(message.into()).into()
}

pub fn runtime(message: impl Into<String>) -> anyhow::Error {
    RuntimeError(message.into()).into()
}

pub(crate) const EXIT_RUNTIME: i32 = 1;
pub const EXIT_USAGE: i32 = 2;

/// The exit code and the one line to print for an error.
pub fn report(error: &anyhow::Error) -> (i32, String) {
    let code = if error.downcast_ref::<UsageError>().is_some() {
        EXIT_USAGE
    } else {
        EXIT_RUNTIME
    };
    let text = format!("{error:#}");
    (code, one_line(&text))
}

/// Collapses multi-line kernel messages (verifier logs) into one line for the user.
pub fn one_line(text: &str) -> String {
    let joined = text.split_whitespace().collect::<Vec<_>>().join(" ");
    // Verifier logs say what went wrong at their end: keep the head and the tail.
    if joined.len() > 1000 {
        let head = joined.char_indices().nth(300).map_or(0, |(i, _)| i);
        let tail = joined.char_indices().rev().nth(600).map_or(0, |(i, _)| i);
        format!("{} … {}", &joined[..head], &joined[tail..])
    } else {
        joined
    }
}
