//! `fenceline`: the command line for intake's task API (docs/intake.md) and the
//! reconciler's audit. Its commands, environment and exit codes are in docs/cli.md.

pub mod args;
pub mod client;
pub mod commands;
pub mod render;
pub mod terminal;
pub mod watch;

/// What the process exits with; scripts branch on these (docs/cli.md).
///
/// Do not change: scripts test these numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Done; for `watch`, the task succeeded (for `resolve --watch`, it reached the
    /// outcome chosen).
    Ok = 0,
    /// Anything else: an answer that could not be read, output that could not be written.
    Failed = 1,
    /// A bad command line or input, or a request intake refused as malformed (400, 413, 415, 422, 431).
    Usage = 2,
    /// No such task for this tenant (404).
    NotFound = 3,
    /// The request conflicts with what is recorded (409, such as a task already
    /// finished; an Idempotency-Key reused for another request).
    Conflict = 4,
    /// No token, or the token was refused (401, 403).
    Refused = 5,
    /// The service could not be reached or failed (5xx, connection refused, timed out).
    Unavailable = 6,
    /// A watched task ended without succeeding (failed, cancelled; after
    /// `resolve --watch`, in a state other than the one chosen) or waits for a
    /// person (awaiting_approval, outcome_unknown, needs_human).
    NotSucceeded = 7,
    /// `watch --timeout-s` ran out before the task ended; the task goes on.
    TimedOut = 8,
}

impl Exit {
    pub fn code(self) -> u8 {
        self as u8
    }
}

/// Why a command did not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Usage(String),
    /// What was asked cannot apply to the task as it is (it finished, say).
    #[error("{0}")]
    Conflict(String),
    #[error("no token: give --token-file or --token, or set FENCELINE_TOKEN_FILE or FENCELINE_TOKEN")]
    NoToken,
    #[error("{0}")]
    Problem(client::Problem),
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("unexpected answer: {0}")]
    BadAnswer(String),
    #[error("writing the output: {0}")]
    Output(#[from] std::io::Error),
    #[error("gave up watching after {0} s; the task goes on")]
    TimedOut(u64),
}

impl Error {
    /// The exit code that stands for this error.
    pub fn exit(&self) -> Exit {
        match self {
            Error::Usage(_) | Error::NoToken => Exit::Usage,
            Error::Conflict(_) => Exit::Conflict,
            Error::Problem(problem) => match (problem.status, problem.problem_type.as_deref()) {
                (_, Some("/problems/idempotency-key-reused")) | (409, _) => Exit::Conflict,
                (404, _) => Exit::NotFound,
                (401 | 403, _) => Exit::Refused,
                (400 | 413 | 415 | 422 | 431, _) => Exit::Usage,
                (500.., _) => Exit::Unavailable,
                _ => Exit::Failed,
            },
            Error::Unreachable { .. } => Exit::Unavailable,
            Error::BadAnswer(_) | Error::Output(_) => Exit::Failed,
            Error::TimedOut(_) => Exit::TimedOut,
        }
    }
}

/// Runs one command line, writing answers to stdout and messages to stderr.
pub fn run(cli: args::Cli) -> Exit {
    let mut out = std::io::stdout().lock();
    match commands::run(cli, &mut out) {
        Ok(exit) => exit,
        // `fenceline list | head`: the reader has what it wanted.
        Err(Error::Output(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => Exit::Ok,
        Err(e) => {
            eprintln!("fenceline: {e}");
            e.exit()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Problem;

    fn problem(status: u16, problem_type: &str) -> Error {
        Error::Problem(Problem { status, problem_type: Some(problem_type.to_owned()), title: "t".into(), detail: None })
    }

    #[test]
    fn each_kind_of_answer_has_its_exit_code() {
        assert_eq!(problem(404, "/problems/task-not-found").exit().code(), 3);
        assert_eq!(problem(409, "/problems/case-changed").exit().code(), 4);
        assert_eq!(problem(422, "/problems/idempotency-key-reused").exit().code(), 4);
        assert_eq!(problem(422, "/problems/unknown-kind").exit().code(), 2);
        assert_eq!(problem(400, "/problems/invalid-request").exit().code(), 2);
        assert_eq!(problem(401, "/problems/unauthorized").exit().code(), 5);
        assert_eq!(problem(500, "/problems/internal").exit().code(), 6);
        assert_eq!(problem(503, "x").exit().code(), 6);
        assert_eq!(Error::Unreachable { url: "u".into(), reason: "r".into() }.exit().code(), 6);
        assert_eq!(Error::NoToken.exit().code(), 2);
        assert_eq!(Error::TimedOut(3).exit().code(), 8);
    }
}
