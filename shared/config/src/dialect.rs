//! Provider dialects: how a provider that does not speak Fenceline's protocol is
//! called and how its answers are read, described in the catalogue
//! (docs/catalog.md, "Dialects"), and the checks a dialect must pass at load.

use std::collections::{BTreeMap, BTreeSet};

use fenceline_domain::vocabulary::ErrorClass;
use serde::Deserialize;

use crate::Error;

/// How to call one provider that speaks its own HTTP API.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DialectSpec {
    /// How the request is built.
    pub request: DialectRequest,
    /// The header that carries the credential of `auth_header_env`, sent as the
    /// variable holds it (default `Authorization`; Anthropic's is `x-api-key`).
    #[serde(default = "default_auth_header")]
    pub auth_header: String,
    /// The header that carries the operation key, for a provider that dedupes by it.
    #[serde(default)]
    pub idempotency_header: Option<String>,
    /// How long the provider remembers a key, in hours (fractions allowed): past
    /// it, the same key is not sent again, since the provider could charge it as
    /// new work (docs/catalog.md, "Dialects").
    #[serde(default)]
    pub idempotency_ttl_hours: Option<f64>,
    /// How an answer is read.
    #[serde(default)]
    pub answer: DialectAnswer,
    /// How an accepted job is followed; absent for providers that answer at once.
    #[serde(default)]
    pub poll: Option<DialectPoll>,
    /// How a throttled answer says when to come back.
    #[serde(default)]
    pub throttling: DialectThrottling,
    /// The largest inline result kept as a step's output, in bytes of its canonical
    /// JSON text (default 1 MiB); a larger one is read as ambiguous, never as done.
    #[serde(default = "default_max_inline_result_bytes")]
    pub max_inline_result_bytes: u64,
}

fn default_auth_header() -> String {
    "Authorization".to_owned()
}

fn default_max_inline_result_bytes() -> u64 {
    1024 * 1024
}

/// The request: method, path and headers as templates, and a JSON body template
/// or a form of templates.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DialectRequest {
    #[serde(default = "default_method")]
    pub method: String,
    /// Appended to the provider's `base_url`.
    pub path: String,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// A template that renders the JSON body (use `tojson` for values).
    #[serde(default)]
    pub body: Option<String>,
    /// Form fields, each a template: the body is `application/x-www-form-urlencoded`.
    #[serde(default)]
    pub form: Option<BTreeMap<String, String>>,
}

fn default_method() -> String {
    "POST".to_owned()
}

/// What the result pointer selects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResultForm {
    /// A JSON value that is itself the result (a chat message, a refund object).
    #[default]
    Inline,
    /// An object `{"uri", "sha256", "size_bytes"}`: downloaded and verified.
    Artifact,
}

/// How an answer is read: statuses, JSON pointers (RFC 6901) and job states.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DialectAnswer {
    #[serde(default)]
    pub statuses: DialectStatuses,
    /// Pointer to the provider's request id; without it, a done answer has none of
    /// its own and an accepted one cannot be followed.
    #[serde(default)]
    pub request_id: Option<String>,
    /// Pointer to the job's state; without it, a done status is done.
    #[serde(default)]
    pub state: Option<String>,
    /// Pointer to the result (`""`: the whole body).
    pub result: String,
    #[serde(default)]
    pub result_form: ResultForm,
    #[serde(default)]
    pub running_states: BTreeSet<String>,
    #[serde(default)]
    pub succeeded_states: BTreeSet<String>,
    #[serde(default)]
    pub failed_states: BTreeSet<String>,
    /// Pointer to the vendor's error type in an error body (`/error/type`).
    #[serde(default)]
    pub error_type: Option<String>,
    /// Vendor error type → error class (`insufficient_quota` → `not_authorised`).
    #[serde(default)]
    pub error_classes: BTreeMap<String, String>,
    /// A header by which the vendor says whether a failed request may be sent
    /// again (`Stripe-Should-Retry`): `false` on a 4xx names it `rejected`, unless
    /// the error type named a class. It never makes a 5xx or a 409 safe.
    #[serde(default)]
    pub should_retry_header: Option<String>,
    /// What a done answer reports it used, by name, each a pointer to a count
    /// (`{"prompt_tokens": "/usage/prompt_tokens"}`): what `usage_prices` price.
    #[serde(default)]
    pub usage: BTreeMap<String, String>,
}

/// Which statuses mean what; the defaults are the protocol's error table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DialectStatuses {
    #[serde(default = "default_done")]
    pub done: BTreeSet<u16>,
    #[serde(default = "default_accepted")]
    pub accepted: BTreeSet<u16>,
    #[serde(default = "default_throttled")]
    pub throttled: BTreeSet<u16>,
    #[serde(default = "default_rejected")]
    pub rejected: BTreeSet<u16>,
    #[serde(default = "default_not_authorised")]
    pub not_authorised: BTreeSet<u16>,
}

impl Default for DialectStatuses {
    fn default() -> Self {
        DialectStatuses {
            done: default_done(),
            accepted: default_accepted(),
            throttled: default_throttled(),
            rejected: default_rejected(),
            not_authorised: default_not_authorised(),
        }
    }
}

fn default_done() -> BTreeSet<u16> {
    BTreeSet::from([200, 201])
}
fn default_accepted() -> BTreeSet<u16> {
    BTreeSet::from([202])
}
fn default_throttled() -> BTreeSet<u16> {
    BTreeSet::from([429])
}
fn default_rejected() -> BTreeSet<u16> {
    BTreeSet::from([400, 404, 422])
}
fn default_not_authorised() -> BTreeSet<u16> {
    BTreeSet::from([401, 402, 403])
}

/// How an accepted job is followed: a URL the answer names, or a path template
/// with `request_id`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DialectPoll {
    /// Pointer to the poll URL in the accepting answer (`/urls/get`).
    #[serde(default)]
    pub url: Option<String>,
    /// Template of the poll path, appended to `base_url` (`/v1/predictions/{{ request_id }}`).
    #[serde(default)]
    pub path: Option<String>,
}

/// How a throttled answer says when to come back.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DialectThrottling {
    /// Read `Retry-After`, in seconds or as an HTTP date (default `true`).
    #[serde(default = "default_true")]
    pub retry_after: bool,
    /// Headers saying when a limit resets: a duration as `1s`, `6m0s`, `20ms`
    /// (OpenAI's `x-ratelimit-reset-requests`), seconds, or an RFC 3339 instant
    /// (Anthropic's `anthropic-ratelimit-requests-reset`); the longest wait is honoured.
    #[serde(default)]
    pub reset_headers: Vec<String>,
}

impl Default for DialectThrottling {
    fn default() -> Self {
        DialectThrottling { retry_after: true, reset_headers: Vec::new() }
    }
}

fn default_true() -> bool {
    true
}

/// A field of the task's input that a request template reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputField {
    /// Its path under `input` (`["messages"]` for `input.messages`).
    pub path: Vec<String>,
    /// Read as text (into the path, a header or a form field), where only a
    /// string, a number or a boolean can stand.
    pub as_text: bool,
    /// The first template that reads it (`request.form.amount`).
    pub site: String,
}

/// Where in a dialect a template sits, for messages and for template names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateSite {
    /// `request.path`, `request.headers.Authorization`, `request.body`, …
    pub field: String,
    pub source: String,
}

impl DialectSpec {
    /// Every request template, named by its field.
    pub fn request_templates(&self) -> Vec<TemplateSite> {
        let site = |field: String, source: &String| TemplateSite { field, source: source.clone() };
        let mut sites = vec![site("request.path".to_owned(), &self.request.path)];
        sites.extend(self.request.headers.iter().map(|(name, t)| site(format!("request.headers.{name}"), t)));
        sites.extend(self.request.body.iter().map(|t| site("request.body".to_owned(), t)));
        for (name, t) in self.request.form.iter().flatten() {
            sites.push(site(format!("request.form.{name}"), t));
        }
        sites
    }

    /// The fields of the task's input the request's templates read, each with the
    /// first template that reads it: what a task of a kind calling this provider
    /// must carry for its request to be built.
    pub fn input_fields(&self) -> Vec<InputField> {
        let env = template_environment();
        let mut fields: Vec<InputField> = Vec::new();
        for site in self.request_templates() {
            let Ok(template) = env.template_from_str(&site.source) else { continue };
            let mut read: Vec<String> = template.undeclared_variables(true).into_iter().collect();
            read.sort();
            for name in read {
                let Some(rest) = name.strip_prefix("input.") else { continue };
                let path: Vec<String> = rest.split('.').map(str::to_owned).collect();
                // The body's values go through `tojson`; elsewhere a value is text.
                let as_text = site.field != "request.body";
                match fields.iter_mut().find(|f| f.path == path) {
                    Some(known) => known.as_text |= as_text,
                    None => fields.push(InputField { path, as_text, site: site.field.clone() }),
                }
            }
        }
        fields
    }

    /// How long the provider remembers an operation key, if it says.
    pub fn key_memory(&self) -> Option<std::time::Duration> {
        self.idempotency_ttl_hours.and_then(|hours| std::time::Duration::try_from_secs_f64(hours * 3_600.0).ok())
    }

    /// Every JSON pointer, named by its field.
    pub fn pointers(&self) -> Vec<(&'static str, &str)> {
        let answer = &self.answer;
        let mut pointers = vec![("answer.result", answer.result.as_str())];
        pointers.extend(answer.request_id.as_deref().map(|p| ("answer.request_id", p)));
        pointers.extend(answer.state.as_deref().map(|p| ("answer.state", p)));
        pointers.extend(answer.error_type.as_deref().map(|p| ("answer.error_type", p)));
        pointers.extend(self.poll.as_ref().and_then(|p| p.url.as_deref()).map(|p| ("poll.url", p)));
        pointers.extend(answer.usage.values().map(|p| ("answer.usage", p.as_str())));
        pointers
    }

    /// The error class of each vendor error type, typed.
    pub fn error_classes(&self) -> BTreeMap<String, ErrorClass> {
        self.answer.error_classes.iter().filter_map(|(t, class)| Some((t.clone(), class.parse().ok()?))).collect()
    }
}

/// The template environment dialects render with: undefined names are errors, no
/// auto-escaping (JSON bodies use `tojson`).
pub fn template_environment() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.add_filter("tojson", strict_tojson);
    env
}

/// `tojson` that refuses an undefined value (the built-in would print `null`, and
/// a body would silently lack what the input lacks).
fn strict_tojson(value: minijinja::Value) -> Result<minijinja::Value, minijinja::Error> {
    if value.is_undefined() {
        return Err(minijinja::Error::new(minijinja::ErrorKind::UndefinedError, "tojson of an undefined value"));
    }
    let text = serde_json::to_string(&value)
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(minijinja::Value::from_safe_string(text))
}

/// Whether `pointer` is a JSON pointer (RFC 6901): empty, or `/`-separated
/// tokens in which `~` is only ever followed by `0` or `1`.
pub fn is_json_pointer(pointer: &str) -> bool {
    if pointer.is_empty() {
        return true;
    }
    let Some(tokens) = pointer.strip_prefix('/') else { return false };
    tokens.split('/').all(|token| {
        let mut chars = token.chars();
        while let Some(c) = chars.next() {
            if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
                return false;
            }
        }
        true
    })
}

/// The names under `steps` a template reads (`steps.classify.content` → `classify`).
fn steps_named(template: &minijinja::Template<'_, '_>) -> BTreeSet<String> {
    template
        .undeclared_variables(true)
        .into_iter()
        .filter_map(|name| name.strip_prefix("steps.").map(|rest| rest.split('.').next().unwrap_or(rest).to_owned()))
        .collect()
}

/// Checks a provider's dialect: its templates parse and read only steps that run
/// before every step that calls the provider (`earlier_steps`, one set per such
/// step), its pointers are JSON pointers, its classes are known, and a provider
/// that dedupes names the header that carries the key.
pub fn check(
    provider: &str,
    dialect: &DialectSpec,
    idempotency_keys: bool,
    lookup: bool,
    earlier_steps: &[BTreeSet<&str>],
) -> Result<(), Error> {
    let refuse = |field: &str, reason: String| Err(Error(format!("provider `{provider}`: dialect.{field}: {reason}")));
    let env = template_environment();
    for site in dialect.request_templates() {
        let template = match env.template_from_str(&site.source) {
            Ok(template) => template,
            Err(e) => return refuse(&site.field, format!("the template does not parse: {e}")),
        };
        for step in steps_named(&template) {
            if let Some(before) = earlier_steps.iter().find(|before| !before.contains(step.as_str())) {
                let known: Vec<&str> = before.iter().copied().collect();
                return refuse(
                    &site.field,
                    format!(
                        "the template reads `steps.{step}`, which is not a step that runs before every step calling \
                         this provider (earlier steps there: {known:?})"
                    ),
                );
            }
        }
    }
    let header_name = |name: &str| {
        !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    };
    if !header_name(&dialect.auth_header) {
        return refuse("auth_header", format!("`{}` is not an HTTP header name", dialect.auth_header));
    }
    if let Some(hours) = dialect.idempotency_ttl_hours {
        if dialect.idempotency_header.is_none() {
            return refuse(
                "idempotency_ttl_hours",
                "is the memory of keys sent in `idempotency_header`, which is absent".into(),
            );
        }
        if !(hours > 0.0 && dialect.key_memory().is_some()) {
            return refuse("idempotency_ttl_hours", format!("must be a positive number of hours, not {hours}"));
        }
    }
    if dialect.request.body.is_some() && dialect.request.form.is_some() {
        return refuse("request", "a `body` template or a `form`, not both".to_owned());
    }
    let method = dialect.request.method.to_ascii_uppercase();
    if !["GET", "POST", "PUT", "PATCH", "DELETE"].contains(&method.as_str()) {
        return refuse("request.method", format!("`{}` is not an HTTP method Fenceline sends", dialect.request.method));
    }
    for (field, pointer) in dialect.pointers() {
        if !is_json_pointer(pointer) {
            return refuse(field, format!("`{pointer}` is not a JSON pointer (RFC 6901: empty or starting with `/`)"));
        }
    }
    for (error_type, class) in &dialect.answer.error_classes {
        if let Err(e) = class.parse::<ErrorClass>() {
            return refuse(&format!("answer.error_classes.{error_type}"), e.to_string());
        }
    }
    if !dialect.answer.error_classes.is_empty() && dialect.answer.error_type.is_none() {
        return refuse("answer.error_classes", "needs `answer.error_type`, the pointer to the error type".to_owned());
    }
    if let Some(name) = dialect.answer.should_retry_header.as_deref().filter(|n| !header_name(n)) {
        return refuse("answer.should_retry_header", format!("`{name}` is not an HTTP header name"));
    }
    if idempotency_keys && dialect.idempotency_header.is_none() {
        return refuse(
            "idempotency_header",
            "the provider claims `idempotency_keys` but the dialect names no header to carry the key".to_owned(),
        );
    }
    if lookup {
        return refuse("", "a provider reached through a dialect cannot declare `lookup` (yet)".to_owned());
    }
    if let Some(poll) = &dialect.poll {
        if poll.url.is_none() && poll.path.is_none() {
            return refuse("poll", "needs `url` (a pointer) or `path` (a template)".to_owned());
        }
        if let Some(path) = &poll.path
            && let Err(e) = env.template_from_str(path)
        {
            return refuse("poll.path", format!("the template does not parse: {e}"));
        }
        if dialect.answer.request_id.is_none() {
            return refuse("poll", "following a job needs `answer.request_id`".to_owned());
        }
    }
    let statuses = &dialect.answer.statuses;
    let lists = [
        ("done", &statuses.done),
        ("accepted", &statuses.accepted),
        ("throttled", &statuses.throttled),
        ("rejected", &statuses.rejected),
        ("not_authorised", &statuses.not_authorised),
    ];
    for (i, (name, list)) in lists.iter().enumerate() {
        if let Some(status) = list.iter().find(|s| !(100..=599).contains(*s)) {
            return refuse(&format!("answer.statuses.{name}"), format!("{status} is not an HTTP status"));
        }
        for (other, other_list) in &lists[i + 1..] {
            if let Some(status) = list.intersection(other_list).next() {
                return refuse(&format!("answer.statuses.{name}"), format!("{status} is also listed under `{other}`"));
            }
        }
    }
    if let Some(status) = statuses.done.iter().chain(&statuses.accepted).find(|s| !(200..=299).contains(*s)) {
        return refuse("answer.statuses", format!("done and accepted statuses are 2xx, not {status}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_input_fields_a_request_reads_are_named_with_the_template_that_reads_them() {
        let dialect: DialectSpec = serde_json::from_value(serde_json::json!({
            "request": {
                "path": "/v1/accounts/{{ input.account.id }}/refunds",
                "headers": {"X-Ticket": "{{ input.ticket }}"},
                "form": {"amount": "{{ input.amount }}", "note": "{{ steps.draft.content }}",
                         "lines": "{% for line in input.lines %}{{ line }}{% endfor %}"}
            },
            "answer": {"result": ""}
        }))
        .expect("a dialect");
        let fields = dialect.input_fields();
        let named: Vec<(String, bool, &str)> =
            fields.iter().map(|f| (f.path.join("."), f.as_text, f.site.as_str())).collect();
        assert_eq!(
            named,
            [
                ("account.id".to_owned(), true, "request.path"),
                ("ticket".to_owned(), true, "request.headers.X-Ticket"),
                ("amount".to_owned(), true, "request.form.amount"),
                ("lines".to_owned(), true, "request.form.lines"),
            ]
        );
        let body: DialectSpec = serde_json::from_value(serde_json::json!({
            "request": {"path": "/v1/messages", "body": "{\"messages\": {{ input.messages | tojson }}}"},
            "answer": {"result": ""}
        }))
        .expect("a dialect");
        assert_eq!(
            body.input_fields(),
            [InputField { path: vec!["messages".to_owned()], as_text: false, site: "request.body".to_owned() }]
        );
    }
}
