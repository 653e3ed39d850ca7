//! The `RateLimit` and `RateLimit-Policy` fields of the IETF draft, parsed: for clients that
//! pace themselves from what a server sends, before it refuses them.
//!
//! Both are structured field lists (RFC 9651): per item a policy's name (a string) and its
//! parameters. Invalid input is an error, never a panic; parameters the draft does not define
//! are ignored (it allows them), as are names given as tokens rather than strings (some
//! servers send them).
//!
//! ```
//! use std::time::Duration;
//! use tollgate::fields::{RateLimit, RateLimitPolicy};
//!
//! let limit: RateLimit = r#""default";r=0;t=48"#.parse().unwrap();
//! assert_eq!(limit.items[0].remaining, 0);
//! assert_eq!(limit.wait(), Some(Duration::from_secs(48))); // none left: wait 48 s
//!
//! let policy: RateLimitPolicy = r#""permin";q=50;w=60, "perhr";q=1000;w=3600"#.parse().unwrap();
//! assert_eq!(policy.items[1].quota, 1000);
//! assert_eq!(policy.items[1].window, Some(Duration::from_secs(3600)));
//! assert!("\"x\";r=-1".parse::<RateLimit>().is_err());
//! ```

use std::fmt;
use std::time::Duration;

use sfv::{BareItem, ListEntry, Parameters, Parser};

/// Why a field could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError(pub(crate) String);

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FieldError {}

/// A `RateLimit` field: the service limits now, one item per policy.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RateLimit {
    /// The items, in the field's order.
    pub items: Vec<RateLimitItem>,
}

/// One item of a [`RateLimit`] field.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RateLimitItem {
    /// The policy's name.
    pub policy: String,
    /// Quota units left (`r`, required).
    pub remaining: u64,
    /// Time until more quota is available (`t`).
    pub reset: Option<Duration>,
    /// The partition key (`pk`).
    pub partition_key: Option<Vec<u8>>,
}

/// A `RateLimit-Policy` field: the quota policies, one item each.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RateLimitPolicy {
    /// The items, in the field's order.
    pub items: Vec<PolicyItem>,
}

/// One item of a [`RateLimitPolicy`] field.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PolicyItem {
    /// The policy's name.
    pub policy: String,
    /// The quota, in its units (`q`, required).
    pub quota: u64,
    /// The quota's unit (`qu`): `requests` when absent, `content-bytes`, `concurrent-requests`.
    pub unit: Option<String>,
    /// The time window (`w`).
    pub window: Option<Duration>,
    /// The partition key (`pk`).
    pub partition_key: Option<Vec<u8>>,
}

impl RateLimit {
    /// How long a client should wait before its next request, by this field: the longest `t`
    /// of the items with nothing left (`r=0`); `None` when every policy has some left.
    pub fn wait(&self) -> Option<Duration> {
        (self.items.iter())
            .filter(|i| i.remaining == 0)
            .filter_map(|i| i.reset)
            .filter(|t| !t.is_zero())
            .max()
    }

    /// The `RateLimit` field of `headers` (every line of it, as one list), if there is one.
    pub fn from_headers(headers: &http::HeaderMap) -> Option<Result<Self, FieldError>> {
        joined(headers, "ratelimit").map(|text| text.and_then(|t| t.parse()))
    }

    /// The older `X-RateLimit-Remaining` and `X-RateLimit-Reset` fields of `headers` (as GitHub,
    /// Twitter/X and many others send them), read as one item named `x-ratelimit`, if both are
    /// there. `X-RateLimit-Reset` is seconds from now, or, at 1 000 000 000 and above, a Unix
    /// time (GitHub's form; a time passed reads as 0).
    pub fn from_legacy_headers(headers: &http::HeaderMap) -> Option<Result<Self, FieldError>> {
        let remaining = headers.get("x-ratelimit-remaining")?;
        let reset = headers.get("x-ratelimit-reset")?;
        let number = |v: &http::HeaderValue, name: &str| {
            let n = v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok());
            n.ok_or_else(|| FieldError(format!("`{name}` is not a non-negative integer")))
        };
        let read = || {
            let remaining = number(remaining, "X-RateLimit-Remaining")?;
            let reset = number(reset, "X-RateLimit-Reset")?;
            let reset = if reset >= 1_000_000_000 {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                Duration::from_secs(reset).saturating_sub(now)
            } else {
                Duration::from_secs(reset)
            };
            Ok(RateLimit {
                items: vec![RateLimitItem {
                    policy: "x-ratelimit".to_owned(),
                    remaining,
                    reset: Some(reset),
                    partition_key: None,
                }],
            })
        };
        Some(read())
    }
}

impl RateLimitPolicy {
    /// The `RateLimit-Policy` field of `headers` (every line of it, as one list), if there is
    /// one.
    pub fn from_headers(headers: &http::HeaderMap) -> Option<Result<Self, FieldError>> {
        joined(headers, "ratelimit-policy").map(|text| text.and_then(|t| t.parse()))
    }
}

/// The lines of a field, joined as one list (RFC 9651 § 4.2).
fn joined(headers: &http::HeaderMap, name: &str) -> Option<Result<String, FieldError>> {
    let mut lines = headers.get_all(name).iter().peekable();
    lines.peek()?;
    let mut text = String::new();
    for line in lines {
        let Ok(line) = line.to_str() else {
            return Some(Err(FieldError(format!("`{name}` is not visible ASCII"))));
        };
        if !text.is_empty() {
            text.push_str(", ");
        }
        text.push_str(line);
    }
    Some(Ok(text))
}

impl std::str::FromStr for RateLimit {
    type Err = FieldError;

    fn from_str(s: &str) -> Result<Self, FieldError> {
        let items = items(s, "RateLimit")?.into_iter().map(|(policy, params)| {
            Ok(RateLimitItem {
                remaining: integer(&params, "r", &policy)?
                    .ok_or_else(|| FieldError(format!("`RateLimit` {policy:?}: no `r`")))?,
                reset: integer(&params, "t", &policy)?.map(Duration::from_secs),
                partition_key: bytes(&params, &policy)?,
                policy,
            })
        });
        Ok(RateLimit {
            items: items.collect::<Result<_, FieldError>>()?,
        })
    }
}

impl std::str::FromStr for RateLimitPolicy {
    type Err = FieldError;

    fn from_str(s: &str) -> Result<Self, FieldError> {
        let items = items(s, "RateLimit-Policy")?
            .into_iter()
            .map(|(policy, params)| {
                let unit = match params.get("qu") {
                    None => None,
                    Some(BareItem::String(u)) => Some(u.as_str().to_owned()),
                    Some(_) => {
                        return Err(FieldError(format!(
                            "`RateLimit-Policy` {policy:?}: `qu` is not a string"
                        )));
                    }
                };
                Ok(PolicyItem {
                    quota: integer(&params, "q", &policy)?.ok_or_else(|| {
                        FieldError(format!("`RateLimit-Policy` {policy:?}: no `q`"))
                    })?,
                    unit,
                    window: integer(&params, "w", &policy)?.map(Duration::from_secs),
                    partition_key: bytes(&params, &policy)?,
                    policy,
                })
            });
        Ok(RateLimitPolicy {
            items: items.collect::<Result<_, FieldError>>()?,
        })
    }
}

/// A field's items: each policy's name and parameters.
fn items(s: &str, field: &str) -> Result<Vec<(String, Parameters)>, FieldError> {
    let list: sfv::List = Parser::new(s)
        .parse()
        .map_err(|e| FieldError(format!("`{field}` is not a structured field list: {e}")))?;
    list.into_iter()
        .map(|entry| match entry {
            ListEntry::Item(item) => {
                let name = match &item.bare_item {
                    BareItem::String(s) => s.as_str().to_owned(),
                    BareItem::Token(t) => t.as_str().to_owned(),
                    other => {
                        return Err(FieldError(format!(
                            "`{field}`: a policy's name must be a string, not {other:?}"
                        )));
                    }
                };
                Ok((name, item.params))
            }
            ListEntry::InnerList(_) => Err(FieldError(format!("`{field}`: an inner list"))),
        })
        .collect()
}

/// A non-negative integer parameter, if present.
fn integer(params: &Parameters, key: &str, policy: &str) -> Result<Option<u64>, FieldError> {
    match params.get(key) {
        None => Ok(None),
        Some(value) => {
            let n = value.as_integer().map(i64::from);
            match n.and_then(|n| u64::try_from(n).ok()) {
                Some(n) => Ok(Some(n)),
                None => Err(FieldError(format!(
                    "{policy:?}: `{key}` must be a non-negative integer, not {value:?}"
                ))),
            }
        }
    }
}

/// The `pk` parameter (a byte sequence), if present.
fn bytes(params: &Parameters, policy: &str) -> Result<Option<Vec<u8>>, FieldError> {
    match params.get("pk") {
        None => Ok(None),
        Some(value) => value
            .as_byte_sequence()
            .map(|b| Some(b.to_vec()))
            .ok_or_else(|| FieldError(format!("{policy:?}: `pk` must be a byte sequence"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `RateLimit` and `RateLimit-Policy` example of the draft (draft-10) parses.
    #[test]
    fn the_drafts_examples_parse() {
        for text in [
            r#""default";r=50;t=30"#,
            r#""default";r=999;pk=:dHJpYWwxMjEzMjM=:"#,
            r#""default";r=300000000;t=60;pk=:QXBwLTk5OQ==:"#,
            r#""problemPolicy";r=0;t=10"#,
            r#""daily";r=1;t=36400"#,
            r#""dynamic";r=0;t=20"#,
        ] {
            let f: RateLimit = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(f.items.len(), 1, "{text}");
        }
        let f: RateLimit = r#""default";r=300000000;t=60;pk=:QXBwLTk5OQ==:"#.parse().unwrap();
        assert_eq!(f.items[0].partition_key.as_deref(), Some(&b"App-999"[..]));
        assert_eq!(f.items[0].reset, Some(Duration::from_secs(60)));
        for text in [
            r#""burst";q=100;w=60,"daily";q=1000;w=86400"#,
            r#""default";q=100;w=10"#,
            r#""permin";q=50;w=60,"perhr";q=1000;w=3600"#,
            r#""peruser";q=65535;qu="content-bytes";w=10;pk=:c2RmakxKVU9VSA==:"#,
            r#""somepolicy";q=10000;w=1000"#,
        ] {
            let f: RateLimitPolicy = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!(!f.items.is_empty(), "{text}");
        }
        let f: RateLimitPolicy = r#""peruser";q=65535;qu="content-bytes";w=10"#.parse().unwrap();
        assert_eq!(f.items[0].unit.as_deref(), Some("content-bytes"));
    }

    /// What tollgate itself sends reads back.
    /// Two of the draft's `RateLimit-Policy` examples carry a `pk` whose last base64
    /// characters leave bits set (`:cHsdsRa894==:`, `:sdfjLJUOUH==:`): read as RFC 9651 allows,
    /// leniently.
    #[test]
    fn the_drafts_partition_keys_as_written() {
        for text in [
            r#""peruser";q=100;w=60;pk=:cHsdsRa894==:"#,
            r#""peruser";q=65535;qu="content-bytes";w=10;pk=:sdfjLJUOUH==:"#,
        ] {
            let f: RateLimitPolicy = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(
                f.items[0].partition_key.as_ref().map(Vec::len),
                Some(7),
                "{text}"
            );
        }
    }

    #[test]
    fn tollgates_own_fields_read_back() {
        let f: RateLimit = r#""api-0";r=0;t=1, "api-1";r=2;t=1200"#.parse().unwrap();
        assert_eq!(f.wait(), Some(Duration::from_secs(1)));
        let f: RateLimitPolicy =
            r#""exports";q=2;qu="concurrent-requests", "bytes";q=1000;qu="content-bytes";w=3600"#
                .parse()
                .unwrap();
        assert_eq!(f.items[0].window, None);
        assert_eq!(f.items[1].window, Some(Duration::from_secs(3600)));
    }

    #[test]
    fn invalid_fields_are_errors_never_panics() {
        for text in [
            "",
            "\"x\"",
            "\"x\";r=-1",
            "\"x\";r=1.5",
            "\"x\";r=\"1\"",
            "(\"a\" \"b\");r=1",
            "1;r=1",
            "\"x\";r=1;pk=notbytes",
            "\"unterminated;r=1",
            "\"x\";r=99999999999999999999",
        ] {
            let parsed = text.parse::<RateLimit>();
            if text.is_empty() {
                // An empty list: no items, nothing to wait for.
                assert_eq!(parsed.map(|f| f.items.len()), Ok(0));
                continue;
            }
            assert!(parsed.is_err(), "{text:?}: {parsed:?}");
        }
        assert!("\"x\";w=60".parse::<RateLimitPolicy>().is_err(), "no q");
        assert!(
            "\"x\";q=1;qu=bytes".parse::<RateLimitPolicy>().is_err(),
            "a token unit"
        );
    }

    #[test]
    fn the_older_x_ratelimit_fields() {
        let headers = |remaining: &str, reset: &str| {
            let mut h = http::HeaderMap::new();
            h.insert("x-ratelimit-limit", http::HeaderValue::from_static("5000"));
            h.insert("x-ratelimit-remaining", remaining.parse().unwrap());
            h.insert("x-ratelimit-reset", reset.parse().unwrap());
            h
        };
        // Seconds from now.
        let f = RateLimit::from_legacy_headers(&headers("0", "12"))
            .unwrap()
            .unwrap();
        assert_eq!(f.wait(), Some(Duration::from_secs(12)));
        // GitHub's Unix time.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let at = (now + 30).to_string();
        let f = RateLimit::from_legacy_headers(&headers("0", &at))
            .unwrap()
            .unwrap();
        let wait = f.wait().unwrap();
        assert!(
            wait > Duration::from_secs(27) && wait <= Duration::from_secs(30),
            "{wait:?}"
        );
        // Some left, or a reset passed: nothing to wait for.
        let f = RateLimit::from_legacy_headers(&headers("10", "12"))
            .unwrap()
            .unwrap();
        assert_eq!(f.wait(), None);
        let past = (now - 30).to_string();
        let f = RateLimit::from_legacy_headers(&headers("0", &past))
            .unwrap()
            .unwrap();
        assert_eq!(f.wait(), None);
        assert!(
            RateLimit::from_legacy_headers(&headers("none", "12"))
                .unwrap()
                .is_err()
        );
        assert!(RateLimit::from_legacy_headers(&http::HeaderMap::new()).is_none());
    }

    #[test]
    fn a_field_in_several_lines_is_one_list() {
        let mut headers = http::HeaderMap::new();
        headers.append(
            "ratelimit",
            http::HeaderValue::from_static(r#""a";r=5;t=1"#),
        );
        headers.append(
            "ratelimit",
            http::HeaderValue::from_static(r#""b";r=0;t=9"#),
        );
        let f = RateLimit::from_headers(&headers).unwrap().unwrap();
        assert_eq!(f.items.len(), 2);
        assert_eq!(f.wait(), Some(Duration::from_secs(9)));
        assert!(RateLimitPolicy::from_headers(&headers).is_none());
    }
}
