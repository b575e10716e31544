//! The task kinds intake accepts, each with an optional JSON Schema for its
//! `input`. Schemas are compiled once at start; one that does not compile stops the
//! service with a clear message rather than letting every submission fail.

use std::collections::HashMap;
use std::path::Path;

use crate::problem::ApiError;

/// Known kinds and their input schemas.
#[derive(Debug, Default)]
pub struct KindCatalog {
    kinds: Vec<String>,
    schemas: HashMap<String, jsonschema::Validator>,
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
        Ok(Self { kinds: kinds.to_vec(), schemas })
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
    fn a_schema_that_does_not_compile_stops_the_start() {
        let dir = scratch();
        std::fs::write(dir.join("ticket.triage.json"), r#"{"type": "no-such-type"}"#).expect("write");
        let err = catalog(&dir).expect_err("refused");
        assert!(err.to_string().contains("ticket.triage"), "{err}");
    }
}
