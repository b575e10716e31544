//! What an approval rests on: the outputs of the steps before an approval step,
//! the digest of them a person's card shows, and, when a decision names a digest
//! that no longer matches, which outputs changed since the card was read.

use std::collections::BTreeMap;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// One step's output as it was heard, in the order heard.
#[derive(Debug, Clone, PartialEq)]
pub struct Heard {
    pub step: String,
    pub generation: u32,
    pub output: Value,
}

/// The outputs an approval rests on, by step: for each step of `rests_on`, its
/// newest output among `heard` (the highest generation; within one, the last heard).
/// A step with no output yet is absent.
pub fn outputs_shown<'a>(rests_on: &[String], heard: &'a [Heard]) -> BTreeMap<&'a str, &'a Value> {
    let mut newest: BTreeMap<&'a str, (u32, &'a Value)> = BTreeMap::new();
    for h in heard.iter().filter(|h| rests_on.contains(&h.step)) {
        match newest.get(h.step.as_str()) {
            Some((generation, _)) if *generation > h.generation => {}
            _ => {
                newest.insert(h.step.as_str(), (h.generation, &h.output));
            }
        }
    }
    newest.into_iter().map(|(step, (_, output))| (step, output)).collect()
}

/// The text of a JSON value with every object's keys sorted and no spaces: the
/// same value gives the same text however it was spelled or stored.
pub fn canonical_json(value: &Value) -> String {
    fn sorted(value: &Value) -> Value {
        match value {
            Value::Object(map) => {
                let ordered: BTreeMap<&String, Value> = map.iter().map(|(k, v)| (k, sorted(v))).collect();
                Value::Object(ordered.into_iter().map(|(k, v)| (k.clone(), v)).collect())
            }
            Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    sorted(value).to_string()
}

/// The digest of what an approval card at `step` shows: lower-case hex sha256 of
/// the canonical JSON `{"approval_step": step, "rests_on": {step: output, ...}}`.
///
/// Do not change: a card shows it and a decision names it; a person's approval
/// made on one build is checked by the next.
pub fn digest(step: &str, outputs: &BTreeMap<&str, &Value>) -> String {
    let document = serde_json::json!({ "approval_step": step, "rests_on": outputs });
    hex::encode(Sha256::digest(canonical_json(&document).as_bytes()))
}

/// Why a decision made on the card with digest `shown` no longer fits the card as
/// `heard` makes it now, naming the outputs that changed; `None` when it fits.
pub fn what_changed(step: &str, rests_on: &[String], heard: &[Heard], shown: &str) -> Option<String> {
    let now = outputs_shown(rests_on, heard);
    if digest(step, &now) == shown {
        return None;
    }
    // The card was read at some point of the task's history: find the latest.
    for seen in (0..heard.len()).rev() {
        let then = outputs_shown(rests_on, &heard[..seen]);
        if digest(step, &then) != shown {
            continue;
        }
        let changes: Vec<String> = rests_on
            .iter()
            .filter(|s| then.get(s.as_str()) != now.get(s.as_str()))
            .map(|s| {
                let generation = heard.iter().rev().find(|h| &h.step == s).map_or(0, |h| h.generation);
                match (then.get(s.as_str()), now.get(s.as_str())) {
                    (None, _) => format!("step `{s}` produced its output"),
                    _ => format!("step `{s}` produced a new output (generation {generation})"),
                }
            })
            .collect();
        return Some(format!(
            "the card of `{step}` changed since it was read: {}; read the task again before deciding",
            changes.join(", ")
        ));
    }
    Some(format!(
        "the digest {shown} is not that of any card of `{step}` this task showed; read the task again before deciding"
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn heard(step: &str, generation: u32, output: Value) -> Heard {
        Heard { step: step.into(), generation, output }
    }

    fn rests_on() -> Vec<String> {
        vec!["classify".into(), "draft".into()]
    }

    #[test]
    fn the_digest_is_pinned_and_ignores_how_the_json_was_spelled() {
        let a: Value = serde_json::from_str(r#"{"amount": 12, "reference": "T-1"}"#).expect("json");
        let b: Value = serde_json::from_str(r#"{"reference":"T-1","amount":12}"#).expect("json");
        let one = BTreeMap::from([("draft", &a)]);
        let two = BTreeMap::from([("draft", &b)]);
        assert_eq!(digest("approve", &one), digest("approve", &two));
        // Do not change: the digest cards already showed (sha256 of
        // `{"approval_step":"approve","rests_on":{"draft":{"amount":12,"reference":"T-1"}}}`).
        assert_eq!(digest("approve", &one), "180dc24c2e6e36bd618c08be44680622713fe62f1ab702743950f3990b910506");
        assert_ne!(digest("approve", &one), digest("other", &one), "bound to the step");
    }

    #[test]
    fn the_newest_generation_of_each_step_is_shown() {
        let history = vec![
            heard("classify", 0, json!("refund")),
            heard("draft", 0, json!("old")),
            heard("draft", 1, json!("new")),
            heard("refund", 0, json!("not shown")),
        ];
        let shown = outputs_shown(&rests_on(), &history);
        assert_eq!(shown.get("draft"), Some(&&json!("new")));
        assert_eq!(shown.len(), 2, "only the steps the approval rests on");
    }

    #[test]
    fn a_stale_digest_names_what_changed() {
        let mut history = vec![heard("classify", 0, json!("refund"))];
        let before_draft = digest("approve", &outputs_shown(&rests_on(), &history));
        history.push(heard("draft", 0, json!({"amount": 12})));
        let first = digest("approve", &outputs_shown(&rests_on(), &history));
        assert_eq!(what_changed("approve", &rests_on(), &history, &first), None, "the card as it is");

        let why = what_changed("approve", &rests_on(), &history, &before_draft).expect("changed");
        assert!(why.contains("step `draft` produced its output"), "{why}");

        history.push(heard("draft", 1, json!({"amount": 900})));
        let why = what_changed("approve", &rests_on(), &history, &first).expect("changed");
        assert!(why.contains("step `draft` produced a new output (generation 1)"), "{why}");
        assert!(!why.contains("classify"), "{why}");

        let why = what_changed("approve", &rests_on(), &history, "beef").expect("unknown");
        assert!(why.contains("not that of any card"), "{why}");
    }
}
