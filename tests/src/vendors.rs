//! The vendors' own artifacts as child processes on free ports, for the conformance
//! suite: Prism serving OpenAI's published OpenAPI description as a validating
//! proxy, and Stripe's stripe-mock. `deploy/local/stack test` installs both into the
//! cache and names them in `FENCELINE_PRISM` and `FENCELINE_STRIPE_MOCK`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::process::{Proc, free_port};

/// How long a tool may take to start on a busy machine (Prism reads a 3 MB description).
const START_LIMIT: Duration = Duration::from_secs(240);

/// The path of an installed tool named by `variable`; panics, saying how to install
/// it, when it is not there: a conformance test never passes without its tool.
fn tool(variable: &str, what: &str) -> String {
    let path = std::env::var(variable).unwrap_or_else(|_| {
        panic!(
            "{variable} is not set: {what} is installed into $FENCELINE_CACHE_DIR by `deploy/local/stack test` \
             (run the suites through it, once per machine), or set {variable} to an installed {what}"
        )
    });
    assert!(
        Path::new(&path).is_file(),
        "{variable}={path}: no {what} there; `deploy/local/stack test` installs it into $FENCELINE_CACHE_DIR"
    );
    path
}

/// A scratch folder of the test's own for a tool's files.
fn scratch(name: &str) -> PathBuf {
    let root = std::env::var("FENCELINE_TEST_SCRATCH").unwrap_or_else(|_| std::env::temp_dir().display().to_string());
    let dir = Path::new(&root).join(format!("{name}-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).expect("scratch folder");
    dir
}

/// OpenAI's OpenAPI description as published (tests/vendor/openai-openapi).
pub fn openai_description() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("vendor/openai-openapi/openapi.json")
}

/// The path part of a description's first server URL (`/v1` for OpenAI's), without
/// a trailing slash.
pub fn server_path(description: &Value) -> String {
    let url = description["servers"][0]["url"].as_str().unwrap_or_default();
    let after_scheme = url.split_once("://").map_or(url, |(_, rest)| rest);
    after_scheme.find('/').map_or(String::new(), |at| after_scheme[at..].trim_end_matches('/').to_owned())
}

/// The description as Prism can check it, changed in two ways only, each for a
/// reason of Prism's and none weakening a check:
///
/// - every path carries its server's path (`/chat/completions` becomes
///   `/v1/chat/completions`): Prism matches a request's path against the paths alone,
///   while the real API serves them under its server URL `https://api.openai.com/v1`,
///   where the catalogue's `base_url` and `request.path` point;
/// - `nullable` is dropped from a schema that has no `type` beside it: Prism's JSON
///   Schema compiler refuses such a schema ("nullable cannot be used without type"),
///   and Prism then validates nothing against it, silently; without a `type`,
///   `nullable` constrains nothing.
///
/// Returns how many `nullable` were dropped.
pub fn for_prism(description: &mut Value) -> usize {
    let prefix = server_path(description);
    if let Some(paths) = description.get_mut("paths").and_then(Value::as_object_mut) {
        let prefixed: serde_json::Map<String, Value> =
            std::mem::take(paths).into_iter().map(|(path, item)| (format!("{prefix}{path}"), item)).collect();
        *paths = prefixed;
    }
    drop_untyped_nullable(description)
}

fn drop_untyped_nullable(value: &mut Value) -> usize {
    match value {
        Value::Object(map) => {
            let mut dropped = 0;
            if map.contains_key("nullable") && !map.contains_key("type") {
                map.remove("nullable");
                dropped += 1;
            }
            dropped + map.values_mut().map(drop_untyped_nullable).sum::<usize>()
        }
        Value::Array(items) => items.iter_mut().map(drop_untyped_nullable).sum(),
        _ => 0,
    }
}

/// Prism (`@stoplight/prism-cli`) as a validating proxy in front of `upstream`:
/// `prism proxy <description> <upstream> --errors`. A request the description
/// refuses is answered `422` and never forwarded; an answer it refuses is replaced
/// by a `500` naming the violations; either is logged, and so is any lesser
/// violation (a status the description does not list).
#[derive(Debug)]
pub struct Prism {
    pub url: String,
    proc: Proc,
}

impl Prism {
    /// Starts Prism on a free port with `description` as [`for_prism`] changes it;
    /// returns once it listens.
    pub async fn proxy(description: &Path, upstream: &str) -> Self {
        let prism = tool("FENCELINE_PRISM", "Prism (@stoplight/prism-cli)");
        let mut spec: Value =
            serde_json::from_slice(&std::fs::read(description).expect("the vendored description")).expect("JSON");
        for_prism(&mut spec);
        let path = scratch("prism").join("openapi.json");
        std::fs::write(&path, serde_json::to_vec(&spec).expect("json")).expect("write the description for Prism");
        let port = free_port();
        let args = [
            "proxy",
            &path.display().to_string(),
            upstream,
            "--errors",
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
        ]
        .map(str::to_owned);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let proc = Proc::spawn_with_stdout(&prism, &args, &[]);
        let prism = Self { url: format!("http://127.0.0.1:{port}"), proc };
        assert!(
            prism.proc.wait_for_line("Prism is listening", START_LIMIT).await,
            "Prism did not start within {START_LIMIT:?}:\n{}",
            prism.log_tail()
        );
        prism
    }

    /// Every line in which Prism reported a violation of the description or ended a
    /// request with an error of its own (a refused request, a replaced answer).
    pub fn violations(&self) -> Vec<String> {
        let mut lines = self.proc.lines_with("Violation:");
        lines.extend(self.proc.lines_with("Request terminated with error"));
        lines
    }

    /// The requests Prism forwarded upstream.
    pub fn forwarded(&self) -> usize {
        self.proc.lines_with("Forwarding \"").len()
    }

    /// Its log after its start-up listing, for failure messages.
    pub fn log_tail(&self) -> String {
        let all = self.proc.all_lines();
        let lines: Vec<&str> = all.lines().filter(|l| !l.contains("[CLI]")).collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }
}

/// stripe-mock: Stripe's mock of its API, which checks each request against
/// Stripe's OpenAPI description (refusing an unknown parameter with a `400
/// invalid_request_error`) and answers the resource's fixture. It keeps no state.
#[derive(Debug)]
pub struct StripeMock {
    pub url: String,
    proc: Proc,
}

impl StripeMock {
    /// Starts it with HTTP only, on a free port (`-verbose`: it logs every request);
    /// returns once it listens.
    pub async fn start() -> Self {
        let binary = tool("FENCELINE_STRIPE_MOCK", "stripe-mock");
        let port = free_port().to_string();
        let proc = Proc::spawn_with_stdout(&binary, &["-http-port", &port, "-verbose"], &[]);
        let mock = Self { url: format!("http://127.0.0.1:{port}"), proc };
        assert!(
            mock.proc.wait_for_line("Listening for HTTP", START_LIMIT).await,
            "stripe-mock did not start within {START_LIMIT:?}:\n{}",
            mock.proc.all_lines()
        );
        mock
    }

    /// How many requests `METHOD /path` it received (`POST /v1/refunds`).
    pub fn requests(&self, method_and_path: &str) -> usize {
        let needle = format!("Request: {method_and_path}");
        self.proc.lines_with(&needle).iter().filter(|line| line.trim_end() == needle).count()
    }

    /// The request validation errors it answered.
    pub fn refusals(&self) -> Vec<String> {
        self.proc.lines_with("Request validation error")
    }

    /// Its log after its route listing, for failure messages.
    pub fn log_tail(&self) -> String {
        let all = self.proc.all_lines();
        let lines: Vec<&str> = all.lines().filter(|l| !l.starts_with("Compiled path")).collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prisms_copy_carries_the_server_path_and_drops_only_untyped_nullable() {
        let mut spec = serde_json::json!({
            "servers": [{"url": "https://api.openai.com/v1"}],
            "paths": {"/chat/completions": {"post": {}}},
            "components": {"schemas": {
                "A": {"type": "string", "nullable": true},
                "B": {"nullable": true, "allOf": [{"$ref": "#/components/schemas/A"}]}
            }}
        });
        assert_eq!(for_prism(&mut spec), 1);
        assert!(spec["paths"]["/v1/chat/completions"]["post"].is_object());
        assert_eq!(spec["components"]["schemas"]["A"]["nullable"], true, "a typed nullable stays");
        assert!(spec["components"]["schemas"]["B"].get("nullable").is_none());
        assert_eq!(server_path(&serde_json::json!({"servers": [{"url": "http://h:1"}]})), "");
    }

    #[test]
    #[should_panic(expected = "installed into $FENCELINE_CACHE_DIR by `deploy/local/stack test`")]
    fn a_missing_tool_fails_and_says_how_to_install_it() {
        tool("FENCELINE_TEST_A_TOOL_NO_ONE_INSTALLS", "a tool");
    }
}
