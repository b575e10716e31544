//! The task kinds intake accepts, each with an optional JSON Schema for its
//! `input`, and the signals each kind's approval steps wait for (from the
//! catalogue). Schemas are compiled once at start; one that does not compile stops
//! the service with a clear message rather than letting every submission fail.

use std::collections::HashMap;
use std::path::Path;

use fenceline_config::catalog::{Catalog, StepSpec};
use fenceline_config::dialect::InputField;
use fenceline_domain::ids::TaskId;
use fenceline_providers::dialect::{Dialect, RequestBody};

use crate::problem::ApiError;

/// Known kinds, their input schemas and the signals they wait for.
#[derive(Debug, Default)]
pub struct KindCatalog {
    kinds: Vec<String>,
    schemas: HashMap<String, jsonschema::Validator>,
    /// Every kind the catalogue declares, with its approval steps in order; `None`
    /// without a catalogue, when intake cannot tell.
    approvals: Option<HashMap<String, Vec<Approval>>>,
    /// Every kind's steps in order, as the catalogue declares them.
    steps: HashMap<String, Vec<StepSpec>>,
    /// Every kind's input fields that its providers' request templates read.
    fills: HashMap<String, Vec<Fill>>,
    /// Daily budgets by tenant, from the catalogue.
    budgets: std::collections::BTreeMap<String, fenceline_domain::spend::Budget>,
    /// The dialect of each provider that has one, compiled, to show requests.
    dialects: HashMap<String, Dialect>,
}

/// An input field a step's request is built from.
#[derive(Debug, Clone)]
struct Fill {
    step: String,
    provider: String,
    field: InputField,
}

/// A step after an approval: what the approval lets happen next.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct NextStep {
    pub step: String,
    pub provider: String,
    pub operation: String,
    /// For the step the approval lets run at once, at a provider with a dialect:
    /// the request it will send, rendered from the task's input and the outputs
    /// shown (for a refund: the amount and the reference).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RequestShown>,
    /// Why that request cannot be rendered from what is known now (the task
    /// would fail at the step, before sending anything).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_error: Option<String>,
}

/// A request as a dialect renders it, without its credentials or its key.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct RequestShown {
    pub method: String,
    /// Appended to the provider's base URL.
    pub path: String,
    /// The JSON body, or a form's fields as an object; absent without a body.
    #[schema(value_type = Option<Object>)]
    pub body: Option<serde_json::Value>,
}

/// An approval step: its name and the signal it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Approval {
    step: String,
    signal: String,
}

/// A schema file that cannot be read or compiled.
#[derive(Debug, thiserror::Error)]
#[error("input schema of kind `{kind}` ({path}): {reason}")]
pub struct SchemaError {
    pub kind: String,
    pub path: String,
    pub reason: String,
}

impl KindCatalog {
    /// The kinds, with `<dir>/<kind>.json` as the input schema of each kind that has
    /// such a file.
    pub fn load(kinds: &[String], dir: Option<&Path>) -> Result<Self, SchemaError> {
        let mut schemas = HashMap::new();
        if let Some(dir) = dir {
            for kind in kinds {
                let path = dir.join(format!("{kind}.json"));
                if !path.exists() {
                    continue;
                }
                let error =
                    |reason: String| SchemaError { kind: kind.clone(), path: path.display().to_string(), reason };
                let text = std::fs::read_to_string(&path).map_err(|e| error(e.to_string()))?;
                let schema: serde_json::Value = serde_json::from_str(&text).map_err(|e| error(e.to_string()))?;
                let validator = jsonschema::validator_for(&schema).map_err(|e| error(e.to_string()))?;
                schemas.insert(kind.clone(), validator);
            }
        }
        Ok(Self { kinds: kinds.to_vec(), schemas, ..Self::default() })
    }

    /// Takes from the catalogue each kind's approval steps and the signals they wait
    /// for. A kind the catalogue does not declare waits for none: nothing runs its tasks.
    pub fn with_signals_from(mut self, catalog: &Catalog) -> Self {
        let approvals = catalog
            .kinds
            .iter()
            .map(|(kind, spec)| {
                let steps = spec.steps.iter().filter_map(|step| {
                    let signal = step.approval_signal.clone()?;
                    Some(Approval { step: step.name.clone(), signal })
                });
                (kind.clone(), steps.collect())
            })
            .collect();
        self.approvals = Some(approvals);
        self.budgets = catalog.budgets.clone();
        // The catalogue was checked at load: a dialect that would not compile here
        // would not have passed, and is then simply not shown.
        self.dialects = catalog
            .providers
            .iter()
            .filter_map(|(name, spec)| Some((name.clone(), Dialect::new(spec.dialect.as_ref()?).ok()?)))
            .collect();
        self.steps = catalog.kinds.iter().map(|(kind, spec)| (kind.clone(), spec.steps.clone())).collect();
        self.fills = catalog
            .kinds
            .iter()
            .map(|(kind, spec)| {
                let fills = spec.steps.iter().flat_map(|step| {
                    let provider = step.call().map(|(provider, _)| provider);
                    let dialect = provider.and_then(|p| catalog.providers.get(p)).and_then(|p| p.dialect.as_ref());
                    dialect.map(|d| d.input_fields()).unwrap_or_default().into_iter().map(move |field| Fill {
                        step: step.name.clone(),
                        provider: provider.unwrap_or_default().to_owned(),
                        field,
                    })
                });
                (kind.clone(), fills.collect())
            })
            .collect();
        self
    }

    /// The daily budget of `tenant`'s paid calls, if the catalogue gives it one.
    pub fn budget_of(&self, tenant: &str) -> Option<&fenceline_domain::spend::Budget> {
        self.budgets.get(tenant)
    }

    /// The approval steps of `kind` with the signals they wait for, in order; empty
    /// without a catalogue.
    pub fn approval_steps(&self, kind: &str) -> Vec<(&str, &str)> {
        let steps = self.approvals.as_ref().and_then(|a| a.get(kind)).map(Vec::as_slice).unwrap_or_default();
        steps.iter().map(|a| (a.step.as_str(), a.signal.as_str())).collect()
    }

    /// Where `step` is among the steps of `kind`, if the catalogue declares it.
    pub fn position(&self, kind: &str, step: &str) -> Option<usize> {
        self.steps.get(kind)?.iter().position(|s| s.name == step)
    }

    /// The call steps before the approval step `step` of `kind`: the outputs an
    /// approval there rests on.
    pub fn rests_on(&self, kind: &str, step: &str) -> Vec<String> {
        let steps = self.steps.get(kind).map(Vec::as_slice).unwrap_or_default();
        steps.iter().take_while(|s| s.name != step).filter(|s| s.call().is_some()).map(|s| s.name.clone()).collect()
    }

    /// The call steps an approval at `step` of `kind` lets run: those after it, up
    /// to the next approval.
    pub fn next_after(&self, kind: &str, step: &str) -> Vec<NextStep> {
        let steps = self.steps.get(kind).map(Vec::as_slice).unwrap_or_default();
        let mut next = Vec::new();
        for s in steps.iter().skip_while(|s| s.name != step).skip(1) {
            let Some((provider, operation)) = s.call() else { break };
            next.push(NextStep {
                step: s.name.clone(),
                provider: provider.to_owned(),
                operation: operation.to_owned(),
                request: None,
                request_error: None,
            });
        }
        next
    }

    /// The request `provider`'s dialect would send for a step given the task's
    /// `input` and the earlier steps' `outputs` (by step name); `None` for a
    /// provider of Fenceline's protocol, which is sent the input and outputs as
    /// they are. The operation key is not shown: it is made when the call is.
    pub fn request_shown(
        &self,
        provider: &str,
        input: &serde_json::Value,
        outputs: serde_json::Map<String, serde_json::Value>,
    ) -> Option<Result<RequestShown, String>> {
        let dialect = self.dialects.get(provider)?;
        let envelope = serde_json::json!({ "task": input, "steps": outputs });
        let context = Dialect::context(&envelope, "", "(made when the call is)");
        let shown = || -> Result<RequestShown, String> {
            let body = dialect.body(&context)?.map(|body| match body {
                RequestBody::Json(json) => json,
                RequestBody::Form(fields) => {
                    fields.into_iter().map(|(name, value)| (name, serde_json::Value::String(value))).collect()
                }
            });
            Ok(RequestShown { method: dialect.method(), path: dialect.path(&context)?, body })
        };
        Some(shown())
    }

    /// The kinds clients may submit that the catalogue does not declare.
    pub fn undeclared_in<'a>(&'a self, catalog: &Catalog) -> Vec<&'a str> {
        self.kinds.iter().filter(|k| catalog.kind(k).is_none()).map(String::as_str).collect()
    }

    /// The signal the approval step `step` of `kind` waits for, if the catalogue says.
    pub fn signal_awaited_at(&self, kind: &str, step: &str) -> Option<&str> {
        let steps = self.approvals.as_ref()?.get(kind)?;
        steps.iter().find(|a| a.step == step).map(|a| a.signal.as_str())
    }

    /// Refuses a signal that no step of the task's kind waits for, naming those it
    /// takes. Without a catalogue every well-formed name is taken.
    pub fn check_signal(&self, task_id: TaskId, kind: &str, name: &str) -> Result<(), ApiError> {
        let Some(approvals) = &self.approvals else { return Ok(()) };
        let steps = approvals.get(kind).map(Vec::as_slice).unwrap_or_default();
        if steps.iter().any(|a| a.signal == name) {
            return Ok(());
        }
        let mut takes: Vec<String> = Vec::new();
        for approval in steps {
            let quoted = format!("`{}`", approval.signal);
            if !takes.contains(&quoted) {
                takes.push(quoted);
            }
        }
        let takes = if takes.is_empty() {
            format!("tasks of kind `{kind}` wait for no signal")
        } else {
            format!("it takes {}", takes.join(", "))
        };
        Err(ApiError::UnknownSignal(format!("task {task_id} never waits for the signal `{name}`; {takes}")))
    }

    /// The kinds clients may submit.
    pub fn kinds(&self) -> &[String] {
        &self.kinds
    }

    /// Refuses an unknown kind, and an input its kind's schema does not accept
    /// (naming where in the input the first problem is).
    pub fn check(&self, kind: &str, input: &serde_json::Value) -> Result<(), ApiError> {
        if !self.kinds.iter().any(|k| k == kind) {
            return Err(ApiError::UnknownKind(kind.to_owned()));
        }
        if let Some(validator) = self.schemas.get(kind)
            && let Some(error) = validator.iter_errors(input).next()
        {
            let at = error.instance_path().to_string();
            let at = if at.is_empty() { "/".to_owned() } else { at };
            return Err(ApiError::InputInvalid(format!("input at {at}: {error}")));
        }
        for fill in self.fills.get(kind).map(Vec::as_slice).unwrap_or_default() {
            let name = format!("input.{}", fill.field.path.join("."));
            let why = |what: &str| {
                ApiError::InputInvalid(format!(
                    "{name}: {what}: step `{}` calls provider `{}`, whose {} is built from it",
                    fill.step, fill.provider, fill.field.site
                ))
            };
            let value = fill.field.path.iter().try_fold(input, |value, key| value.get(key.as_str()));
            match value {
                None => return Err(why("required")),
                Some(serde_json::Value::Null) => return Err(why("must not be null")),
                Some(serde_json::Value::Object(_)) if fill.field.as_text => {
                    return Err(why("must be a string, a number or a boolean, not an object"));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn catalog(dir: &Path) -> Result<KindCatalog, SchemaError> {
        KindCatalog::load(&["image.generate".into(), "ticket.triage".into()], Some(dir))
    }

    fn scratch() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kinds-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    #[test]
    fn an_input_is_checked_against_its_kinds_schema_only() {
        let dir = scratch();
        let schema = json!({"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}});
        std::fs::write(dir.join("image.generate.json"), schema.to_string()).expect("write");
        let catalog = catalog(&dir).expect("loads");
        assert!(catalog.check("image.generate", &json!({"prompt": "shoe"})).is_ok());
        let err = catalog.check("image.generate", &json!({"prompt": 7})).expect_err("wrong type");
        assert!(err.to_string().contains("/prompt"), "{err}");
        assert!(catalog.check("image.generate", &json!({})).is_err(), "missing field");
        assert!(catalog.check("ticket.triage", &json!(42)).is_ok(), "a kind without a schema takes any input");
        assert!(matches!(catalog.check("video.make", &json!({})), Err(ApiError::UnknownKind(_))));
    }

    #[test]
    fn a_signal_is_taken_only_if_a_step_of_the_tasks_kind_waits_for_it() {
        let catalog = Catalog::parse(
            r#"{"providers": {"p": {"base_url": "http://x", "call_timeout_ms": 1000, "concurrency": 1,
                                    "rate_per_second": 1, "burst": 1}},
                "kinds": {"image.generate": {"steps": [{"name": "render", "provider": "p"}], "attempt_budget_ms": 5000},
                          "ticket.triage": {"steps": [{"name": "approve", "approval_signal": "refund_approved"},
                                                      {"name": "refund", "provider": "p"}],
                                            "attempt_budget_ms": 5000}}}"#,
        )
        .expect("catalogue");
        let kinds = KindCatalog::load(&["image.generate".into(), "video.make".into()], None).expect("no schemas");
        let task = TaskId::new_v7();
        assert!(kinds.check_signal(task, "ticket.triage", "anything").is_ok(), "without a catalogue, any name");
        let kinds = kinds.with_signals_from(&catalog);
        assert_eq!(kinds.undeclared_in(&catalog), ["video.make"]);
        assert!(kinds.check_signal(task, "ticket.triage", "refund_approved").is_ok());
        let wrong = kinds.check_signal(task, "ticket.triage", "approve").expect_err("no step waits for it");
        assert!(matches!(wrong, ApiError::UnknownSignal(_)), "{wrong}");
        assert!(wrong.to_string().contains("`approve`; it takes `refund_approved`"), "{wrong}");
        let none = kinds.check_signal(task, "image.generate", "approve").expect_err("no approval step");
        assert!(none.to_string().contains("kind `image.generate` wait for no signal"), "{none}");
        assert!(kinds.check_signal(task, "video.make", "approve").is_err(), "an undeclared kind runs nowhere");
        assert_eq!(kinds.signal_awaited_at("ticket.triage", "approve"), Some("refund_approved"));
        assert_eq!(kinds.signal_awaited_at("ticket.triage", "refund"), None, "a call step awaits nothing");
    }

    #[test]
    fn an_input_that_cannot_fill_its_providers_request_is_refused_naming_the_field() {
        let catalog = Catalog::parse(
            r#"{"providers": {"stripe": {"base_url": "http://x", "call_timeout_ms": 1000, "concurrency": 1,
                                         "rate_per_second": 1, "burst": 1,
                                         "dialect": {"request": {"path": "/v1/refunds",
                                                                 "form": {"payment_intent": "{{ input.payment_intent }}",
                                                                          "amount": "{{ input.refund.amount }}"}},
                                                     "answer": {"result": ""}}}},
                "kinds": {"refund.issue": {"steps": [{"name": "refund", "provider": "stripe"}],
                                           "attempt_budget_ms": 5000}}}"#,
        )
        .expect("catalogue");
        let kinds = KindCatalog::load(&["refund.issue".into()], None).expect("no schemas").with_signals_from(&catalog);
        let check = |input| kinds.check("refund.issue", &input).map_err(|e| e.to_string());
        assert_eq!(check(json!({"payment_intent": "pi_1", "refund": {"amount": 1500}})), Ok(()));
        let missing = check(json!({"payment_intent": "pi_1"})).expect_err("no amount");
        assert!(
            missing.contains(
                "input.refund.amount: required: step `refund` calls provider `stripe`, whose \
                              request.form.amount is built from it"
            ),
            "{missing}"
        );
        let object = check(json!({"payment_intent": {"id": "pi_1"}, "refund": {"amount": 1}})).expect_err("object");
        assert!(object.contains("input.payment_intent: must be a string, a number or a boolean"), "{object}");
        let null = check(json!({"payment_intent": null, "refund": {"amount": 1}})).expect_err("null");
        assert!(null.contains("input.payment_intent: must not be null"), "{null}");
    }

    #[test]
    fn a_schema_that_does_not_compile_stops_the_start() {
        let dir = scratch();
        std::fs::write(dir.join("ticket.triage.json"), r#"{"type": "no-such-type"}"#).expect("write");
        let err = catalog(&dir).expect_err("refused");
        assert!(err.to_string().contains("ticket.triage"), "{err}");
    }
}
