//! Secrets in configuration: values never printed, read from a variable or from the
//! file a `_FILE` variable names.

use crate::Error;

/// A value that must never be printed: its `Debug` says `[redacted]`.
pub type Secret = secrecy::SecretString;
pub use secrecy::ExposeSecret;

/// A secret given as a value (a flag or a variable).
pub fn parse_secret(raw: &str) -> Result<Secret, String> {
    Ok(Secret::from(raw.to_owned()))
}

/// A secret read from the file at `path`, as Kubernetes mounts a Secret: the whole
/// file less its trailing newline. The error names the file, never its content.
pub fn read_secret_file(path: &str) -> Result<Secret, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    Ok(Secret::from(text.trim_end_matches(['\n', '\r']).to_owned()))
}

/// The secret in the environment variable `name`, or in the file that `name`
/// followed by `_FILE` names; `Ok(None)` when neither is set. Both set is an error,
/// as is an unreadable file.
pub fn secret_from_env(name: &str) -> Result<Option<Secret>, Error> {
    secret_from(name, std::env::var(name).ok(), std::env::var(format!("{name}_FILE")).ok())
}

/// [`secret_from_env`] of the values the variable and its `_FILE` variant hold.
pub(crate) fn secret_from(name: &str, value: Option<String>, file: Option<String>) -> Result<Option<Secret>, Error> {
    let file_var = format!("{name}_FILE");
    match (value, file) {
        (Some(_), Some(_)) => Err(Error(format!("set {name} or {file_var}, not both"))),
        (Some(value), None) => Ok(Some(Secret::from(value))),
        (None, Some(path)) => read_secret_file(&path).map(Some).map_err(|e| Error(format!("{file_var}: {e}"))),
        (None, None) => Ok(None),
    }
}
