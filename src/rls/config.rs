//! envoyproxy/ratelimit's configuration format, read as it is, with tollgate's quotas as an
//! extension: [`RlsConfig`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::google::protobuf::{
    ListValue, Struct as ProtoStruct, Value as ProtoValue, value::Kind,
};
use serde::Deserialize;

use crate::quota::Algorithm;
use crate::{ConfigError, Policy, Quota};

/// One domain's rules, as envoyproxy/ratelimit writes them in YAML, each file one domain:
///
/// ```yaml
/// domain: edge
/// descriptors:
///   - key: remote_address          # any value: a limit per client address
///     rate_limit: { unit: second, requests_per_unit: 5 }
///   - key: generic_key
///     value: expensive             # this value only
///     quota: "2/s burst 2"         # tollgate's quota syntax, instead of rate_limit
///   - key: database
///     value: users
///     descriptors:                 # nested: the descriptor's next entry
///       - key: tenant
///         rate_limit: { unit: minute, requests_per_unit: 100 }
///         shadow_mode: true
/// ```
///
/// Read as envoyproxy/ratelimit does: `key`, `value` (none or empty: any value; with a `*`: a
/// pattern, each `*` any characters, the first that matches in the rules' order taken after an
/// exact value and before the key alone), `share_threshold` (the values a pattern matches share one
/// bucket), `quota_mode` (a soft limit: the request is refused only when every quota-mode
/// descriptor of it is over, or another descriptor is), `metadata` (returned as the answer's
/// dynamic metadata, see `RlsService::dynamic_metadata`), `value_to_metric` and `detailed_metric`
/// (accepted; tollgate's metrics are per policy), `rate_limit` (`unit`: second, minute, hour, day,
/// or week, month, year as 7, 30 and 365 days; `requests_per_unit`, 0 refusing every request;
/// `unlimited`; `name`; `replaces`: the named limits left out when both apply to one request, an
/// `unlimited` rule's too), `shadow_mode` and nested `descriptors`. A `rate_limit` counts in fixed
/// windows, as envoyproxy/ratelimit does (`5/s fixed`).
///
/// tollgate's extensions: `quota` takes tollgate's quota syntax instead of `rate_limit`
/// (`"5/s burst 10"`, `"100/min sliding 10s"`, `"10/s block 1m"`, with the `calendar` feature
/// `"1000/month on 15 tz Europe/Berlin"`, answered with the exact time to its window's end,
/// where `unit: month` keeps envoyproxy/ratelimit's 30 days from the epoch); a concurrent quota cannot be
/// served (the protocol has no release) and is refused. `debit: true` takes every hit, past
/// the limit too (the key is then in debt, refused until it is paid back), and never gives it
/// back: envoyproxy/ratelimit's counting, which a charge sent after the response
/// (`apply_on_stream_done`) needs. Anything else is an error naming the rule and the word.
///
/// ```
/// use tollgate::rls::RlsConfig;
///
/// let config = RlsConfig::from_yaml(
///     "domain: edge\ndescriptors:\n  - key: remote_address\n    quota: \"5/s burst 10\"\n",
/// )?;
/// assert_eq!(config.domain(), "edge");
/// assert_eq!(config.policies().len(), 1);
/// assert_eq!(config.policies()[0].name(), "edge.remote_address");
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct RlsConfig {
    domain: String,
    root: Node,
    policies: Vec<Policy>,
    /// Whether a limit `replaces` another (most configs: none, and nothing to look for).
    replaces: bool,
}

type Hasher = foldhash::fast::RandomState;

/// A level of the rule tree: the rules of its descriptor entries, by `key=value` (a value
/// given) and by `key` (any value).
#[derive(Debug, Clone, Default)]
pub(crate) struct Node {
    /// By key, then value: looked up with borrowed strings, without allocating. Hashed with
    /// foldhash (lookups of what clients send never insert: nothing to flood).
    pub(crate) by_value: HashMap<String, HashMap<String, Rule, Hasher>, Hasher>,
    /// By key, then values with a `*` (each matching any run of characters, none included), in
    /// the order the rules give them: the first that matches is taken, as in
    /// envoyproxy/ratelimit.
    pub(crate) by_pattern: HashMap<String, Vec<Pattern>, Hasher>,
    pub(crate) by_key: HashMap<String, Rule, Hasher>,
}

/// A rule of the tree: what a descriptor ending here gets, and the rules of its next entry.
#[derive(Debug, Clone, Default)]
pub(crate) struct Rule {
    pub(crate) limit: Option<Limit>,
    pub(crate) children: Node,
    /// `share_threshold` (a value with a `*`): every value the pattern matches counts in one
    /// bucket, keyed by the pattern.
    pub(crate) share: bool,
}

/// A value with `*` in it, and its rule.
#[derive(Debug, Clone)]
pub(crate) struct Pattern {
    /// As written (the bucket's key under `share_threshold`).
    pub(crate) value: String,
    /// The literal runs between the `*`s.
    parts: Vec<String>,
    /// Their length in all: the shortest value that can match.
    fixed: usize,
    pub(crate) rule: Rule,
}

impl Pattern {
    fn new(value: &str, rule: Rule) -> Self {
        let parts: Vec<String> = value.split('*').map(str::to_owned).collect();
        Pattern {
            value: value.to_owned(),
            fixed: parts.iter().map(String::len).sum(),
            parts,
            rule,
        }
    }

    /// Whether `v` matches: it starts with the first run and ends with the last, and the runs
    /// between are found in order between those two, each `*` standing for any characters
    /// (none included).
    fn matches(&self, v: &str) -> bool {
        let (first, rest) = match self.parts.split_first() {
            Some(split) => split,
            None => return v.is_empty(),
        };
        let Some((last, middle)) = rest.split_last() else {
            return v == first;
        };
        if v.len() < self.fixed || !v.starts_with(first.as_str()) || !v.ends_with(last.as_str()) {
            return false;
        }
        let mut between = &v[first.len()..v.len() - last.len()];
        for part in middle {
            match between.find(part.as_str()) {
                Some(at) => between = &between[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

/// What a descriptor ending at a rule gets.
#[derive(Debug, Clone)]
pub(crate) enum Limit {
    /// OK, counted nowhere; the limits it `replaces` are left out too.
    Unlimited { replaces: Vec<String> },
    /// `OVER_LIMIT`, counted nowhere: a `requests_per_unit` of 0 (a block list).
    Refused(Named),
    /// Decided under policy `policy` (an index into the config's policies).
    Counted {
        policy: usize,
        named: Named,
        /// Every hit is taken, past the limit too (the key is then in debt), and never given
        /// back: envoyproxy/ratelimit's counting, which a charge after the response needs.
        debit: bool,
    },
}

/// What a limit is called and answers with, and what it replaces.
#[derive(Debug, Clone)]
pub(crate) struct Named {
    /// The limit's `name`, which `replaces` of other limits refer to (a limit without one is
    /// never replaced).
    pub(crate) name: Option<Arc<str>>,
    /// The names of the limits this one replaces when both apply to one request.
    pub(crate) replaces: Vec<String>,
    /// Decided and counted, always OK.
    pub(crate) shadow: bool,
    /// `current_limit`: requests per unit, and the unit's number in the protocol.
    pub(crate) per_unit: (u32, i32),
    /// The unit's length (a refused limit's `Retry-After`).
    pub(crate) unit: Duration,
    /// `quota_mode`: over its limit the descriptor is `OVER_LIMIT`, but the request is only
    /// refused when every quota-mode descriptor of it is (or another descriptor is).
    pub(crate) quota_mode: bool,
    /// `metadata`, returned in the answer's dynamic metadata when the descriptor passes (see
    /// `RlsService::dynamic_metadata`).
    pub(crate) metadata: Option<Arc<ProtoStruct>>,
}

impl Limit {
    /// The names of the limits this one replaces.
    pub(crate) fn replaces(&self) -> &[String] {
        match self {
            Limit::Unlimited { replaces } => replaces,
            Limit::Refused(named) | Limit::Counted { named, .. } => &named.replaces,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSpec {
    domain: String,
    #[serde(default)]
    descriptors: Vec<DescriptorSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptorSpec {
    key: String,
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<RateLimitSpec>,
    /// tollgate's extension: a quota in its own syntax.
    #[serde(default)]
    quota: Option<String>,
    #[serde(default)]
    descriptors: Vec<DescriptorSpec>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    /// tollgate's extension: every hit is taken, past the limit too.
    #[serde(default)]
    debit: bool,
    #[serde(default)]
    quota_mode: bool,
    /// Accepted: it names envoyproxy/ratelimit's metrics (see [`RlsConfig`]).
    #[serde(default)]
    value_to_metric: bool,
    #[serde(default)]
    share_threshold: bool,
    #[serde(default)]
    metadata: Option<serde_norway::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RateLimitSpec {
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    requests_per_unit: Option<u32>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<ReplacesSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplacesSpec {
    name: String,
}

/// The protocol's units (`RateLimitResponse.RateLimit.Unit`), their lengths, and their
/// numbers.
const UNITS: [(&str, u64, i32); 7] = [
    ("second", 1, 1),
    ("minute", 60, 2),
    ("hour", 3_600, 3),
    ("day", 86_400, 4),
    ("week", 7 * 86_400, 7),
    ("month", 30 * 86_400, 5),
    ("year", 365 * 86_400, 6),
];

impl RlsConfig {
    /// Reads one domain's rules in envoyproxy/ratelimit's YAML (see [`RlsConfig`]).
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let spec: FileSpec = serde_norway::from_str(text).map_err(|e| ConfigError::Invalid {
            option: "rls config",
            reason: e.to_string(),
        })?;
        if spec.domain.is_empty() {
            return Err(invalid("the domain is empty"));
        }
        let mut policies = Vec::new();
        let root = compile(&spec.domain, &spec.descriptors, &[], &mut policies)?;
        let replaces = has_replaces(&root);
        Ok(RlsConfig {
            domain: spec.domain,
            root,
            policies,
            replaces,
        })
    }

    /// The domain the rules are for.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// The policies the rules decide with, one per counted rule: named after the rule's
    /// path, `<domain>.<key>[=<value>]…` (`edge.remote_address`,
    /// `edge.generic_key=expensive`), whatever its `name` (which only `replaces` and
    /// `current_limit` refer to). A path that is not a policy name (longer than 64
    /// characters, or with a space, a quote or a character that is not ASCII: descriptor
    /// values are whatever Envoy sends) is named by its first 51 characters, each one a name
    /// cannot hold written `_`, then `~` and the first 12 hex digits of the path's SHA-256
    /// (`edge.city=Z_rich~5e320e01f186`): readable in metrics, at most 64 characters, and the
    /// same on every server.
    /// A layer in a service with a policy of the same name, on the same store, counts against
    /// the same limit (see the [module docs](super) for the keys).
    pub fn policies(&self) -> &[Policy] {
        &self.policies
    }

    pub(crate) fn root(&self) -> &Node {
        &self.root
    }

    pub(crate) fn has_replaces(&self) -> bool {
        self.replaces
    }
}

fn invalid(reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        option: "rls config",
        reason: reason.into(),
    }
}

/// Compiles one level of descriptors under `path` (the entries above, as `key[=value]`).
fn compile(
    domain: &str,
    specs: &[DescriptorSpec],
    path: &[String],
    policies: &mut Vec<Policy>,
) -> Result<Node, ConfigError> {
    let mut node = Node::default();
    for spec in specs {
        // An empty value is no value, as in envoyproxy/ratelimit: any value.
        let value = spec.value.as_deref().filter(|v| !v.is_empty());
        let step = match value {
            Some(v) => format!("{}={v}", spec.key),
            None => spec.key.clone(),
        };
        let mut here = path.to_vec();
        here.push(step);
        let rule_path = format!("{domain}.{}", here.join("."));
        let name = policy_name(&rule_path);
        let bad = |why: &str| invalid(format!("rule `{rule_path}`: {why}"));
        if spec.key.is_empty() {
            return Err(bad("the key is empty"));
        }
        let _ = (spec.detailed_metric, spec.value_to_metric);
        let pattern = value.filter(|v| v.contains('*'));
        if spec.share_threshold && pattern.is_none() {
            return Err(bad(
                "`share_threshold` without a `*` in the value: only the values a wildcard \
                 matches can share a bucket",
            ));
        }
        let twice = match value {
            Some(v) if v.contains('*') => {
                (node.by_pattern.get(&spec.key)).is_some_and(|ps| ps.iter().any(|p| p.value == v))
            }
            Some(v) => (node.by_value.get(&spec.key)).is_some_and(|vs| vs.contains_key(v)),
            None => node.by_key.contains_key(&spec.key),
        };
        if twice {
            return Err(bad("given twice at this level"));
        }
        let (quota, rl, per_unit): (Option<Quota>, Option<&RateLimitSpec>, _) =
            match (&spec.rate_limit, &spec.quota) {
                (Some(_), Some(_)) => {
                    return Err(bad(
                        "both `rate_limit` and `quota`: give one (`quota` is tollgate's syntax \
                         for the same thing)",
                    ));
                }
                (Some(rl), None) if rl.unlimited => {
                    if rl.unit.is_some() || rl.requests_per_unit.is_some() {
                        return Err(bad(
                            "`unlimited` with a unit or a count: give one or the other",
                        ));
                    }
                    (None, Some(rl), None)
                }
                (Some(rl), None) => {
                    let unit_word = rl
                        .unit
                        .as_deref()
                        .ok_or_else(|| bad("`rate_limit` without `unit`"))?;
                    let (_, secs, code) = UNITS
                        .iter()
                        .find(|(u, _, _)| u.eq_ignore_ascii_case(unit_word))
                        .copied()
                        .ok_or_else(|| {
                            bad(&format!(
                                "unknown unit {unit_word:?}: use second, minute, hour, day, \
                                 week, month or year"
                            ))
                        })?;
                    let count = rl
                        .requests_per_unit
                        .ok_or_else(|| bad("`rate_limit` without `requests_per_unit`"))?;
                    let unit = Duration::from_secs(secs);
                    // A count of 0 refuses every request (envoyproxy/ratelimit's block list).
                    let quota = (count > 0).then(|| Quota::new(count, unit).fixed_window());
                    (quota, Some(rl), Some(((count, code), unit)))
                }
                (None, Some(text)) => {
                    let quota: Quota = text
                        .parse()
                        .map_err(|e: ConfigError| bad(&format!("quota {text:?}: {e}")))?;
                    if quota.algorithm() == Algorithm::Concurrent {
                        return Err(bad(
                            "a concurrent quota cannot be served over the rate limit service: \
                             the protocol has no release for a request that ends",
                        ));
                    }
                    (
                        Some(quota),
                        None,
                        Some((nearest_unit(&quota), quota.period())),
                    )
                }
                (None, None) => (None, None, None),
            };
        let limit = match (rl, quota, per_unit) {
            (Some(rl), _, None) => Some(Limit::Unlimited {
                replaces: replaces(rl, &bad)?,
            }),
            (rl, quota, Some((per_unit, unit))) => {
                let named = Named {
                    name: rl.and_then(|rl| rl.name.as_deref()).map(Arc::from),
                    replaces: rl
                        .map(|rl| replaces(rl, &bad))
                        .transpose()?
                        .unwrap_or_default(),
                    shadow: spec.shadow_mode,
                    per_unit,
                    unit,
                    quota_mode: spec.quota_mode,
                    metadata: (spec.metadata.as_ref())
                        .map(|m| to_struct(m).map(Arc::new))
                        .transpose()
                        .map_err(|e| bad(&format!("`metadata`: {e}")))?,
                };
                Some(match quota {
                    None => Limit::Refused(named),
                    Some(quota) => {
                        if policies.iter().any(|p| p.name() == name) {
                            return Err(bad(
                                "another rule's path reads the same (a key or value with `.` \
                                 or `=` in it): rename one",
                            ));
                        }
                        // Given units back: refunds of calls refused as a whole, and Envoy's
                        // negative hits (a shared store's deny cache then holds blocks only).
                        let policy = Policy::new(name.as_str(), quota)
                            .shadow(spec.shadow_mode)
                            .given_back();
                        policy.validate().map_err(|e| bad(&e.to_string()))?;
                        policies.push(policy);
                        Limit::Counted {
                            policy: policies.len() - 1,
                            named,
                            debit: spec.debit,
                        }
                    }
                })
            }
            (None, _, None) => None,
        };
        if spec.debit && !matches!(limit, Some(Limit::Counted { .. })) {
            return Err(bad("`debit` without a limit that counts"));
        }
        if spec.shadow_mode && limit.is_none() {
            return Err(bad("`shadow_mode` without a limit"));
        }
        let counts = matches!(limit, Some(Limit::Counted { .. } | Limit::Refused(_)));
        if spec.quota_mode && !counts {
            return Err(bad("`quota_mode` without a limit that counts"));
        }
        if spec.metadata.is_some() && !counts {
            return Err(bad(
                "`metadata` without a limit that counts (it is returned for the limit a \
                 descriptor passed)",
            ));
        }
        let rule = Rule {
            limit,
            children: compile(domain, &spec.descriptors, &here, policies)?,
            share: spec.share_threshold,
        };
        match value {
            Some(v) if v.contains('*') => {
                // In the order given: the first that matches is taken.
                let patterns = node.by_pattern.entry(spec.key.clone()).or_default();
                patterns.push(Pattern::new(v, rule));
            }
            Some(v) => {
                (node.by_value.entry(spec.key.clone()).or_default()).insert(v.to_owned(), rule);
            }
            None => {
                node.by_key.insert(spec.key.clone(), rule);
            }
        }
    }
    Ok(node)
}

/// The policy name of a rule's path (`<domain>.<key>[=<value>]…`): the path itself when it is
/// a policy name (at most 64 visible ASCII characters, without `"` or `\`), else its first
/// 51 characters, each one a name cannot hold written `_`, then `~` and the first 12 hex
/// digits of the path's SHA-256: readable in metrics, bounded, and the same on every server
/// (a path that reads the same twice is refused when loaded).
pub(crate) fn policy_name(path: &str) -> String {
    use crate::policy::{MAX_NAME_LEN, name_char, valid_name};
    use sha2::{Digest, Sha256};
    use std::fmt::Write;
    if valid_name(path) {
        return path.to_owned();
    }
    let digest = Sha256::digest(path.as_bytes());
    let mut name: String = (path.chars())
        .map(|c| if name_char(c) { c } else { '_' })
        .take(MAX_NAME_LEN - 13)
        .collect();
    name.push('~');
    for b in &digest[..6] {
        let _ = write!(name, "{b:02x}");
    }
    name
}

/// A limit's `replaces`, checked as envoyproxy/ratelimit does: no empty name, not its own.
fn replaces(
    rl: &RateLimitSpec,
    bad: &impl Fn(&str) -> ConfigError,
) -> Result<Vec<String>, ConfigError> {
    let names: Vec<String> = rl.replaces.iter().map(|r| r.name.clone()).collect();
    if names.iter().any(String::is_empty) {
        return Err(bad("an empty name in `replaces`"));
    }
    if let Some(own) = &rl.name
        && names.contains(own)
    {
        return Err(bad(&format!("`replaces` names the limit itself ({own:?})")));
    }
    Ok(names)
}

/// `current_limit` for a quota whose period is not a unit of the protocol (`3/10s`, or any
/// tollgate quota): its rate (count over period) in the smallest unit at least as long as its
/// period, rounded.
fn nearest_unit(quota: &Quota) -> (u32, i32) {
    let period = quota.period().as_secs_f64().max(1e-9);
    let (_, secs, code) = (UNITS.iter())
        .find(|(_, secs, _)| *secs as f64 >= period)
        .copied()
        .unwrap_or(UNITS[UNITS.len() - 1]);
    let per = f64::from(quota.count()) * secs as f64 / period;
    (per.round().clamp(1.0, f64::from(u32::MAX)) as u32, code)
}

/// The rule a descriptor's entries reach, at each level `key=value`, then the first value
/// with a `*` that matches (in the rules' order), then `key`, if every entry finds one.
/// `shared` is told each entry (by place) matched by a `share_threshold` pattern, and the
/// pattern.
pub(crate) fn find<'a, 'e>(
    mut node: &'a Node,
    entries: impl IntoIterator<Item = (&'e str, &'e str)>,
    mut shared: impl FnMut(usize, &'a str),
) -> Option<&'a Rule> {
    let mut rule = None;
    for (at, (k, v)) in entries.into_iter().enumerate() {
        let found = (node.by_value.get(k))
            .and_then(|values| values.get(v))
            .or_else(|| {
                let patterns = node.by_pattern.get(k)?;
                let found = patterns.iter().find(|p| p.matches(v))?;
                if found.rule.share {
                    shared(at, &found.value);
                }
                Some(&found.rule)
            })
            .or_else(|| node.by_key.get(k))?;
        node = &found.children;
        rule = Some(found);
    }
    rule
}

/// The most entries [`find_unordered`] matches: a bucket id of Envoy's rate limit quota
/// filter with more matches no rule (rules trees are a few levels deep).
pub(crate) const MAX_UNORDERED: usize = 16;

/// The rule a set of entries reaches in *some* order (a bucket id of Envoy's rate limit quota
/// service is a map: its entries come in no order): at each level an entry not used yet that
/// the level has a rule for, as [`find`] matches one (`key=value`, a value with `*`, `key`),
/// until every entry is used. Returns the rule and the entries in the order that reached it
/// (the order of a descriptor the same rule matches, so that both count in one bucket), or
/// `None` when no order reaches a rule with every entry, or there are more than
/// [`MAX_UNORDERED`].
pub(crate) fn find_unordered<'a, 'e>(
    root: &'a Node,
    entries: &[(&'e str, &'e str)],
) -> Option<(&'a Rule, Vec<(&'e str, &'e str)>)> {
    fn step<'a, 'e>(
        node: &'a Node,
        left: &mut Vec<(&'e str, &'e str)>,
        path: &mut Vec<(&'e str, &'e str)>,
    ) -> Option<&'a Rule> {
        for i in 0..left.len() {
            let (k, v) = left[i];
            let Some(rule) = (node.by_value.get(k))
                .and_then(|values| values.get(v))
                .or_else(|| {
                    let patterns = node.by_pattern.get(k)?;
                    Some(&patterns.iter().find(|p| p.matches(v))?.rule)
                })
                .or_else(|| node.by_key.get(k))
            else {
                continue;
            };
            let entry = left.swap_remove(i);
            path.push(entry);
            if left.is_empty() {
                return Some(rule);
            }
            if let Some(found) = step(&rule.children, left, path) {
                return Some(found);
            }
            // Back: put the entry where it was, and try the next.
            path.pop();
            left.push(entry);
            let last = left.len() - 1;
            left.swap(i, last);
        }
        None
    }
    if entries.is_empty() || entries.len() > MAX_UNORDERED {
        return None;
    }
    let mut left = entries.to_vec();
    let mut path = Vec::with_capacity(entries.len());
    let rule = step(root, &mut left, &mut path)?;
    Some((rule, path))
}

/// A `metadata` map as a protobuf `Struct` (what the answer's dynamic metadata carries).
fn to_struct(value: &serde_norway::Value) -> Result<ProtoStruct, String> {
    let serde_norway::Value::Mapping(map) = value else {
        return Err("not a map".into());
    };
    let mut fields = std::collections::HashMap::new();
    for (k, v) in map {
        let serde_norway::Value::String(k) = k else {
            return Err(format!("the key {k:?} is not a string"));
        };
        fields.insert(k.clone(), to_value(v)?);
    }
    Ok(ProtoStruct { fields })
}

fn to_value(value: &serde_norway::Value) -> Result<ProtoValue, String> {
    use serde_norway::Value as Y;
    let kind = match value {
        Y::Null => Kind::NullValue(0),
        Y::Bool(b) => Kind::BoolValue(*b),
        Y::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        Y::String(t) => Kind::StringValue(t.clone()),
        Y::Sequence(items) => Kind::ListValue(ListValue {
            values: items.iter().map(to_value).collect::<Result<_, _>>()?,
        }),
        Y::Mapping(_) => Kind::StructValue(to_struct(value)?),
        Y::Tagged(tagged) => return to_value(&tagged.value),
    };
    Ok(ProtoValue { kind: Some(kind) })
}

/// Whether a rule under `node` replaces another.
fn has_replaces(node: &Node) -> bool {
    let rules = (node.by_value.values())
        .flat_map(|values| values.values())
        .chain(node.by_pattern.values().flatten().map(|p| &p.rule))
        .chain(node.by_key.values());
    for rule in rules {
        if rule
            .limit
            .as_ref()
            .is_some_and(|l| !l.replaces().is_empty())
            || has_replaces(&rule.children)
        {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: &str = r#"
domain: edge
descriptors:
  - key: tenant
    descriptors:
      - key: path
        value: /export
        quota: "1/s"
      - key: path
        quota: "10/s"
  - key: path
    value: "/img/*"
    quota: "100/s"
  - key: remote_address
    quota: "5/s"
"#;

    fn policy_of<'a>(config: &'a RlsConfig, rule: &Rule) -> &'a str {
        match &rule.limit {
            Some(Limit::Counted { policy, .. }) => config.policies()[*policy].name(),
            _ => "",
        }
    }

    /// A bucket id's entries in any order reach the rule a descriptor reaches in the rules'
    /// order, and are given back in that order.
    #[test]
    fn unordered_entries_reach_the_rule_of_the_descriptor() {
        let config = RlsConfig::from_yaml(RULES).unwrap();
        let root = config.root();
        for entries in [
            [("tenant", "acme"), ("path", "/export")],
            [("path", "/export"), ("tenant", "acme")],
        ] {
            let (rule, order) = find_unordered(root, &entries).unwrap();
            assert_eq!(policy_of(&config, rule), "edge.tenant.path=/export");
            assert_eq!(order, [("tenant", "acme"), ("path", "/export")]);
            let ordered = find(root, order.iter().copied(), |_, _| {}).unwrap();
            assert!(std::ptr::eq(ordered, rule));
        }
        let (rule, _) = find_unordered(root, &[("path", "/other"), ("tenant", "a")]).unwrap();
        assert_eq!(policy_of(&config, rule), "edge.tenant.path");
        let (rule, _) = find_unordered(root, &[("path", "/img/a.png")]).unwrap();
        assert_eq!(policy_of(&config, rule), "edge.path=/img/*");
        // `path` alone, not an image: no rule at the top for any path.
        assert!(find_unordered(root, &[("path", "/export")]).is_none());
        // An entry no rule names: no rule, as for a descriptor.
        assert!(find_unordered(root, &[("remote_address", "1.2.3.4"), ("x", "y")]).is_none());
        assert!(find_unordered(root, &[]).is_none());
    }

    /// Hundreds of entries (a hostile bucket id): no rule, at once.
    #[test]
    fn too_many_entries_match_nothing() {
        let config = RlsConfig::from_yaml(RULES).unwrap();
        let keys: Vec<String> = (0..300).map(|i| format!("k{i}")).collect();
        let mut entries: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "v")).collect();
        assert!(find_unordered(config.root(), &entries).is_none());
        // Sixteen that share the first level's keys but reach nothing deeper: tried and
        // refused without blowing up.
        entries.truncate(MAX_UNORDERED - 1);
        entries.push(("tenant", "acme"));
        assert!(find_unordered(config.root(), &entries).is_none());
    }
}
