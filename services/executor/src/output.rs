//! A step's output: how a verified result becomes the output later steps read and
//! the reference its checkpoint keeps, and how much of it travels to be shown.

use fenceline_domain::ids::TaskId;
use fenceline_events::ArtifactRef;
use fenceline_providers::ProviderResult;

/// A step's verified result: its reference (the attempt's result when it is the
/// last step) and its output, what later steps see as `steps.<name>`.
#[derive(Debug, Clone)]
pub(crate) struct StepResult {
    pub artifact: ArtifactRef,
    pub output: serde_json::Value,
}

/// The reference and the output of a verified result. An artifact's output is its
/// reference; an inline result's (a dialect's JSON value) is the value, referred
/// to as `inline:<task>/<generation>/<step>` with the sha256 and size of its
/// canonical JSON text.
pub(crate) fn step_output(
    task_id: TaskId,
    generation: i32,
    step: &str,
    result: ProviderResult,
) -> (ArtifactRef, serde_json::Value) {
    match result.inline {
        Some(value) => {
            let uri = inline_uri(task_id, generation, step);
            (ArtifactRef { uri, sha256: result.sha256, size_bytes: result.size_bytes }, value)
        }
        None => {
            let artifact = ArtifactRef { uri: result.uri, sha256: result.sha256, size_bytes: result.size_bytes };
            let output = serde_json::to_value(&artifact).unwrap_or_default();
            (artifact, output)
        }
    }
}

/// The reference of an inline result checkpointed by `generation` of the task.
pub(crate) fn inline_uri(task_id: TaskId, generation: i32, step: &str) -> String {
    format!("{}{task_id}/{generation}/{step}", fenceline_providers::dialect::INLINE_URI_SCHEME)
}

/// The most bytes of a step's output that travel with its checkpoint for intake
/// to show; a larger output travels without it (intake shows its reference).
const OUTPUT_SHOWN_BYTES: usize = 256 * 1024;

/// A step's output as the checkpoint announces it: its canonical JSON text, if
/// it is not too large for a record.
pub(crate) fn shown_output(output: &serde_json::Value) -> Option<String> {
    let text = fenceline_providers::dialect::canonical_json(output);
    (text.len() <= OUTPUT_SHOWN_BYTES).then_some(text)
}

pub(crate) fn hex_sha(value: &serde_json::Value) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(value.to_string().as_bytes()))
}

/// The result of a call step checkpointed earlier: an artifact's reference is its
/// output; any other output is an inline result, referred to by where it was
/// checkpointed and hashed as it was (its canonical JSON text).
pub(crate) fn checkpointed_result(
    task_id: TaskId,
    generation: i32,
    step: &str,
    output: &serde_json::Value,
) -> ArtifactRef {
    if let Ok(artifact) = serde_json::from_value::<ArtifactRef>(output.clone()) {
        return artifact;
    }
    let text = fenceline_providers::dialect::canonical_json(output);
    ArtifactRef {
        uri: inline_uri(task_id, generation, step),
        sha256: {
            use sha2::{Digest, Sha256};
            hex::encode(Sha256::digest(text.as_bytes()))
        },
        size_bytes: i64::try_from(text.len()).unwrap_or(i64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inline_result_is_the_steps_output_and_is_referred_to_where_it_was_checkpointed() {
        let task = TaskId::from_uuid(uuid::Uuid::from_u128(7));
        let message = serde_json::json!({"role": "assistant", "content": "Hi"});
        let result = fenceline_providers::dialect::inline_result(&message, 1024).expect("within the limit");
        let (artifact, output) = step_output(task, 2, "draft", result.clone());
        assert_eq!(output, message, "later steps see the value itself");
        assert_eq!(artifact.uri, format!("inline:{task}/2/draft"));
        assert_eq!((artifact.sha256.as_str(), artifact.size_bytes), (result.sha256.as_str(), result.size_bytes));
        // Read back from its checkpoint, it is the same reference.
        assert_eq!(checkpointed_result(task, 2, "draft", &output), artifact);
        // An artifact's output is its reference, as before.
        let file = ProviderResult {
            uri: "http://p/a".into(),
            sha256: "ab".into(),
            size_bytes: 3,
            inline: None,
            usage: Default::default(),
        };
        let (artifact, output) = step_output(task, 0, "render", file);
        assert_eq!(output, serde_json::json!({"uri": "http://p/a", "sha256": "ab", "size_bytes": 3}));
        assert_eq!(checkpointed_result(task, 0, "render", &output), artifact);
    }
}
