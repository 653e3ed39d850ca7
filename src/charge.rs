//! What a response charges: the vocabulary of settling after the response ([`ChargeWhen`],
//! [`CostFrom`], [`Cancelled`], [`Charge`], [`ResponseInfo`]) and the rules a policy compiles
//! from it. Plain data the policy holds; the stage that applies it after the call is
//! [`settle`](crate::settle), where these are public (module docs and examples there).

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;

use http::{Extensions, HeaderMap, HeaderName, Response, StatusCode};

use crate::backend::Mode;

/// What a handler charges for its request, put in its response's extensions and read by
/// [`CostFrom::extension`]: e.g. the tokens an LLM call used.
///
/// ```
/// let mut res = http::Response::new(());
/// res.extensions_mut().insert(tollgate::Charge(1200));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge(pub u32);

/// The parts of a response a settlement reads.
#[derive(Debug, Clone, Copy)]
pub struct ResponseInfo<'a> {
    status: StatusCode,
    headers: &'a HeaderMap,
    extensions: &'a Extensions,
}

impl<'a> ResponseInfo<'a> {
    pub(crate) fn new<B>(res: &'a Response<B>) -> Self {
        ResponseInfo {
            status: res.status(),
            headers: res.headers(),
            extensions: res.extensions(),
        }
    }

    /// The response's status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The response's headers.
    pub fn headers(&self) -> &'a HeaderMap {
        self.headers
    }

    /// The response's extensions.
    pub fn extensions(&self) -> &'a Extensions {
        self.extensions
    }
}

/// Which responses count against a policy set with
/// [`Policy::charge_when`](crate::Policy::charge_when).
#[derive(Clone)]
pub struct ChargeWhen {
    matches: Arc<dyn Fn(&ResponseInfo<'_>) -> bool + Send + Sync>,
    kind: Kind,
}

/// What a [`ChargeWhen`] is, for its `Debug` and serde forms.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Status(Vec<u16>),
    ClientError,
    NotServerError,
    Predicate,
    /// gRPC status codes, known at the body's end (the trailers), or from the head of a
    /// trailers-only response.
    Grpc(Vec<i32>),
}

impl ChargeWhen {
    /// Responses with one of these status codes (e.g. `[401, 403]` for failed logins).
    pub fn status(codes: impl IntoIterator<Item = u16>) -> Self {
        let codes: Vec<u16> = codes.into_iter().collect();
        let matching = codes.clone();
        Self::new(Kind::Status(codes), move |res| {
            matching.contains(&res.status().as_u16())
        })
    }

    /// Responses that are not server errors (`5xx`): a request the server failed costs the
    /// client nothing.
    pub fn not_server_error() -> Self {
        Self::new(Kind::NotServerError, |res| !res.status().is_server_error())
    }

    /// Client errors (`4xx`).
    pub fn client_error() -> Self {
        Self::new(Kind::ClientError, |res| res.status().is_client_error())
    }

    /// gRPC responses whose status (`grpc-status`, in the trailers, or in the head of a
    /// trailers-only response; a response without one counts as `2`, UNKNOWN) is one of
    /// `codes`: e.g. `[16, 7]` (UNAUTHENTICATED, PERMISSION_DENIED) for failed logins. The
    /// settlement waits for the end of the response's body, where gRPC puts its status.
    pub fn grpc_status(codes: impl IntoIterator<Item = i32>) -> Self {
        let codes: Vec<i32> = codes.into_iter().collect();
        let matching = codes.clone();
        Self::new(Kind::Grpc(codes), move |res| {
            matching.contains(&grpc_status(res.headers()).unwrap_or(GRPC_UNKNOWN))
        })
    }

    /// Responses for which `f` is true.
    pub fn predicate<F>(f: F) -> Self
    where
        F: Fn(&ResponseInfo<'_>) -> bool + Send + Sync + 'static,
    {
        Self::new(Kind::Predicate, f)
    }

    fn new(kind: Kind, f: impl Fn(&ResponseInfo<'_>) -> bool + Send + Sync + 'static) -> Self {
        ChargeWhen {
            matches: Arc::new(f),
            kind,
        }
    }
}

impl fmt::Debug for ChargeWhen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Status(codes) => f.debug_tuple("ChargeWhen::status").field(codes).finish(),
            Kind::ClientError => f.write_str("ChargeWhen::client_error"),
            Kind::NotServerError => f.write_str("ChargeWhen::not_server_error"),
            Kind::Predicate => f.write_str("ChargeWhen::predicate(<fn>)"),
            Kind::Grpc(codes) => f
                .debug_tuple("ChargeWhen::grpc_status")
                .field(codes)
                .finish(),
        }
    }
}

/// Where a response reports its request's cost, for
/// [`Policy::cost_from`](crate::Policy::cost_from). A response that reports nothing (or a
/// value that is not a count of units) keeps the cost taken at admission.
#[derive(Debug, Clone)]
pub struct CostFrom(Source);

#[derive(Debug, Clone)]
enum Source {
    Header(HeaderName),
    Extension,
    /// A trailer (or, for a trailers-only response, a header) of this name: known at the end.
    Trailer(HeaderName),
    /// The data bytes of the response's body, as sent: known at the end.
    ResponseBytes,
}

impl CostFrom {
    /// A response header holding a decimal count of units, e.g. `x-tokens-used: 1200`.
    pub fn header(name: HeaderName) -> Self {
        CostFrom(Source::Header(name))
    }

    /// A [`Charge`] in the response's extensions.
    pub fn extension() -> Self {
        CostFrom(Source::Extension)
    }

    /// A trailer holding a decimal count of units, read when the response's body ends (a gRPC
    /// trailer such as `x-tokens-used`, or an HTTP trailer); a header of that name counts too
    /// (a gRPC trailers-only response puts its trailers in the head).
    pub fn trailer(name: HeaderName) -> Self {
        CostFrom(Source::Trailer(name))
    }

    /// The response body's data bytes, counted as they are sent, when the body ends: a
    /// `content-bytes` quota (the IETF draft's `qu="content-bytes"`). A body dropped before its
    /// end is settled by the cancellation rule.
    pub fn response_bytes() -> Self {
        CostFrom(Source::ResponseBytes)
    }

    /// The cost `res` reports, if any.
    fn read(&self, res: &ResponseInfo<'_>) -> Option<u32> {
        match &self.0 {
            Source::Header(name) | Source::Trailer(name) => decimal(res.headers().get(name)?),
            Source::Extension => res.extensions().get::<Charge>().map(|c| c.0),
            Source::ResponseBytes => None,
        }
    }
}

/// A decimal count of units in a header value.
fn decimal(value: &http::HeaderValue) -> Option<u32> {
    value.to_str().ok()?.trim().parse().ok()
}

/// gRPC's UNKNOWN: the status of a response that states none.
const GRPC_UNKNOWN: i32 = 2;

/// The `grpc-status` in `headers` (the trailers, or a trailers-only response's head).
fn grpc_status(headers: &HeaderMap) -> Option<i32> {
    headers
        .get("grpc-status")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// What the end of a response's body tells a settlement that waits for it, with what its head
/// already told.
#[derive(Debug, Default)]
pub(crate) struct End {
    /// Whether the response matched a `ChargeWhen` the head decides (status codes, a
    /// predicate); `None` without one.
    head_match: Option<bool>,
    /// The gRPC status: from a trailers-only head, or the trailers.
    grpc: Option<i32>,
    /// The cost a header, an extension or a trailer reported.
    reported: Option<u32>,
    /// Data bytes sent.
    pub(crate) bytes: u64,
}

/// What a settling request is charged when it ends without a response, for
/// [`Policy::on_cancel`](crate::Policy::on_cancel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Cancelled {
    /// Keep what was taken at admission (the default): a client cannot avoid being charged
    /// by hanging up.
    #[default]
    Charge,
    /// Give back what was taken at admission.
    Refund,
}

/// A policy's settlement rules.
#[derive(Debug, Clone, Default)]
pub(crate) struct ChargeRules {
    pub(crate) when: Option<ChargeWhen>,
    pub(crate) cost: Option<CostFrom>,
    pub(crate) cancelled: Cancelled,
}

impl ChargeRules {
    /// Whether the settlement waits for the end of the response's body (a gRPC status, a
    /// trailer, the bytes sent).
    pub(crate) fn needs_end(&self) -> bool {
        matches!(self.when.as_ref().map(|w| &w.kind), Some(Kind::Grpc(_)))
            || matches!(
                self.cost.as_ref().map(|c| &c.0),
                Some(Source::Trailer(_) | Source::ResponseBytes)
            )
    }

    /// The settlement for a request admitted at `cost` whose response is `res`: the mode and
    /// units, or nothing to do.
    pub(crate) fn settlement(
        &self,
        taken: Taken,
        res: &ResponseInfo<'_>,
        refund: Mode,
    ) -> Option<(Mode, NonZeroU32)> {
        let matched = self.when.as_ref().is_none_or(|when| (when.matches)(res));
        let reported = || self.cost.as_ref()?.read(res);
        Self::units(taken, matched, reported, refund)
    }

    /// What the head of a response tells a settlement that waits for its body's end.
    pub(crate) fn head(&self, res: &ResponseInfo<'_>) -> End {
        let head_match = match self.when.as_ref() {
            Some(when) if !matches!(when.kind, Kind::Grpc(_)) => Some((when.matches)(res)),
            _ => None,
        };
        let reported = self.cost.as_ref().and_then(|c| c.read(res));
        End {
            head_match,
            grpc: grpc_status(res.headers()),
            reported,
            bytes: 0,
        }
    }

    /// What trailers tell a settlement.
    pub(crate) fn trailers(&self, end: &mut End, trailers: &HeaderMap) {
        if let Some(status) = grpc_status(trailers) {
            end.grpc = Some(status);
        }
        if let Some(Source::Trailer(name)) = self.cost.as_ref().map(|c| &c.0)
            && let Some(n) = trailers.get(name).and_then(decimal)
        {
            end.reported = Some(n);
        }
    }

    /// The settlement of a response whose body has ended, as `end` says.
    pub(crate) fn settlement_at_end(
        &self,
        taken: Taken,
        end: &End,
        refund: Mode,
    ) -> Option<(Mode, NonZeroU32)> {
        let matched = match self.when.as_ref().map(|w| &w.kind) {
            None => true,
            Some(Kind::Grpc(codes)) => codes.contains(&end.grpc.unwrap_or(GRPC_UNKNOWN)),
            Some(_) => end.head_match.unwrap_or(true),
        };
        let reported = || match self.cost.as_ref().map(|c| &c.0) {
            Some(Source::ResponseBytes) => Some(u32::try_from(end.bytes).unwrap_or(u32::MAX)),
            _ => end.reported,
        };
        Self::units(taken, matched, reported, refund)
    }

    /// A request admitted with `taken` units whose response `matched` the rule (or not: all of
    /// it refunded) and `reported` a cost (or not: the request's own cost stands, which is
    /// what was taken but for a request of cost 0, admitted at one unit).
    pub(crate) fn units(
        taken: Taken,
        matched: bool,
        reported: impl FnOnce() -> Option<u32>,
        refund: Mode,
    ) -> Option<(Mode, NonZeroU32)> {
        let units = taken.units;
        if !matched {
            return Some((refund, units));
        }
        let owed = reported().unwrap_or(taken.cost);
        match owed.cmp(&units.get()) {
            std::cmp::Ordering::Equal => None,
            std::cmp::Ordering::Greater => {
                Some((Mode::Debit, NonZeroU32::new(owed - units.get())?))
            }
            std::cmp::Ordering::Less => Some((refund, NonZeroU32::new(units.get() - owed)?)),
        }
    }
}

/// What a request took at admission, and what it costs by its policy's cost function: the
/// same, but for a request of cost 0 on a policy that holds slots or settles, which is
/// admitted at one unit (a decision takes at least one) and gives it back when settled.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Taken {
    pub(crate) units: NonZeroU32,
    pub(crate) cost: u32,
}

impl Taken {
    /// A request admitted for `cost` units, or, at 0, for one unit it owes nothing of.
    pub(crate) fn of(cost: u32) -> Self {
        Taken {
            units: NonZeroU32::new(cost).unwrap_or(NonZeroU32::MIN),
            cost,
        }
    }
}

impl ChargeRules {
    /// The rules of a request of cost 0 on a policy that holds slots and settles nothing: the
    /// unit it was admitted at goes back when it ends, whatever its outcome.
    pub(crate) fn give_back_the_unit() -> &'static Arc<ChargeRules> {
        static RULES: std::sync::OnceLock<Arc<ChargeRules>> = std::sync::OnceLock::new();
        RULES.get_or_init(|| {
            Arc::new(ChargeRules {
                when: None,
                cost: None,
                cancelled: Cancelled::Refund,
            })
        })
    }
}

/// The serde forms of the settlement rules, in a policy's table (TOML shown):
///
/// ```toml
/// charge_when = [401, 403]          # status codes; or "4xx", or "not 5xx"
/// cost_from = "header x-tokens-used" # or "extension" (a `Charge` in the response)
/// on_cancel = "refund"              # or "charge" (the default)
/// ```
///
/// A predicate ([`ChargeWhen::predicate`]) cannot be serialized: serializing a policy holding
/// one is an error.
#[cfg(feature = "serde")]
pub(crate) mod serde_forms {
    use std::fmt;

    use serde::de::{self, SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};

    use super::{Cancelled, ChargeWhen, CostFrom, Kind, Source};

    const CHARGE_WHEN: &str = "a list of status codes (e.g. [401, 403]), \"4xx\", \"not 5xx\" \
                               or gRPC status codes (e.g. \"grpc 16 7\")";

    pub(crate) fn ser_charge_when<S: Serializer>(
        when: &Option<ChargeWhen>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match when.as_ref().map(|w| &w.kind) {
            None => s.serialize_none(),
            Some(Kind::Status(codes)) => s.serialize_some(codes),
            Some(Kind::ClientError) => s.serialize_some("4xx"),
            Some(Kind::NotServerError) => s.serialize_some("not 5xx"),
            Some(Kind::Grpc(codes)) => {
                let codes: Vec<String> = codes.iter().map(i32::to_string).collect();
                s.serialize_some(&format!("grpc {}", codes.join(" ")))
            }
            Some(Kind::Predicate) => Err(serde::ser::Error::custom(
                "`charge_when` is a predicate (a closure), which cannot be serialized",
            )),
        }
    }

    pub(crate) fn de_charge_when<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<ChargeWhen>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ChargeWhen;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(CHARGE_WHEN)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ChargeWhen, E> {
                let grpc = v.trim().strip_prefix("grpc ").map(|codes| {
                    let codes = codes.split_whitespace().map(|c| match c.parse::<i32>() {
                        Ok(code @ 0..=16) => Ok(code),
                        _ => Err(E::custom(format!(
                            "`charge_when = {v:?}`: {c:?} is not a gRPC status code (0 to 16)"
                        ))),
                    });
                    codes.collect::<Result<Vec<i32>, E>>()
                });
                match grpc {
                    Some(Ok(codes)) if !codes.is_empty() => {
                        return Ok(ChargeWhen::grpc_status(codes));
                    }
                    Some(Err(e)) => return Err(e),
                    _ => {}
                }
                match v.trim() {
                    "4xx" => Ok(ChargeWhen::client_error()),
                    "not 5xx" => Ok(ChargeWhen::not_server_error()),
                    other => Err(E::custom(format!(
                        "`charge_when = {other:?}`: expected {CHARGE_WHEN}"
                    ))),
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ChargeWhen, A::Error> {
                let mut codes = Vec::new();
                while let Some(code) = seq.next_element::<u64>()? {
                    match u16::try_from(code) {
                        Ok(code @ 100..=599) => codes.push(code),
                        _ => {
                            return Err(de::Error::custom(format!(
                                "`charge_when`: {code} is not an HTTP status code (100 to 599)"
                            )));
                        }
                    }
                }
                if codes.is_empty() {
                    return Err(de::Error::custom(
                        "`charge_when = []` matches no response: every request would be refunded",
                    ));
                }
                Ok(ChargeWhen::status(codes))
            }
        }
        d.deserialize_any(V).map(Some)
    }

    pub(crate) fn ser_cost_from<S: Serializer>(
        from: &Option<CostFrom>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match from.as_ref().map(|c| &c.0) {
            None => s.serialize_none(),
            Some(Source::Header(name)) => s.serialize_some(&format!("header {name}")),
            Some(Source::Extension) => s.serialize_some("extension"),
            Some(Source::Trailer(name)) => s.serialize_some(&format!("trailer {name}")),
            Some(Source::ResponseBytes) => s.serialize_some("response bytes"),
        }
    }

    pub(crate) fn de_cost_from<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<CostFrom>, D::Error> {
        let v: String = serde::Deserialize::deserialize(d)?;
        let mut words = v.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("extension"), None, None) => Ok(Some(CostFrom::extension())),
            (Some("response"), Some("bytes"), None) => Ok(Some(CostFrom::response_bytes())),
            (Some(kind @ ("header" | "trailer")), Some(name), None) => match name.parse() {
                Ok(name) if kind == "header" => Ok(Some(CostFrom::header(name))),
                Ok(name) => Ok(Some(CostFrom::trailer(name))),
                Err(_) => Err(de::Error::custom(format!(
                    "`cost_from`: {name:?} is not a valid header name"
                ))),
            },
            _ => Err(de::Error::custom(format!(
                "`cost_from = {v:?}`: expected \"header <name>\" (e.g. \"header x-tokens-used\"), \"trailer <name>\", \"response bytes\" or \"extension\""
            ))),
        }
    }

    pub(crate) fn ser_cancelled<S: Serializer>(c: &Cancelled, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match c {
            Cancelled::Charge => "charge",
            Cancelled::Refund => "refund",
        })
    }

    pub(crate) fn de_cancelled<'de, D: Deserializer<'de>>(d: D) -> Result<Cancelled, D::Error> {
        let v: String = serde::Deserialize::deserialize(d)?;
        match v.as_str() {
            "charge" => Ok(Cancelled::Charge),
            "refund" => Ok(Cancelled::Refund),
            other => Err(de::Error::custom(format!(
                "`on_cancel = {other:?}`: expected \"charge\" or \"refund\""
            ))),
        }
    }

    pub(crate) fn is_charge(c: &Cancelled) -> bool {
        *c == Cancelled::Charge
    }
}
