//! A client of Envoy's rate limit quota service, as an Envoy's stream uses it: reports sent,
//! answers read.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tollgate::rls::envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{
    BlanketRule, Strategy,
};
use tollgate::rls::envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action;
use tollgate::rls::envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use tollgate::rls::envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use tollgate::rls::envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use tollgate::rls::envoy_types::pb::google::protobuf::Duration as ProtoDuration;

/// A bucket's usage in a report: its entries, allowed, denied, seconds elapsed.
pub type Usage<'a> = (&'a [(&'a str, &'a str)], u64, u64, i64);

/// One Envoy's stream: reports sent, answers read.
pub struct Stream {
    pub send: mpsc::Sender<RateLimitQuotaUsageReports>,
    pub answers: tonic::Streaming<RateLimitQuotaResponse>,
}

impl Stream {
    pub async fn open(port: u16) -> Stream {
        let mut client = RateLimitQuotaServiceClient::connect(format!("http://127.0.0.1:{port}"))
            .await
            .unwrap();
        let (send, rx) = mpsc::channel(4);
        let answers = client
            .stream_rate_limit_quotas(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Stream { send, answers }
    }

    /// Sends a report of `usages` (bucket entries, allowed, denied, seconds) in `domain`, and
    /// reads the answer: each bucket's action, by its entries.
    pub async fn report(
        &mut self,
        domain: &str,
        usages: &[Usage<'_>],
    ) -> HashMap<Vec<(String, String)>, Action> {
        let report = RateLimitQuotaUsageReports {
            domain: domain.into(),
            bucket_quota_usages: (usages.iter())
                .map(|(entries, allowed, denied, secs)| BucketQuotaUsage {
                    bucket_id: Some(bucket(entries)),
                    time_elapsed: Some(ProtoDuration {
                        seconds: *secs,
                        nanos: 0,
                    }),
                    num_requests_allowed: *allowed,
                    num_requests_denied: *denied,
                })
                .collect(),
        };
        self.send.send(report).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), self.answers.message())
            .await
            .expect("an answer within 10 s")
            .expect("an answer, not an error")
            .expect("the stream open");
        actions(answer)
    }
}

pub fn bucket(entries: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: (entries.iter())
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect(),
    }
}

/// An assignment, as a test reads it.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    AllowAll,
    DenyAll,
    /// `max_tokens`, tokens per second.
    TokenBucket(u32, u32),
    Abandon,
}

pub fn actions(answer: RateLimitQuotaResponse) -> HashMap<Vec<(String, String)>, Action> {
    let mut out = HashMap::new();
    for a in answer.bucket_action {
        let mut entries: Vec<(String, String)> = a.bucket_id.unwrap().bucket.into_iter().collect();
        entries.sort();
        let action = match a.bucket_action.unwrap() {
            bucket_action::BucketAction::AbandonAction(_) => Action::Abandon,
            bucket_action::BucketAction::QuotaAssignmentAction(q) => {
                let ttl = q.assignment_time_to_live.unwrap();
                assert!((10..=30).contains(&ttl.seconds), "{ttl:?}");
                match q.rate_limit_strategy.unwrap().strategy.unwrap() {
                    Strategy::BlanketRule(r) if r == BlanketRule::AllowAll as i32 => {
                        Action::AllowAll
                    }
                    Strategy::BlanketRule(_) => Action::DenyAll,
                    Strategy::TokenBucket(tb) => {
                        let fill = tb.fill_interval.unwrap();
                        assert_eq!((fill.seconds, fill.nanos), (1, 0));
                        Action::TokenBucket(tb.max_tokens, tb.tokens_per_fill.unwrap().value)
                    }
                    other => panic!("unexpected strategy {other:?}"),
                }
            }
        };
        assert!(
            out.insert(entries, action).is_none(),
            "a bucket answered twice"
        );
    }
    out
}

pub fn key(entries: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut k: Vec<(String, String)> = (entries.iter())
        .map(|(a, b)| ((*a).into(), (*b).into()))
        .collect();
    k.sort();
    k
}
