//! The dashboard's page (docs/dashboard.md): plain HTML, CSS and JavaScript built
//! into the binary, served at `/ui` with a strict Content-Security-Policy. The page
//! signs in with a bearer token and reads only the API, as any client would.

use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpResponse, web};

const INDEX_HTML: &str = include_str!("../ui/index.html");
const APP_JS: &str = include_str!("../ui/app.js");
const APP_CSS: &str = include_str!("../ui/app.css");

/// No inline script or style, nothing from elsewhere, no framing, no base or form
/// target of another origin: data the page shows can never run as code.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'; form-action 'self'";

/// The headers every dashboard response carries.
pub fn harden(response: &mut HttpResponse) {
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
        (header::HeaderName::from_static("cross-origin-opener-policy"), "same-origin"),
        (header::HeaderName::from_static("cross-origin-resource-policy"), "same-origin"),
        (header::HeaderName::from_static("permissions-policy"), "camera=(), microphone=(), geolocation=()"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
}

fn file(content_type: &'static str, body: &'static str) -> HttpResponse {
    let mut response = HttpResponse::Ok().content_type(content_type).body(body);
    harden(&mut response);
    response
}

async fn index() -> HttpResponse {
    file("text/html; charset=utf-8", INDEX_HTML)
}

async fn script() -> HttpResponse {
    file("text/javascript; charset=utf-8", APP_JS)
}

async fn style() -> HttpResponse {
    file("text/css; charset=utf-8", APP_CSS)
}

/// `/ui`, `/ui/`, `/ui/app.js` and `/ui/app.css`; any other method answers `405`.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(crate::routes::resource("/ui", "GET").route(web::get().to(index)))
        .service(crate::routes::resource("/ui/", "GET").route(web::get().to(index)))
        .service(crate::routes::resource("/ui/app.js", "GET").route(web::get().to(script)))
        .service(crate::routes::resource("/ui/app.css", "GET").route(web::get().to(style)));
}
