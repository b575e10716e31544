//! The fake provider's admin routes, for tests and the demo: the calls it
//! received, its ledger, its capabilities and its misbehaviour rules.

use actix_web::{HttpResponse, web};

use super::protocol::KeyQuery;
use super::{Call, Capabilities, Ledger, Rule, Shared, State};

pub(crate) async fn calls(shared: web::Data<Shared>, query: web::Query<KeyQuery>) -> HttpResponse {
    let state = shared.lock();
    let calls: Vec<&Call> = state
        .calls
        .iter()
        .filter(|c| query.operation_key.as_ref().is_none_or(|k| c.operation_key.as_ref() == Some(k)))
        .collect();
    HttpResponse::Ok().json(calls)
}

pub(crate) async fn ledger(shared: web::Data<Shared>) -> HttpResponse {
    let state = shared.lock();
    let total_cents = state.charges.iter().map(|c| c.cents).sum();
    HttpResponse::Ok().json(Ledger { charges: state.charges.clone(), total_cents })
}

pub(crate) async fn set_capabilities(shared: web::Data<Shared>, body: web::Json<Capabilities>) -> HttpResponse {
    shared.lock().capabilities = body.into_inner();
    HttpResponse::NoContent().finish()
}

pub(crate) async fn add_rule(shared: web::Data<Shared>, body: web::Json<Rule>) -> HttpResponse {
    shared.lock().rules.push(body.into_inner());
    HttpResponse::NoContent().finish()
}

pub(crate) async fn clear_rules(shared: web::Data<Shared>) -> HttpResponse {
    shared.lock().rules.clear();
    HttpResponse::NoContent().finish()
}

/// Forgets every operation key, as a provider does once its idempotency window
/// has passed: the same key again is new work, charged again.
pub(crate) async fn forget_keys(shared: web::Data<Shared>) -> HttpResponse {
    shared.lock().by_key.clear();
    HttpResponse::NoContent().finish()
}

pub(crate) async fn reset(shared: web::Data<Shared>) -> HttpResponse {
    let mut state = shared.lock();
    let capabilities = state.capabilities;
    *state = State { capabilities, ..State::default() };
    HttpResponse::NoContent().finish()
}
