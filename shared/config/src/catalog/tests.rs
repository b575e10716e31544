//! The catalogue's parsing, its defaults and its refusals.

use super::*;

const GOOD: &str = r#"{
    "providers": {"img": {"base_url": "http://x", "call_timeout_ms": 1000, "concurrency": 2,
                          "rate_per_second": 5, "burst": 5, "status_overrides": {"409": "ambiguous"}}},
    "kinds": {"image.generate": {"steps": [{"name": "render", "provider": "img"}], "attempt_budget_ms": 5000},
              "ticket.triage": {"steps": [{"name": "approve", "approval_signal": "ok"},
                                          {"name": "refund", "provider": "img", "operation": "pay"}],
                                "attempt_budget_ms": 5000}}
}"#;

#[test]
fn a_good_catalogue_parses_with_its_defaults() {
    let catalog = Catalog::parse(GOOD).expect("valid");
    let kind = catalog.kind("ticket.triage").expect("kind");
    assert_eq!(kind.max_attempts, 5);
    assert_eq!(kind.slot_provider(), Some("img"));
    assert_eq!(kind.steps[1].call(), Some(("img", "pay")));
    assert_eq!(kind.step_index_after(None), 0);
    assert_eq!(kind.step_index_after(Some("approve")), 1);
    assert_eq!(kind.calls_after(None), vec![("img", 0)], "the first attempt stops at the approval");
    assert_eq!(kind.calls_after(Some("approve")), vec![("img", 1)]);
    let img = catalog.provider("img").expect("img");
    assert_eq!(img.overrides().get(&409), Some(&ErrorClass::Ambiguous));
    assert!(img.error_table().safe_5xx.is_empty(), "no 5xx is safe unless declared");
    let adaptive = img.adaptive_policy().expect("adaptive by default");
    assert_eq!((adaptive.ceiling, adaptive.decrease_factor, adaptive.decrease_interval), (2, 0.5, 1_000_000));
}

#[test]
fn adaptive_concurrency_is_configured_per_provider_and_checked() {
    let off = GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"adaptive_concurrency\": {\"enabled\": false},");
    assert!(Catalog::parse(&off).expect("valid").provider("img").expect("img").adaptive_policy().is_none());
    let tuned = GOOD.replace(
        "\"burst\": 5,",
        "\"burst\": 5, \"adaptive_concurrency\": {\"decrease_factor\": 0.7, \"decrease_interval_ms\": 250},",
    );
    let policy = Catalog::parse(&tuned).expect("valid").provider("img").expect("img").adaptive_policy();
    assert_eq!(policy.map(|p| (p.decrease_factor, p.decrease_interval)), Some((0.7, 250_000)));
    let wrong = GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"adaptive_concurrency\": {\"decrease_factor\": 1.5},");
    let error = Catalog::parse(&wrong).expect_err("a factor above 1 grows on trouble");
    assert!(error.0.contains("decrease_factor"), "{}", error.0);
}

#[test]
fn a_provider_may_declare_its_own_5xx_safe_and_then_override_it() {
    let text = GOOD.replace("\"409\": \"ambiguous\"", "\"503\": \"throttled\"").replace(
        "\"burst\": 5,",
        "\"burst\": 5, \"safe_5xx\": [500, 503], \"capabilities\": {\"idempotency_keys\": true},",
    );
    let catalog = Catalog::parse(&text).expect("valid");
    let table = catalog.provider("img").expect("img").error_table();
    assert_eq!(table.safe_5xx, BTreeSet::from([500, 503]));
    assert_eq!(table.overrides.get(&503), Some(&ErrorClass::Throttled));
    assert!(table.dedupes);
}

#[test]
fn bad_catalogues_are_refused_with_the_reason() {
    let cases = [
        (GOOD.replace("\"provider\": \"img\"}]", "\"provider\": \"nope\"}]"), "no provider `nope`"),
        (GOOD.replace("\"attempt_budget_ms\": 5000}}", "\"attempt_budget_ms\": 500}}"), "must be shorter"),
        (GOOD.replace("\"ambiguous\"", "\"maybe\""), "provider `img`: `maybe` is not a known error class"),
        (GOOD.replace("\"concurrency\": 2", "\"concurrency\": 0"), "must be positive"),
        (GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"colour\": 1,"), "unknown field"),
        (GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"safe_5xx\": [504],"), "not 504"),
        (GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"safe_5xx\": [429],"), "not 429"),
        (GOOD.replace("\"409\": \"ambiguous\"", "\"503\": \"throttled\""), "unless it is listed in safe_5xx"),
        (GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"tls\": {\"client_key_file\": \"/k.pem\"},"), "go together"),
        (GOOD.replace("\"burst\": 5,", "\"burst\": 5, \"tls\": {\"ca\": \"/ca.pem\"},"), "unknown field"),
        (GOOD.replace("\"name\": \"approve\"", "\"name\": \"refund\""), "names two steps `refund`"),
    ];
    for (text, expected) in cases {
        let err = Catalog::parse(&text).expect_err(expected).to_string();
        assert!(err.contains(expected), "{err} should mention {expected}");
    }
}

fn with_standing_decision(step: serde_json::Value) -> String {
    standing_decision_catalogue(step).to_string()
}

fn standing_decision_catalogue(step: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "providers": {"llm": {"base_url": "http://x", "call_timeout_ms": 1000, "concurrency": 2,
                              "rate_per_second": 5, "burst": 5, "price_per_call_minor": 10}},
        "kinds": {"ticket.triage": {"steps": [
            step,
            {"name": "approve", "approval_signal": "ok"},
            {"name": "draft", "provider": "llm"}
        ], "attempt_budget_ms": 5000}}
    })
}

#[test]
fn a_step_may_carry_a_standing_decision_priced_by_its_provider_or_itself() {
    let policy = serde_json::json!({"send_again": {"max_extra_charges": 2, "max_extra_cost_minor": 20}});
    let text = with_standing_decision(serde_json::json!({"name": "classify", "provider": "llm", "on_unknown": policy}));
    let catalog = Catalog::parse(&text).expect("valid");
    let expected = SendAgain {
        max_extra_charges: 2,
        max_extra_cost: Amount::from_minor(20),
        price_per_call: Amount::from_minor(10),
    };
    assert_eq!(catalog.send_again("ticket.triage"), vec![("classify".to_owned(), expected)]);
    let own =
        serde_json::json!({"name": "classify", "provider": "llm", "price_per_call_minor": 4, "on_unknown": policy});
    let catalog = Catalog::parse(&with_standing_decision(own)).expect("valid");
    assert_eq!(catalog.send_again("ticket.triage")[0].1.price_per_call, Amount::from_minor(4));
    assert!(Catalog::parse(GOOD).expect("valid").send_again("ticket.triage").is_empty(), "absent: a person decides");
}

#[test]
fn a_standing_decision_that_cannot_work_is_refused_naming_kind_step_and_field() {
    let policy = |charges: i64, cost: i64| serde_json::json!({"send_again": {"max_extra_charges": charges, "max_extra_cost_minor": cost}});
    let cases = [
        (
            serde_json::json!({"name": "classify", "provider": "llm", "on_unknown": policy(0, 20)}),
            "kind `ticket.triage` step `classify`: on_unknown.send_again.max_extra_charges: must be at least 1, not 0",
        ),
        (
            serde_json::json!({"name": "classify", "provider": "llm", "on_unknown": policy(2, 0)}),
            "kind `ticket.triage` step `classify`: on_unknown.send_again.max_extra_cost_minor: must be more than 0",
        ),
        (
            serde_json::json!({"name": "classify", "provider": "llm", "on_unknown": policy(2, -5)}),
            "-5 is not an amount in the currency's minor unit",
        ),
        (
            serde_json::json!({"name": "classify", "approval_signal": "go", "on_unknown": policy(2, 20)}),
            "kind `ticket.triage` step `classify`: on_unknown: an approval step makes no call",
        ),
        (
            serde_json::json!({"name": "classify", "provider": "llm", "price_per_call_minor": -1}),
            "-1 is not an amount in the currency's minor unit",
        ),
        (
            serde_json::json!({"name": "classify", "provider": "llm", "price_per_call_minor": 30, "on_unknown": policy(2, 20)}),
            "step `classify`: on_unknown.send_again.max_extra_cost_minor: 20 is less than one call's price (30)",
        ),
        (
            serde_json::json!({"name": "classify", "provider": "llm", "on_unknown": {"send_again": {"max_extra_charges": 2}}}),
            "max_extra_cost_minor",
        ),
    ];
    for (step, expected) in cases {
        let err = Catalog::parse(&with_standing_decision(step)).expect_err(expected).to_string();
        assert!(err.contains(expected), "{err} should mention {expected}");
    }
    let mut unpriced = standing_decision_catalogue(
        serde_json::json!({"name": "classify", "provider": "llm", "on_unknown": policy(2, 20)}),
    );
    unpriced["providers"]["llm"].as_object_mut().map(|llm| llm.remove("price_per_call_minor"));
    let err = Catalog::parse(&unpriced.to_string()).expect_err("no price").to_string();
    assert!(err.contains("step `classify`: on_unknown.send_again: needs a price_per_call_minor"), "{err}");
}

#[test]
fn prices_and_budgets_are_read_and_a_price_for_a_count_no_answer_carries_is_refused() {
    let mut catalog: serde_json::Value = serde_json::from_str(&with_dialect(
        serde_json::json!({"request": {"path": "/v1/chat/completions", "body": "{}"},
                           "answer": {"result": "/choices/0/message",
                                      "usage": {"prompt_tokens": "/usage/prompt_tokens"}}}),
        serde_json::json!({}),
    ))
    .expect("json");
    catalog["providers"]["llm"]["usage_prices"] = serde_json::json!({"prompt_tokens": 0.00025});
    catalog["providers"]["llm"]["price_per_call_minor"] = serde_json::json!(0.79);
    catalog["budgets"] = serde_json::json!({"acme": {"per_day_minor": 500}});
    let parsed = Catalog::parse(&catalog.to_string()).expect("valid");
    let llm = parsed.provider("llm").expect("llm");
    assert_eq!(llm.usage_prices["prompt_tokens"], Amount::from_micros(250));
    assert_eq!(llm.price_per_call_minor, Some(Amount::from_micros(790_000)));
    assert_eq!(parsed.budget_of("acme").map(|b| b.per_day_minor), Some(Amount::from_minor(500)));
    assert_eq!(parsed.budget_of("globex"), None);
    catalog["providers"]["llm"]["usage_prices"] = serde_json::json!({"output_tokens": 0.001});
    let err = Catalog::parse(&catalog.to_string()).expect_err("an unread count").to_string();
    assert!(
        err.contains("provider `llm`: usage_prices: `output_tokens` is no count its answers carry")
            && err.contains("names prompt_tokens"),
        "{err}"
    );
}

/// A catalogue with an OpenAI-compatible chat provider and a kind that drafts
/// from a classification.
fn with_dialect(dialect: serde_json::Value, capabilities: serde_json::Value) -> String {
    serde_json::json!({
        "providers": {
            "img": {"base_url": "http://x", "call_timeout_ms": 1000, "concurrency": 2,
                    "rate_per_second": 5, "burst": 5},
            "llm": {"base_url": "http://llm", "call_timeout_ms": 1000, "concurrency": 2,
                    "auth_header_env": "LLM_AUTHORIZATION",
                    "rate_per_second": 5, "burst": 5, "capabilities": capabilities, "dialect": dialect}
        },
        "kinds": {"ticket.triage": {"steps": [
            {"name": "classify", "provider": "img"},
            {"name": "draft", "provider": "llm"}
        ], "attempt_budget_ms": 5000}}
    })
    .to_string()
}

fn chat_dialect() -> serde_json::Value {
    serde_json::json!({
        "request": {
            "path": "/v1/chat/completions",
            "body": "{\"model\": {{ input.model | tojson }}, \"messages\": {{ input.messages | tojson }}, \"user\": {{ steps.classify.uri | tojson }}}"
        },
        "answer": {"request_id": "/id", "result": "/choices/0/message", "error_type": "/error/type",
                   "error_classes": {"insufficient_quota": "not_authorised"},
                   "statuses": {"throttled": [429]}},
        "throttling": {"reset_headers": ["x-ratelimit-reset-requests"]}
    })
}

#[test]
fn a_dialect_is_optional_and_checked_at_load() {
    assert!(Catalog::parse(GOOD).expect("valid").provider("img").expect("img").dialect.is_none());
    let mut dialect = chat_dialect();
    dialect["answer"]["statuses"] = serde_json::json!({});
    let catalog = Catalog::parse(&with_dialect(dialect, serde_json::json!({}))).expect("valid");
    let llm = catalog.provider("llm").expect("llm");
    let spec = llm.dialect.as_ref().expect("a dialect");
    assert_eq!(spec.request.method, "POST");
    assert_eq!(spec.max_inline_result_bytes, 1024 * 1024);
    assert_eq!(spec.error_classes().get("insufficient_quota"), Some(&ErrorClass::NotAuthorised));
    let overrides = llm.overrides();
    assert_eq!(overrides.get(&429), Some(&ErrorClass::Throttled));
    assert_eq!(overrides.get(&422), Some(&ErrorClass::Rejected));
    assert_eq!(overrides.get(&402), Some(&ErrorClass::NotAuthorised));
    assert_eq!(catalog.steps_before_calls_to("llm"), vec![BTreeSet::from(["classify"])]);
}

#[test]
fn a_dialect_that_does_not_check_out_is_refused_naming_provider_field_and_reason() {
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut dialect = chat_dialect();
        f(&mut dialect);
        dialect
    };
    let none = serde_json::json!({});
    let cases = [
        (
            edit(&|d| d["request"]["path"] = "/v1/{{ input.model ".into()),
            none.clone(),
            "dialect.request.path: the template does not parse",
        ),
        (
            edit(&|d| d["request"]["headers"] = serde_json::json!({"X-Draft": "{{ steps.draft.content }}"})),
            none.clone(),
            "dialect.request.headers.X-Draft: the template reads `steps.draft`",
        ),
        (edit(&|d| d["request"]["body"] = "{{ steps.nope | tojson }}".into()), none.clone(), "reads `steps.nope`"),
        (
            edit(&|d| d["answer"]["result"] = "choices/0".into()),
            none.clone(),
            "dialect.answer.result: `choices/0` is not a JSON pointer",
        ),
        (
            edit(&|d| d["answer"]["request_id"] = "/a~2b".into()),
            none.clone(),
            "dialect.answer.request_id: `/a~2b` is not a JSON pointer",
        ),
        (
            chat_dialect(),
            serde_json::json!({"idempotency_keys": true}),
            "dialect.idempotency_header: the provider claims `idempotency_keys`",
        ),
        (
            edit(&|d| d["answer"]["error_classes"]["server_error"] = "fine".into()),
            none.clone(),
            "dialect.answer.error_classes.server_error",
        ),
        (edit(&|d| d["request"]["form"] = serde_json::json!({"a": "b"})), none.clone(), "not both"),
        (
            edit(&|d| d["answer"]["statuses"] = serde_json::json!({"throttled": [429, 400]})),
            none.clone(),
            "throttled: 400 is also listed under `rejected`",
        ),
        (edit(&|d| d["poll"] = serde_json::json!({})), none.clone(), "dialect.poll: needs `url`"),
        (
            edit(&|d| d["request"]["headers"] = serde_json::json!({"authorization": "Bearer {{ input.k }}"})),
            none.clone(),
            "the credential comes from auth_header_env",
        ),
        // A dialect's throttled 503 is an override like any other: only a declared-safe 5xx may have it.
        (
            edit(&|d| d["answer"]["statuses"]["throttled"] = serde_json::json!([429, 503])),
            none.clone(),
            "maps 503 to `throttled`",
        ),
    ];
    for (dialect, capabilities, expected) in cases {
        let text = with_dialect(dialect, capabilities);
        let err = Catalog::parse(&text).expect_err(expected).to_string();
        assert!(err.contains("provider `llm`") && err.contains(expected), "{err} should mention {expected}");
    }
}

#[test]
fn json_pointers_follow_rfc_6901() {
    use crate::dialect::is_json_pointer;
    for good in ["", "/", "/choices/0/message", "/a~0b/c~1d", "/error/type"] {
        assert!(is_json_pointer(good), "{good}");
    }
    for bad in ["choices", "/a~", "/a~2", "#/a"] {
        assert!(!is_json_pointer(bad), "{bad}");
    }
}
