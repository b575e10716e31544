//! Admission control: what intake refuses before it does any work for a request,
//! so that a flood degrades into quick, well-formed refusals instead of a queue
//! without bound (docs/intake.md, "Admission"). A body over the limit is refused by
//! its `Content-Length` before anything reads it (`413`); past the in-flight cap a
//! request is refused at once (`503`, `Retry-After`); each tenant's requests draw
//! from a token bucket of its own (`429`, `Retry-After`).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::web;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};
use tokio::sync::Semaphore;

use crate::auth::Tenant;
use crate::problem::ApiError;

/// How long a client refused for the in-flight cap is asked to wait.
pub const OVERLOADED_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Intake's admission settings.
#[derive(Debug, Clone, clap::Args)]
pub struct AdmissionConfig {
    /// Requests one tenant may make per second, sustained (the token bucket's
    /// refill rate); fractions allowed.
    #[arg(long = "tenant-rate-per-second", env = "FENCELINE_INTAKE_TENANT_RATE_PER_SECOND", default_value_t = 200.0)]
    pub tenant_rate_per_second: f64,

    /// Requests one tenant may make at once above the rate (the bucket's size).
    #[arg(long = "tenant-burst", env = "FENCELINE_INTAKE_TENANT_BURST", default_value_t = 400)]
    pub tenant_burst: u32,

    /// Requests this instance serves at once; any more are answered `503` at once.
    #[arg(long = "max-in-flight", env = "FENCELINE_INTAKE_MAX_IN_FLIGHT", default_value_t = 512)]
    pub max_in_flight: usize,
}

/// The limits in force, shared by the handlers of one intake instance.
#[derive(Debug, Clone)]
pub struct Admission {
    tenants: Arc<DefaultKeyedRateLimiter<String>>,
    clock: DefaultClock,
    in_flight: Arc<Semaphore>,
    body_limit: usize,
}

impl Admission {
    /// The limits of `config`, with bodies up to `body_limit` bytes.
    pub fn new(config: &AdmissionConfig, body_limit: usize) -> Result<Self, String> {
        let rate = config.tenant_rate_per_second;
        if !(rate.is_finite() && rate > 0.0) {
            return Err(format!("FENCELINE_INTAKE_TENANT_RATE_PER_SECOND must be above 0, not {rate}"));
        }
        let burst = NonZeroU32::new(config.tenant_burst)
            .ok_or_else(|| "FENCELINE_INTAKE_TENANT_BURST must be at least 1".to_owned())?;
        if config.max_in_flight == 0 {
            return Err("FENCELINE_INTAKE_MAX_IN_FLIGHT must be at least 1".into());
        }
        let quota = Quota::with_period(Duration::from_secs_f64(1.0 / rate))
            .ok_or_else(|| format!("FENCELINE_INTAKE_TENANT_RATE_PER_SECOND {rate} is too high"))?
            .allow_burst(burst);
        Ok(Self {
            tenants: Arc::new(DefaultKeyedRateLimiter::dashmap(quota)),
            clock: DefaultClock::default(),
            in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
            body_limit,
        })
    }

    /// Takes one token from the tenant's bucket, or says how long until one is there.
    pub fn admit(&self, tenant: &Tenant) -> Result<(), ApiError> {
        self.tenants.check_key(&tenant.as_str().to_owned()).map_err(|not_until| {
            let wait = not_until.wait_time_from(self.clock.now());
            ApiError::TooManyRequests { tenant: tenant.as_str().to_owned(), retry_after: wait }
        })
    }

    /// Forgets the buckets that are full again, so idle tenants cost no memory.
    pub fn forget_idle_tenants(&self) {
        self.tenants.retain_recent();
        self.tenants.shrink_to_fit();
    }
}

/// The middleware of the API's scope: refuses a body announced over the limit and
/// a request past the in-flight cap, before any handler (or the token look-up) runs.
pub async fn guard(
    request: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let Some(admission) = request.app_data::<web::Data<Admission>>().cloned() else {
        return next.call(request).await.map(ServiceResponse::map_into_left_body);
    };
    let announced = request
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(length) = announced
        && length > admission.body_limit as u64
    {
        let refused = ApiError::PayloadTooLarge(format!(
            "body of {length} bytes is over the limit of {} bytes",
            admission.body_limit
        ));
        return Ok(request.error_response(refused).map_into_right_body());
    }
    // Held until the handler answered; a streamed answer (the event stream) does
    // not hold it while it streams.
    let Ok(_permit) = admission.in_flight.clone().try_acquire_owned() else {
        return Ok(request.error_response(ApiError::Overloaded).map_into_right_body());
    };
    next.call(request).await.map(ServiceResponse::map_into_left_body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(rate: f64, burst: u32, max_in_flight: usize) -> AdmissionConfig {
        AdmissionConfig { tenant_rate_per_second: rate, tenant_burst: burst, max_in_flight }
    }

    #[test]
    fn a_tenant_gets_its_burst_then_waits_and_others_are_unaffected() {
        let admission = Admission::new(&config(1.0, 3, 8), 1024).expect("valid");
        let (acme, globex) = (Tenant::parse("acme").expect("t"), Tenant::parse("globex").expect("t"));
        for _ in 0..3 {
            assert!(admission.admit(&acme).is_ok());
        }
        match admission.admit(&acme) {
            Err(ApiError::TooManyRequests { retry_after, .. }) => {
                assert!(retry_after > Duration::ZERO && retry_after <= Duration::from_secs(1), "{retry_after:?}")
            }
            other => panic!("the fourth request is refused, not {other:?}"),
        }
        assert!(admission.admit(&globex).is_ok(), "another tenant has a bucket of its own");
    }

    #[test]
    fn nonsense_limits_are_refused() {
        assert!(Admission::new(&config(0.0, 1, 1), 1).is_err());
        assert!(Admission::new(&config(f64::NAN, 1, 1), 1).is_err());
        assert!(Admission::new(&config(1.0, 0, 1), 1).is_err());
        assert!(Admission::new(&config(1.0, 1, 0), 1).is_err());
        assert!(Admission::new(&config(0.5, 1, 1), 1).is_ok(), "one request every two seconds");
    }
}
