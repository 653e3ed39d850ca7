//! The HTTP endpoints on `PORT`: `/healthcheck`, `/metrics`, `/json` and `/rlconfig`, as
//! envoyproxy/ratelimit serves them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Map, Value, json};
use tollgate::backend::Backend;
use tollgate::rls::RlsService;
use tollgate::rls::envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor::Entry,
};
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, rate_limit::Unit,
};
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use tollgate::rls::envoy_types::pb::envoy::service::ratelimit::v3::{
    RateLimitRequest, RateLimitResponse,
};
use tollgate::rls::envoy_types::pb::google::protobuf::UInt64Value;

use crate::rules::SharedRules;
use crate::store::{StoreHealth, StoreState};

/// What the endpoints read: the rules' state, the store's, whether the server drains.
pub(crate) struct Status {
    pub(crate) rules: SharedRules,
    pub(crate) store: Arc<StoreHealth>,
    pub(crate) draining: AtomicBool,
    pub(crate) prometheus: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

impl Status {
    /// Whether the server should get traffic, and what to say about it: the rules loaded, the
    /// store answering or the failure policy able to decide without it, not draining.
    pub(crate) fn health(&self) -> (bool, String) {
        if self.draining.load(Ordering::Relaxed) {
            return (false, "draining: the server stops soon\n".to_owned());
        }
        let (loaded, rules_error) = {
            let r = self.rules.lock().unwrap_or_else(|e| e.into_inner());
            (r.loaded.is_some(), r.error.clone())
        };
        if !loaded {
            let why = rules_error.unwrap_or_else(|| "not read yet".to_owned());
            return (false, format!("rules not loaded: {why}\n"));
        }
        let mut body = String::new();
        let ok = self.store.usable();
        body.push_str(if ok { "OK\n" } else { "store down\n" });
        if let StoreState::Down(why) = self.store.state() {
            body.push_str(&format!(
                "store {}: {why}; ON_FAILURE={} decides meanwhile\n",
                self.store.name,
                self.store.on_failure.as_str()
            ));
        }
        if let Some(e) = rules_error {
            body.push_str(&format!(
                "rules changed but not reloaded (old rules kept): {e}\n"
            ));
        }
        (ok, body)
    }
}

struct AppState<B: Backend> {
    status: Arc<Status>,
    service: RlsService<B>,
}

/// The endpoints' router.
pub(crate) fn router<B: Backend>(status: Arc<Status>, service: RlsService<B>) -> Router {
    let state = Arc::new(AppState { status, service });
    Router::new()
        .route("/healthcheck", get(healthcheck::<B>))
        .route("/metrics", get(metrics::<B>))
        .route("/json", post(json_rls::<B>))
        .route("/rlconfig", get(rlconfig::<B>))
        .with_state(state)
}

async fn healthcheck<B: Backend>(State(s): State<Arc<AppState<B>>>) -> Response {
    let (ok, body) = s.status.health();
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, [(header::CONTENT_TYPE, "text/plain")], body).into_response()
}

async fn metrics<B: Backend>(State(s): State<Arc<AppState<B>>>) -> Response {
    match &s.status.prometheus {
        Some(handle) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            handle.render(),
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "USE_PROMETHEUS=false\n").into_response(),
    }
}

async fn rlconfig<B: Backend>(State(s): State<Arc<AppState<B>>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain")],
        crate::rules::describe(&s.service.configs()),
    )
        .into_response()
}

/// `POST /json`: a `RateLimitRequest` in protobuf's JSON mapping, answered with the
/// `RateLimitResponse` in the same mapping: `200` when `OK`, `429` when `OVER_LIMIT`, `400`
/// for a request that cannot be read, `503` when the store cannot decide and the failure
/// policy is `closed`.
async fn json_rls<B: Backend>(State(s): State<Arc<AppState<B>>>, body: Bytes) -> Response {
    let request = match serde_json::from_slice::<Value>(&body)
        .map_err(|e| e.to_string())
        .and_then(|v| request_from_json(&v))
    {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    match s
        .service
        .should_rate_limit(tonic::Request::new(request))
        .await
    {
        Ok(answer) => {
            let answer = answer.into_inner();
            let code = if answer.overall_code == Code::OverLimit as i32 {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            (
                code,
                [(header::CONTENT_TYPE, "application/json")],
                response_to_json(&answer).to_string(),
            )
                .into_response()
        }
        Err(status) => {
            let code = match status.code() {
                tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            (code, format!("{}\n", status.message())).into_response()
        }
    }
}

/// A number in protobuf's JSON mapping: a number, or a string holding one (64-bit integers).
fn number(v: &Value, field: &str) -> Result<u64, String> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
    .ok_or_else(|| format!("{field}: not a non-negative integer"))
}

/// Reads a field by its JSON name (`hitsAddend`) or its proto name (`hits_addend`).
fn field<'a>(o: &'a Map<String, Value>, json: &str, proto: &str) -> Option<&'a Value> {
    o.get(json).or_else(|| o.get(proto))
}

fn text(v: Option<&Value>, field: &str) -> Result<String, String> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(format!("{field}: not a string")),
    }
}

pub(crate) fn request_from_json(v: &Value) -> Result<RateLimitRequest, String> {
    let o = v.as_object().ok_or("the request is not a JSON object")?;
    let descriptors = match o.get("descriptors") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => (items.iter().enumerate())
            .map(|(i, d)| descriptor_from_json(d, i))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err("descriptors: not a list".to_owned()),
    };
    let hits_addend = match field(o, "hitsAddend", "hits_addend") {
        None | Some(Value::Null) => 0,
        Some(n) => u32::try_from(number(n, "hitsAddend")?)
            .map_err(|_| "hitsAddend: more than 2^32 - 1".to_owned())?,
    };
    Ok(RateLimitRequest {
        domain: text(o.get("domain"), "domain")?,
        descriptors,
        hits_addend,
    })
}

fn descriptor_from_json(v: &Value, i: usize) -> Result<RateLimitDescriptor, String> {
    let o = v
        .as_object()
        .ok_or_else(|| format!("descriptors[{i}]: not an object"))?;
    let entries = match o.get("entries") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => (items.iter().enumerate())
            .map(|(j, e)| {
                let at = format!("descriptors[{i}].entries[{j}]");
                let e = e
                    .as_object()
                    .ok_or_else(|| format!("{at}: not an object"))?;
                Ok(Entry {
                    key: text(e.get("key"), &format!("{at}.key"))?,
                    value: text(e.get("value"), &format!("{at}.value"))?,
                })
            })
            .collect::<Result<_, String>>()?,
        Some(_) => return Err(format!("descriptors[{i}].entries: not a list")),
    };
    let hits_addend = match field(o, "hitsAddend", "hits_addend") {
        None | Some(Value::Null) => None,
        Some(n) => Some(UInt64Value {
            value: number(n, &format!("descriptors[{i}].hitsAddend"))?,
        }),
    };
    Ok(RateLimitDescriptor {
        entries,
        hits_addend,
        ..Default::default()
    })
}

fn code_name(code: i32) -> &'static str {
    Code::try_from(code).unwrap_or(Code::Unknown).as_str_name()
}

/// The response in protobuf's JSON mapping (fields with their default value left out, as
/// the mapping leaves them out).
pub(crate) fn response_to_json(r: &RateLimitResponse) -> Value {
    let mut out = Map::new();
    out.insert("overallCode".into(), json!(code_name(r.overall_code)));
    let statuses: Vec<Value> = (r.statuses.iter())
        .map(|s| {
            let mut o = Map::new();
            o.insert("code".into(), json!(code_name(s.code)));
            if let Some(l) = &s.current_limit {
                let mut limit = Map::new();
                if !l.name.is_empty() {
                    limit.insert("name".into(), json!(l.name));
                }
                limit.insert("requestsPerUnit".into(), json!(l.requests_per_unit));
                let unit = Unit::try_from(l.unit).unwrap_or(Unit::Unknown);
                limit.insert("unit".into(), json!(unit.as_str_name()));
                o.insert("currentLimit".into(), Value::Object(limit));
            }
            if s.limit_remaining != 0 {
                o.insert("limitRemaining".into(), json!(s.limit_remaining));
            }
            if let Some(d) = &s.duration_until_reset {
                o.insert(
                    "durationUntilReset".into(),
                    json!(proto_duration(d.seconds, d.nanos)),
                );
            }
            Value::Object(o)
        })
        .collect();
    if !statuses.is_empty() {
        out.insert("statuses".into(), Value::Array(statuses));
    }
    let headers: Vec<Value> = (r.response_headers_to_add.iter())
        .map(|h| json!({"key": h.key, "value": h.value}))
        .collect();
    if !headers.is_empty() {
        out.insert("responseHeadersToAdd".into(), Value::Array(headers));
    }
    Value::Object(out)
}

/// A `google.protobuf.Duration` as its JSON mapping writes it: `"1.500s"`, `"3s"`.
fn proto_duration(seconds: i64, nanos: i32) -> String {
    if nanos == 0 {
        return format!("{seconds}s");
    }
    let frac = format!("{:09}", nanos.unsigned_abs());
    let frac = if frac.ends_with("000000") {
        &frac[..3]
    } else if frac.ends_with("000") {
        &frac[..6]
    } else {
        &frac[..]
    };
    format!("{seconds}.{frac}s")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_mapping_both_spellings() {
        let r = request_from_json(&json!({
            "domain": "edge",
            "descriptors": [
                {"entries": [{"key": "remote_address", "value": "10.0.0.1"}], "hits_addend": "3"},
                {"entries": [{"key": "k"}]}
            ],
            "hitsAddend": 2
        }))
        .unwrap();
        assert_eq!(r.domain, "edge");
        assert_eq!(r.hits_addend, 2);
        assert_eq!(r.descriptors[0].entries[0].value, "10.0.0.1");
        assert_eq!(
            r.descriptors[0].hits_addend.as_ref().map(|h| h.value),
            Some(3)
        );
        assert_eq!(r.descriptors[1].entries[0].value, "");
        for bad in [
            json!([]),
            json!({"descriptors": {}}),
            json!({"descriptors": [{"entries": [{"key": 1}]}]}),
            json!({"hitsAddend": -1}),
            json!({"hitsAddend": 5_000_000_000u64}),
        ] {
            assert!(request_from_json(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(proto_duration(3, 0), "3s");
        assert_eq!(proto_duration(1, 500_000_000), "1.500s");
        assert_eq!(proto_duration(0, 1_000), "0.000001s");
        assert_eq!(proto_duration(0, 7), "0.000000007s");
    }
}
