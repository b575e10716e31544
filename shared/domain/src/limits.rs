//! Rate limits as a pure token bucket: the scheduler keeps the bucket in a row that
//! every instance shares, and asks this module what one more call costs.

use crate::lifecycle::Micros;

/// Takes one token from a bucket holding `tokens` at `refilled_at`, filling at
/// `rate` per second up to `burst`. Returns the tokens left and, when the bucket is
/// empty, how many microseconds until the next token (nothing was taken then).
pub fn take_token(tokens: f64, refilled_at: Micros, rate: f64, burst: f64, now: Micros) -> (f64, Option<Micros>) {
    let elapsed = (now.saturating_sub(refilled_at)).max(0) as f64 / 1_000_000.0;
    let available = (tokens + elapsed * rate).min(burst);
    if available >= 1.0 {
        (available - 1.0, None)
    } else {
        let wait = ((1.0 - available) / rate * 1_000_000.0).ceil() as Micros;
        (available, Some(wait.max(1)))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_full_bucket_allows_its_burst_then_one_per_interval() {
        let (mut tokens, mut at) = (3.0, 0);
        for _ in 0..3 {
            let (left, wait) = take_token(tokens, at, 2.0, 3.0, 0);
            assert_eq!(wait, None);
            (tokens, at) = (left, 0);
        }
        let (_, wait) = take_token(tokens, at, 2.0, 3.0, 0);
        assert_eq!(wait, Some(500_000), "at 2 per second the next token comes in 0.5 s");
        let (left, wait) = take_token(tokens, at, 2.0, 3.0, 500_000);
        assert_eq!((left, wait), (0.0, None));
    }

    proptest! {
        /// However calls are spaced, no window of T seconds admits more than burst + rate * T.
        #[test]
        fn never_more_than_burst_plus_rate(gaps in prop::collection::vec(0i64..400_000, 1..300)) {
            let (rate, burst) = (5.0, 2.0);
            let (mut tokens, mut at, mut now, mut admitted) = (burst, 0i64, 0i64, 0u32);
            for gap in gaps {
                now += gap;
                let (left, wait) = take_token(tokens, at, rate, burst, now);
                tokens = left;
                at = now;
                if wait.is_none() {
                    admitted += 1;
                }
            }
            let allowed = burst + rate * now as f64 / 1_000_000.0;
            prop_assert!(f64::from(admitted) <= allowed + 1e-9, "{admitted} > {allowed}");
        }
    }
}
