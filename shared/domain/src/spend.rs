//! What paid calls cost and whether a tenant may start another: amounts of money,
//! a call's cost from the catalogue's prices and the answer's usage, and the daily
//! budget a tenant's new paid calls wait behind (docs/catalog.md, "Prices, spend and
//! budgets").

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Number;

/// Millionths of the currency's minor unit in one minor unit (a cent).
const MICROS_PER_MINOR: i64 = 1_000_000;

/// An amount of money, held as millionths of the currency's minor unit so that a
/// price per token (a fraction of a cent) adds up exactly. Written in the catalogue
/// and shown as minor units with up to six decimals: `12`, `0.79`, `0.00025`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(try_from = "Number", into = "Number")]
pub struct Amount(i64);

impl Amount {
    pub const ZERO: Amount = Amount(0);

    /// The amount of `micros` millionths of the minor unit.
    pub const fn from_micros(micros: i64) -> Self {
        Amount(micros)
    }

    /// The amount of `minor` whole minor units.
    pub const fn from_minor(minor: i64) -> Self {
        Amount(minor.saturating_mul(MICROS_PER_MINOR))
    }

    pub const fn micros(self) -> i64 {
        self.0
    }

    /// In minor units, for a metric (a float, as Prometheus counts).
    pub fn as_minor_f64(self) -> f64 {
        self.0 as f64 / MICROS_PER_MINOR as f64
    }

    pub fn saturating_add(self, other: Amount) -> Amount {
        Amount(self.0.saturating_add(other.0))
    }

    pub fn saturating_mul(self, times: u64) -> Amount {
        Amount(self.0.saturating_mul(i64::try_from(times).unwrap_or(i64::MAX)))
    }
}

/// A number that is no amount of money: negative, not finite, beyond range, or
/// finer than a millionth of the minor unit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0} is not an amount in the currency's minor unit (at least 0, at most six decimals)")]
pub struct NotAnAmount(pub String);

impl TryFrom<Number> for Amount {
    type Error = NotAnAmount;

    fn try_from(number: Number) -> Result<Self, Self::Error> {
        let refused = || NotAnAmount(number.to_string());
        if let Some(whole) = number.as_i64() {
            return (whole >= 0).then(|| whole.checked_mul(MICROS_PER_MINOR)).flatten().map(Amount).ok_or_else(refused);
        }
        let minor = number.as_f64().filter(|m| m.is_finite() && *m >= 0.0).ok_or_else(refused)?;
        let micros = minor * MICROS_PER_MINOR as f64;
        if micros > i64::MAX as f64 / 2.0 || (micros - micros.round()).abs() > 1e-3 {
            return Err(refused());
        }
        Ok(Amount(micros.round() as i64))
    }
}

impl From<Amount> for Number {
    fn from(amount: Amount) -> Number {
        if amount.0 % MICROS_PER_MINOR == 0 {
            return Number::from(amount.0 / MICROS_PER_MINOR);
        }
        Number::from_f64(amount.as_minor_f64()).unwrap_or_else(|| Number::from(0))
    }
}

impl fmt::Display for Amount {
    /// Minor units, with the decimals it has and no more: `12`, `0.79`, `-3.5`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let micros = self.0.unsigned_abs();
        let (whole, fraction) = (micros / MICROS_PER_MINOR as u64, micros % MICROS_PER_MINOR as u64);
        if fraction == 0 {
            return write!(f, "{sign}{whole}");
        }
        let decimals = format!("{fraction:06}");
        write!(f, "{sign}{whole}.{}", decimals.trim_end_matches('0'))
    }
}

/// What one call that did its work cost, as the catalogue prices it: the price per
/// call plus each usage count the answer reported (tokens, by the name the
/// dialect gives it) times its price per unit. `None` when the call has no price
/// at all. A priced count the answer did not carry adds nothing, and is named in
/// `unread` so that the caller can say so.
pub fn cost(
    per_call: Option<Amount>,
    unit_prices: &BTreeMap<String, Amount>,
    usage: &BTreeMap<String, u64>,
) -> Option<Cost> {
    if per_call.is_none() && unit_prices.is_empty() {
        return None;
    }
    let mut cost = Cost { amount: per_call.unwrap_or(Amount::ZERO), unread: Vec::new() };
    for (name, price) in unit_prices {
        match usage.get(name) {
            Some(units) => cost.amount = cost.amount.saturating_add(price.saturating_mul(*units)),
            None => cost.unread.push(name.clone()),
        }
    }
    Some(cost)
}

/// A call's cost, and the usage counts its answer did not carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cost {
    pub amount: Amount,
    pub unread: Vec<String>,
}

/// A tenant's daily budget for paid calls (UTC days).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// What the tenant's calls may cost in one UTC day, in the currency's minor unit.
    pub per_day_minor: Amount,
}

/// Whether a tenant that has spent `spent` today may start another paid call: `Err`
/// holds the reason its tasks show while they wait. Calls already started finish,
/// so a day's spend may pass the budget by what was in flight when it was reached.
pub fn may_start_a_paid_call(tenant: &str, budget: Option<&Budget>, spent: Amount) -> Result<(), String> {
    let Some(budget) = budget else { return Ok(()) };
    if spent < budget.per_day_minor {
        return Ok(());
    }
    Err(format!(
        "{BUDGET_SPENT_OPENING} `{tenant}` spent: {spent} of {} today (UTC), in the currency's minor unit",
        budget.per_day_minor
    ))
}

/// The opening of every reason a task waits behind its tenant's budget.
///
/// Do not change: readers (tests, people searching timelines) recognise it by its opening.
pub const BUDGET_SPENT_OPENING: &str = "waiting: budget of tenant";

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::*;

    fn amount(value: Value) -> Result<Amount, serde_json::Error> {
        serde_json::from_value(value)
    }

    #[test]
    fn amounts_are_read_in_minor_units_to_six_decimals() {
        assert_eq!(amount(json!(12)).expect("whole"), Amount::from_minor(12));
        assert_eq!(amount(json!(0.79)).expect("fraction"), Amount::from_micros(790_000));
        assert_eq!(amount(json!(0.00025)).expect("per token"), Amount::from_micros(250));
        for refused in [json!(-1), json!(-0.5), json!(0.0000001), json!("12"), json!(1e300)] {
            assert!(amount(refused.clone()).is_err(), "{refused} was taken as an amount");
        }
    }

    #[test]
    fn amounts_read_as_they_are_written() {
        for (micros, shown) in [(0, "0"), (12_000_000, "12"), (790_000, "0.79"), (250, "0.00025"), (-3_500_000, "-3.5")]
        {
            assert_eq!(Amount::from_micros(micros).to_string(), shown);
        }
        let back: Amount =
            serde_json::from_value(serde_json::to_value(Amount::from_micros(790_000)).expect("json")).expect("amount");
        assert_eq!(back, Amount::from_micros(790_000));
        assert_eq!(serde_json::to_value(Amount::from_minor(7)).expect("json"), json!(7));
    }

    fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
        pairs.iter().map(|(name, n)| ((*name).to_owned(), *n)).collect()
    }

    #[test]
    fn a_call_costs_its_price_plus_its_usage() {
        let prices: BTreeMap<String, Amount> = [
            ("prompt_tokens".to_owned(), Amount::from_micros(250)),
            ("completion_tokens".to_owned(), Amount::from_micros(1_000)),
        ]
        .into();
        let usage = counts(&[("prompt_tokens", 19), ("completion_tokens", 10), ("total_tokens", 29)]);
        let cost = cost(Some(Amount::from_minor(1)), &prices, &usage).expect("priced");
        assert_eq!(cost.amount, Amount::from_micros(1_000_000 + 19 * 250 + 10 * 1_000));
        assert!(cost.unread.is_empty());
    }

    #[test]
    fn an_unpriced_call_has_no_cost_and_missing_usage_is_named() {
        assert_eq!(cost(None, &BTreeMap::new(), &counts(&[("input_tokens", 5)])), None);
        let prices: BTreeMap<String, Amount> = [("input_tokens".to_owned(), Amount::from_micros(300))].into();
        let cost = cost(None, &prices, &BTreeMap::new()).expect("priced");
        assert_eq!(cost, Cost { amount: Amount::ZERO, unread: vec!["input_tokens".into()] });
    }

    #[test]
    fn a_budget_holds_new_calls_once_spent() {
        let budget = Budget { per_day_minor: Amount::from_minor(30) };
        assert!(may_start_a_paid_call("acme", None, Amount::from_minor(1_000)).is_ok());
        assert!(may_start_a_paid_call("acme", Some(&budget), Amount::from_micros(29_999_999)).is_ok());
        let reason = may_start_a_paid_call("acme", Some(&budget), Amount::from_minor(30)).expect_err("spent");
        assert!(reason.starts_with(BUDGET_SPENT_OPENING), "{reason}");
        assert!(reason.contains("tenant `acme` spent: 30 of 30 today"), "{reason}");
    }

    proptest! {
        /// Whatever is written with up to six decimals reads back as the same amount.
        #[test]
        fn an_amount_survives_its_json(micros in 0i64..1_000_000_000_000) {
            let amount = Amount::from_micros(micros);
            let back: Amount = serde_json::from_value(serde_json::to_value(amount).expect("json")).expect("amount");
            prop_assert_eq!(back, amount);
        }
    }
}
