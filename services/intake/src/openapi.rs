//! The API's OpenAPI 3.1 document, generated from the handlers' and types'
//! annotations and served at `/v1/openapi.json`.

use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

use fenceline_domain::vocabulary::{Priority, ResolutionAction, TaskState};

use crate::kinds::KindCatalog;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Fenceline intake",
        description = "Submit paid, side-effecting work once, follow it, and decide what only a person may \
                       decide. Every error is application/problem+json with a stable `type`.",
    ),
    paths(
        crate::routes::tasks::submit,
        crate::routes::tasks::list,
        crate::routes::tasks::read,
        crate::routes::actions::cancel,
        crate::routes::actions::signal,
        crate::routes::actions::resolve,
        crate::routes::actions::approve,
        crate::routes::actions::reject,
        crate::routes::tasks::summary,
        crate::routes::spend::spend,
        crate::routes::webhooks::webhook,
    ),
    components(schemas(crate::problem::Problem)),
    modifiers(&BearerTokens),
    security(("bearer" = [])),
    tags(
        (name = "tasks", description = "Submitting, reading and acting on tasks"),
        (name = "webhooks", description = "Signed deliveries from configured senders"),
    ),
)]
struct ApiDoc;

/// Declares the bearer-token scheme every `/v1/tasks` operation uses.
struct BearerTokens;

impl Modify for BearerTokens {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearer", SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)));
    }
}

/// The document for this intake: the generated one, with every closed set of words
/// (kinds from the configuration, states, priorities, actions from the domain's
/// vocabulary) listed as an `enum`.
pub fn document(kinds: &KindCatalog) -> serde_json::Value {
    let mut document = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
    let words = |all: &[&str]| serde_json::Value::from(all.to_vec());
    let states: Vec<&str> = TaskState::ALL.iter().map(|s| s.as_str()).collect();
    let priorities: Vec<&str> = Priority::ALL.iter().map(|p| p.as_str()).collect();
    let actions: Vec<&str> = ResolutionAction::ALL.iter().map(|a| a.as_str()).collect();
    let kinds: Vec<&str> = kinds.kinds().iter().map(String::as_str).collect();
    let schemas = "/components/schemas";
    for (pointer, values) in [
        (format!("{schemas}/SubmitTask/properties/kind"), words(&kinds)),
        (format!("{schemas}/SubmitTask/properties/priority"), words(&priorities)),
        (format!("{schemas}/TaskView/properties/state"), words(&states)),
        (format!("{schemas}/Resolve/properties/action"), words(&actions)),
    ] {
        if let Some(schema) = document.pointer_mut(&pointer).and_then(|s| s.as_object_mut()) {
            let mut values = values;
            // An optional field also takes `null`.
            let nullable = schema.get("type").and_then(|t| t.as_array()).is_some_and(|t| t.contains(&"null".into()));
            if let (true, Some(list)) = (nullable, values.as_array_mut()) {
                list.push(serde_json::Value::Null);
            }
            schema.remove("pattern");
            schema.insert("enum".into(), values);
        }
    }
    // Limits the derive cannot say (tasks::SubmitTask::validate enforces them).
    if let Some(labels) = document.pointer_mut(&format!("{schemas}/SubmitTask/properties/labels")) {
        labels["maxProperties"] = 32.into();
        labels["propertyNames"] = serde_json::json!({"minLength": 1, "maxLength": 64});
        labels["additionalProperties"] = serde_json::json!({"type": "string", "maxLength": 256});
    }
    // The list's `state` filter takes the same words.
    if let Some(parameters) = document.pointer_mut("/paths/~1v1~1tasks/get/parameters").and_then(|p| p.as_array_mut()) {
        for parameter in parameters.iter_mut().filter(|p| p["name"] == "state") {
            parameter["schema"]["enum"] = words(&states);
        }
    }
    document
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_is_documented_with_its_problems() {
        let kinds = KindCatalog::load(&["image.generate".into()], None).expect("no schemas");
        let document = document(&kinds);
        assert_eq!(document["openapi"], "3.1.0");
        let operations = [
            ("/v1/tasks", "post"),
            ("/v1/tasks", "get"),
            ("/v1/tasks/{task_id}", "get"),
            ("/v1/tasks/{task_id}/cancel", "post"),
            ("/v1/tasks/{task_id}/signals/{name}", "post"),
            ("/v1/tasks/{task_id}/resolution", "post"),
            ("/v1/tasks/{task_id}/approve", "post"),
            ("/v1/tasks/{task_id}/reject", "post"),
            ("/v1/summary", "get"),
            ("/v1/webhooks/{source}", "post"),
        ];
        for (path, method) in operations {
            let operation = &document["paths"][path][method];
            assert!(operation.is_object(), "{method} {path} is documented");
            let problem = &operation["responses"]["401"]["content"]["application/problem+json"];
            assert!(problem.is_object(), "{method} {path} documents its 401 as a problem");
        }
        let schemas = &document["components"]["schemas"];
        assert_eq!(schemas["SubmitTask"]["properties"]["kind"]["enum"], serde_json::json!(["image.generate"]));
        assert_eq!(
            schemas["SubmitTask"]["properties"]["priority"]["enum"],
            serde_json::json!(["high", "normal", "low", null])
        );
        assert_eq!(
            schemas["TaskView"]["properties"]["state"]["enum"].as_array().map(Vec::len),
            Some(TaskState::ALL.len())
        );
        let state_filter = document["paths"]["/v1/tasks"]["get"]["parameters"]
            .as_array()
            .and_then(|p| p.iter().find(|p| p["name"] == "state"))
            .map(|p| p["schema"]["enum"].clone());
        assert_eq!(state_filter.and_then(|e| e.as_array().map(Vec::len)), Some(TaskState::ALL.len()));
    }
}
