//! The rate limit service protocol of the [`RlsBackend`](super::RlsBackend): a decision as a
//! `ShouldRateLimit` call, the answer as a decision.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use tonic::transport::{Channel, Endpoint};

use super::{Descriptors, PassHeaders, descriptor, key_value};
use crate::backend::remote::{CallError, Job, Options, StoreFailure};
use crate::backend::{Decision, Mode, Outcome, QuotaState};
use crate::quota::QuotaParams;
use crate::{BackendError, BackendErrorKind, ConfigError, Policy};

/// The longest reset read from an answer: a server's years are an hour (a refusal is cached
/// and `Retry-After` counted from it, never longer).
pub(crate) const MAX_RESET: Duration = Duration::from_secs(3600);

type Client = RateLimitServiceClient<Channel>;

pub(crate) struct RlsStore {
    /// The targets as given (`http://host:port`).
    urls: Vec<String>,
    /// The targets for logs: comma-separated.
    pub(crate) endpoint: String,
    pub(crate) domain: String,
    descriptors: Option<Descriptors>,
    negative_hits: bool,
    pass: PassHeaders,
    connect_timeout: Duration,
    /// The channel over every address of the targets, made at the first call and again after
    /// [`reconnect`](crate::backend::remote::Store::reconnect).
    client: ArcSwapOption<Client>,
}

impl RlsStore {
    pub(crate) fn new(
        urls: Vec<String>,
        domain: String,
        descriptors: Option<Descriptors>,
        negative_hits: bool,
        pass: PassHeaders,
        opts: &Options,
    ) -> Result<Self, ConfigError> {
        if urls.is_empty() {
            return Err(ConfigError::Invalid {
                option: "url",
                reason: "no rate limit service: call `url(..)`".into(),
            });
        }
        for url in &urls {
            target(url).map_err(|reason| ConfigError::Invalid {
                option: "url",
                reason,
            })?;
        }
        Ok(RlsStore {
            endpoint: urls.join(", "),
            urls,
            domain,
            descriptors,
            negative_hits,
            pass,
            connect_timeout: opts
                .timeout
                .saturating_mul(10)
                .clamp(Duration::from_millis(250), Duration::from_secs(2)),
            client: ArcSwapOption::empty(),
        })
    }

    /// The channel, made now if there is none: every target resolved, one endpoint per
    /// address, balanced.
    async fn client(&self) -> Result<Arc<Client>, CallError> {
        if let Some(c) = self.client.load_full() {
            return Ok(c);
        }
        let mut endpoints = Vec::new();
        for url in &self.urls {
            let (host, port) =
                target(url).map_err(|e| CallError::new(StoreFailure::Connection, e))?;
            let addrs = tokio::time::timeout(
                self.connect_timeout,
                tokio::net::lookup_host((host.as_str(), port)),
            )
            .await
            .map_err(|_| CallError::new(StoreFailure::Timeout, format!("resolving {host}")))?
            .map_err(|e| {
                CallError::new(StoreFailure::Connection, format!("resolving {host}: {e}"))
            })?;
            for addr in addrs {
                let endpoint = Endpoint::from_shared(format!("http://{addr}"))
                    .map_err(|e| CallError::new(StoreFailure::Connection, e))?
                    .connect_timeout(self.connect_timeout)
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(Duration::from_secs(10))
                    .keep_alive_timeout(Duration::from_secs(5));
                endpoints.push(endpoint);
            }
        }
        let channel = match endpoints.len() {
            0 => {
                return Err(CallError::new(
                    StoreFailure::Connection,
                    format!("{} resolves to no address", self.endpoint),
                ));
            }
            1 => endpoints.remove(0).connect_lazy(),
            _ => Channel::balance_list(endpoints.into_iter()),
        };
        let client = Arc::new(RateLimitServiceClient::new(channel));
        self.client.store(Some(client.clone()));
        Ok(client)
    }

    /// The call a decision is, or `None` for a refund the server would not honour (given
    /// back nowhere: the server keeps counting it).
    fn request(&self, job: &Job<Self>) -> Result<Option<RateLimitRequest>, BackendError> {
        let name: &str = job.prepared();
        let mut descriptors = match &self.descriptors {
            Some(map) => map(name, &job.key),
            None => vec![descriptor(&[(name, &key_value(&job.key))])],
        };
        if descriptors.is_empty() {
            return Err(BackendError::new(
                BackendErrorKind::Protocol,
                format!("policy {name:?}: the descriptors function made no descriptor"),
            ));
        }
        let cost = job.cost.get();
        let hits = match job.mode {
            Mode::Decide | Mode::Reserve { .. } | Mode::Debit => cost,
            Mode::Peek => 0,
            Mode::Refund { .. } if self.negative_hits => {
                for d in &mut descriptors {
                    d.is_negative_hits = true;
                    d.hits_addend = Some(UInt64Value {
                        value: u64::from(cost),
                    });
                }
                cost
            }
            Mode::Refund { .. } => return Ok(None),
            _ => {
                return Err(BackendError::new(
                    BackendErrorKind::Protocol,
                    "the rate limit service holds no slots (concurrent quotas)",
                ));
            }
        };
        Ok(Some(RateLimitRequest {
            domain: self.domain.clone(),
            descriptors,
            hits_addend: hits,
        }))
    }
}

/// A target's host and port (`http://host:port`, the port 8081 when none is given).
fn target(url: &str) -> Result<(String, u16), String> {
    let uri: tonic::codegen::http::Uri = url
        .parse()
        .map_err(|e| format!("{url:?}: not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => {
            return Err(format!(
                "{url:?}: scheme {other:?} is not supported (plain HTTP/2: `http://`)"
            ));
        }
        None => return Err(format!("{url:?}: give a scheme, `http://host:port`")),
    }
    let host = uri.host().ok_or_else(|| format!("{url:?}: no host"))?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    Ok((host, uri.port_u16().unwrap_or(8081)))
}

/// What a failed call was, for the breaker and the logs.
fn call_error(status: &tonic::Status) -> CallError {
    let failure = match status.code() {
        tonic::Code::DeadlineExceeded => StoreFailure::Timeout,
        tonic::Code::Unavailable => {
            let text = format!("{status:?}").to_ascii_lowercase();
            if text.contains("refused") {
                StoreFailure::ConnectionRefused
            } else {
                StoreFailure::Unavailable
            }
        }
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
            StoreFailure::Authentication
        }
        tonic::Code::Unknown | tonic::Code::Cancelled => StoreFailure::Connection,
        _ => StoreFailure::ErrorReply,
    };
    CallError::new(
        failure,
        format!(
            "rate limit service: {}: {}",
            status.code(),
            status.message()
        ),
    )
}

/// The limit, remaining units and reset an answer gives: the tightest status that has a
/// limit (one over it first, when the answer is over), else limitador's `X-RateLimit-*`
/// headers.
fn read_limits(
    resp: &RateLimitResponse,
    over: bool,
) -> (Option<u32>, Option<u32>, Option<Duration>) {
    let statuses = resp.statuses.iter().filter(|s| s.current_limit.is_some());
    let tightest = statuses
        .filter(|s| !over || s.code == Code::OverLimit as i32)
        .min_by_key(|s| s.limit_remaining);
    if let Some(s) = tightest {
        let limit = s.current_limit.as_ref().map(|l| l.requests_per_unit);
        let reset = s.duration_until_reset.as_ref().map(|d| {
            let secs = u64::try_from(d.seconds).unwrap_or(0);
            let nanos = u32::try_from(d.nanos).unwrap_or(0).min(999_999_999);
            Duration::new(secs, nanos)
        });
        return (limit, Some(s.limit_remaining), reset);
    }
    let header = |name: &str| {
        (resp.response_headers_to_add.iter())
            .find(|h| h.key.eq_ignore_ascii_case(name))
            .map(|h| h.value.as_str())
    };
    // `X-RateLimit-Limit: 10, 10;w=60`: the first number.
    let number = |v: &str| {
        let digits: String = v.trim().chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<u64>().ok()
    };
    let limit = header("x-ratelimit-limit").and_then(number);
    let remaining = header("x-ratelimit-remaining").and_then(number);
    let reset = header("x-ratelimit-reset")
        .and_then(number)
        .map(Duration::from_secs);
    (
        limit.map(|l| u32::try_from(l).unwrap_or(u32::MAX)),
        remaining.map(|r| u32::try_from(r).unwrap_or(u32::MAX)),
        reset,
    )
}

/// The decision an answer is.
pub(crate) fn decision(
    resp: &RateLimitResponse,
    params: &[QuotaParams],
    mode: Mode,
) -> Result<Decision, BackendError> {
    let over = match Code::try_from(resp.overall_code) {
        Ok(Code::Ok) => false,
        Ok(Code::OverLimit) => true,
        _ => {
            return Err(BackendError::new(
                BackendErrorKind::Protocol,
                format!(
                    "the rate limit service answered overall code {}, neither OK nor OVER_LIMIT",
                    resp.overall_code
                ),
            ));
        }
    };
    // A settlement is made whatever is left.
    let over = over && !mode.is_settlement();
    let (limit, remaining, reset) = read_limits(resp, over);
    let reset = reset.map(|r| r.min(MAX_RESET));
    let limit = limit
        .or_else(|| params.first().map(|p| p.burst.get()))
        .unwrap_or(1)
        .max(1);
    let remaining = if over {
        0
    } else {
        remaining.unwrap_or(limit).min(limit)
    };
    let state = QuotaState {
        index: 0,
        outcome: if over {
            // No reset from the server: `Retry-After` of 0, and nothing cached.
            Outcome::Denied {
                retry_after: reset.unwrap_or_default(),
            }
        } else {
            Outcome::Allowed
        },
        limit,
        remaining,
        reset_after: reset.unwrap_or_default(),
    };
    Ok(Decision::new([state]))
}

impl crate::backend::remote::Store for RlsStore {
    const KIND: &'static str = "rls";
    const SETTLES: bool = true;
    type Prepared = Arc<str>;

    fn prepare(&self, policy: &Policy, _params: &[QuotaParams]) -> Result<Arc<str>, ConfigError> {
        Ok(Arc::from(policy.name()))
    }

    async fn call(
        &self,
        jobs: &[Job<Self>],
        _now_ns: Option<u64>,
    ) -> Result<Vec<Result<Decision, BackendError>>, CallError> {
        let client = self.client().await?;
        let calls = jobs.iter().map(|job| {
            let mut client = Client::clone(&client);
            async move {
                let request = match self.request(job) {
                    Ok(Some(r)) => r,
                    // A refund the server would not honour: nothing given back.
                    Ok(None) => return Ok(Ok(Decision::new([]))),
                    Err(e) => return Ok(Err(e)),
                };
                match client.should_rate_limit(request).await {
                    Ok(answer) => {
                        let answer = answer.into_inner();
                        let decided = decision(&answer, job.params(), job.mode);
                        Ok(match decided {
                            // A settlement's answer goes to no response.
                            Ok(d) if !job.mode.is_settlement() => Ok(self.pass.apply(d, &answer)),
                            other => other,
                        })
                    }
                    Err(status) => Err(call_error(&status)),
                }
            }
        });
        let answers = futures_util::future::join_all(calls).await;
        answers.into_iter().collect()
    }

    /// A call with no descriptor: any answer (servers refuse it as invalid) says the server
    /// is there.
    async fn ping(&self) -> Result<(), CallError> {
        let mut client = Client::clone(&*self.client().await?);
        match client.should_rate_limit(RateLimitRequest::default()).await {
            Ok(_) => Ok(()),
            Err(status) => match status.code() {
                tonic::Code::Unavailable
                | tonic::Code::DeadlineExceeded
                | tonic::Code::Unknown
                | tonic::Code::Cancelled => Err(call_error(&status)),
                _ => Ok(()),
            },
        }
    }

    /// Each decision is its own call (see the module docs: RLS calls are all or nothing),
    /// concurrent calls sharing the connections.
    fn can_batch(&self) -> bool {
        false
    }

    fn calls_in_flight(&self) -> usize {
        1
    }

    fn reconnect(&self) {
        self.client.store(None);
    }

    fn warm_up_timeout(&self, timeout: Duration) -> Duration {
        timeout.max(self.connect_timeout)
    }

    fn announce(
        &self,
        _id: u64,
        _ttl: Duration,
    ) -> impl Future<Output = Result<u32, CallError>> + Send + '_ {
        std::future::ready(Err(CallError::new(
            StoreFailure::ErrorReply,
            "a rate limit service has no place for instances to announce themselves: set \
             `fleet(Fleet::Size(n))`",
        )))
    }
}
