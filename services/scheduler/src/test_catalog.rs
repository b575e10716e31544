//! The catalogue the scheduler's unit tests share: two providers and a kind that
//! calls both in one attempt.

use fenceline_config::catalog::Catalog;

/// `img` and `llm`, and `image.caption`, which calls `img` (step `draw`), then
/// `llm` (step `caption`).
pub(crate) fn draw_then_caption() -> Catalog {
    Catalog::parse(
        r#"{
        "providers": {"img": {"base_url": "http://x", "call_timeout_ms": 1000, "concurrency": 2,
                              "rate_per_second": 5, "burst": 5},
                      "llm": {"base_url": "http://y", "call_timeout_ms": 1000, "concurrency": 2,
                              "rate_per_second": 5, "burst": 5}},
        "kinds": {"image.caption": {"steps": [{"name": "draw", "provider": "img"},
                                              {"name": "caption", "provider": "llm"}],
                                    "attempt_budget_ms": 5000}}
    }"#,
    )
    .expect("a valid catalogue")
}
