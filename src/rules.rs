//! Rules: pick a policy per request (tenant, tier, route, method, predicate), and replace the
//! rules while serving.
//!
//! A [`RuleSet`] holds named policies, rules and a default policy. For each request the
//! matching rule with the highest priority names the policy (ties go to the rule declared
//! first); when none matches, the default applies. Selection takes no lock and allocates
//! nothing: the compiled rule set is read through an atomic pointer
//! ([`arc-swap`](https://docs.rs/arc-swap)).
//!
//! A rule matches when **all** its conditions hold:
//!
//! - `tenant`: the request's key equals this string (byte keys such as a header or a
//!   `String` extension) or this IP address (IP keys). An IPv6 address also matches the key
//!   of its /64, as [`PeerIp`](crate::key::PeerIp) and [`ClientIp`](crate::key::ClientIp)
//!   group IPv6 clients by /64; with another grouping, write the group's first address
//!   (`2001:db8:aa00::` for its /56). Tenants (and tiers) name keys of the first branch of
//!   an [`or`](crate::key::KeyExtractorExt::or) chain only: with
//!   `Extension::<String>::new().or(Header::new("x-api-key"))`, an anonymous client sending a
//!   tenant's name in the fallback header gets neither that tenant's bucket nor its policy.
//!   Put the extractor whose keys name tenants first;
//! - `tier`: the key's tenant is listed under this tier in the rule set's `tiers` map. The
//!   tier must be one of the set's: a value of `tiers`, or declared with
//!   [`RuleSet::declare_tier`] (`declared_tiers` in a file), which keeps a rule valid while
//!   its tier has no tenant;
//! - `path_prefix`: the path is this prefix or lies below it, compared **by whole segments**:
//!   `/login` matches `/login`, `/login/` and `/login/2fa`, but not `/loginfoo`. A trailing
//!   `/` changes nothing (`/api/` matches `/api`, `/api/` and `/api/x`), and `/` matches every
//!   request. The prefix must start with `/`. It is compared with the path as sent, byte for
//!   byte: case-sensitive, percent-encoded, without the query. So it must be visible ASCII
//!   (percent-encode the rest, as clients do), and it may not hold `?` or `#`, nor `*`, `{`
//!   or `}`: it is a prefix, not a route pattern;
//! - `methods`: the method is one of these. **A rule listing `GET` also matches `HEAD`**:
//!   axum (like most servers) answers `HEAD` with the `GET` handler, so a `GET` limit that
//!   skipped `HEAD` could be bypassed. The standard methods (`GET`, `HEAD`, `POST`, `PUT`,
//!   `DELETE`, `CONNECT`, `OPTIONS`, `TRACE`, `PATCH`) may be written in any case (`post` is
//!   `POST`). Any other method, such as `PURGE` or WebDAV's `PROPFIND`, must be declared first
//!   with [`RuleSet::extension_method`] (`extension_methods` in a file), in upper case, and
//!   is then matched exactly;
//! - a predicate closure (code only, see [`Rule::when`]).
//!
//! Conditions that could never match are configuration errors, not rules that silently do
//! nothing: an undeclared method (`PSOT`), an unknown tier (`por`), a path prefix without its
//! leading `/` (`login`). [`RuleSet::validate`], the layer's `build()` and
//! [`RulesHandle::replace`] all report them, naming the rule and the value:
//!
//! ```
//! use tollgate::rules::{Rule, RuleSet};
//! use tollgate::{Policy, Quota};
//!
//! let set = RuleSet::new(Policy::new("free", Quota::per_second(5)))
//!     .policy(Policy::new("login", Quota::per_minute(5)))
//!     .rule(Rule::new(100, "login").path_prefix("login"));
//! let err = set.validate().unwrap_err().to_string();
//! assert!(err.contains(r#"rules[0] (priority 100): path_prefix "login" must start with `/`"#));
//!
//! // Extension methods are declared once, then named by rules.
//! let set = RuleSet::new(Policy::new("free", Quota::per_second(5)))
//!     .policy(Policy::new("purges", Quota::per_minute(1)))
//!     .extension_method(http::Method::from_bytes(b"PURGE").unwrap())
//!     .rule(Rule::new(10, "purges").method(http::Method::from_bytes(b"PURGE").unwrap()));
//! assert!(set.validate().is_ok());
//! ```
//!
//! The application replaces rules at run time through a [`RulesHandle`]: the new set is
//! validated and prepared first, and swapped in atomically only if all of it is valid; an
//! invalid update returns the error and leaves the old rules in force. A request sees either
//! the old set or the new one, never a mix. Changed limits apply from the next request on,
//! including for keys held in a backend's deny cache (prepared policies are new objects, and
//! deny caches are scoped to them).
//!
//! ```
//! use tollgate::rules::{Rule, RuleSet};
//! use tollgate::{Policy, Quota, RateLimitLayer, key::Header};
//!
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! let rules = RuleSet::new(Policy::new("free", Quota::per_second(5).burst(10)))
//!     .policy(Policy::new("pro", Quota::per_second(50).burst(100)))
//!     .policy(Policy::new("login", Quota::per_minute(5)))
//!     .tier("merchant-42", "pro")
//!     .rule(Rule::new(10, "pro").tier("pro"))
//!     .rule(Rule::new(100, "login").path_prefix("/login"));
//! let layer = RateLimitLayer::builder()
//!     .rules(rules)
//!     .key(Header::new("x-merchant-id"))
//!     .build()?;
//!
//! // Later, while serving: raise merchant 7 to "pro".
//! let handle = layer.rules_handle().unwrap();
//! let updated = handle.current().tier("merchant-7", "pro");
//! handle.replace(updated)?;
//! # Ok(()) }
//! ```
//!
//! With the `serde` feature, a [`RuleSet`] (de)serializes from TOML, YAML or JSON, with quotas
//! written as strings like `"100/s"`, `"1000/h"` or `"5/min burst 10"`:
//!
//! ```toml
//! default = "free"
//!
//! [[policies]]
//! name = "free"
//! quotas = ["5/s burst 10", "1000/h"]
//!
//! [[policies]]
//! name = "pro"
//! quotas = ["50/s burst 100"]
//!
//! [[policies]]
//! name = "login"
//! quotas = ["5/min"]
//!
//! [tiers]
//! merchant-42 = "pro"
//!
//! [[rules]]
//! priority = 10
//! tier = "pro"
//! policy = "pro"
//!
//! [[rules]]
//! priority = 100
//! path_prefix = "/login"
//! methods = ["post"]
//! policy = "login"
//! ```
//!
//! Two optional lists declare what rules may name beyond the standard methods and the tiers
//! in use: `extension_methods = ["PURGE"]`, and `declared_tiers = ["enterprise"]` for a tier
//! that has no tenant yet (or any more).
//!
//! With the `calendar` feature, a `billing` table gives tenants their own billing day, time of
//! day and zone for the calendar quotas of the policy they get (see [`Billing`]):
//! `[billing] acme = { day = 15, tz = "Europe/Berlin" }`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use http::Method;
use smallvec::SmallVec;

use crate::backend::Backend;
use crate::prepared::Prepared;
use crate::{ConfigError, Key, Policy, RequestInfo};

type Predicate = Arc<dyn Fn(&RequestInfo<'_>) -> bool + Send + Sync>;

/// A rule: conditions, a priority, and the policy it names.
#[derive(Clone)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct Rule {
    priority: i32,
    policy: String,
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    tenant: Option<String>,
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    tier: Option<String>,
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    path_prefix: Option<String>,
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Vec::is_empty")
    )]
    methods: Vec<String>,
    #[cfg_attr(feature = "serde", serde(skip))]
    predicate: Option<Predicate>,
}

impl Rule {
    /// A rule naming `policy`, with `priority` (higher wins) and no condition yet: it matches
    /// every request until conditions are added.
    pub fn new(priority: i32, policy: impl Into<String>) -> Self {
        Rule {
            priority,
            policy: policy.into(),
            tenant: None,
            tier: None,
            path_prefix: None,
            methods: Vec::new(),
            predicate: None,
        }
    }

    /// Matches requests whose key is this tenant (a byte key, or an IP key when `tenant` is an
    /// IP address; an IPv6 address also matches the key of its /64, the grouping of the IP
    /// key extractors).
    pub fn tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    /// Matches requests whose tenant is in this tier (see [`RuleSet::tier`]). The tier must be
    /// one of the rule set's, a value of its `tiers` or declared with
    /// [`RuleSet::declare_tier`]; another is an error.
    pub fn tier(mut self, tier: impl Into<String>) -> Self {
        self.tier = Some(tier.into());
        self
    }

    /// Matches the request path `prefix` and the paths below it, by whole segments: `/login`
    /// matches `/login`, `/login/` and `/login/2fa`, not `/loginfoo`; a trailing `/` changes
    /// nothing, and `/` matches everything. The prefix must start with `/` and be visible
    /// ASCII without `?`, `#`, `*`, `{` or `}` (see the [module docs](self)); another is an
    /// error.
    ///
    /// The path is the one the layer sees: inside an axum `Router::nest("/api", ..)` the
    /// nest's prefix is already stripped, so match `/users` there, not `/api/users` (or put
    /// the layer on the outer router).
    pub fn path_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.path_prefix = Some(prefix.into());
        self
    }

    /// Matches this method (call again to allow several). `GET` also matches `HEAD`, which
    /// servers answer with the `GET` handler. A method other than the standard ones must be
    /// declared with [`RuleSet::extension_method`], or the rule set is invalid.
    pub fn method(mut self, method: Method) -> Self {
        self.methods.push(method.as_str().to_owned());
        self
    }

    /// Matches when `f` returns true. Predicates exist in code only: they are not serialized,
    /// so a rule set read back through [`RulesHandle::current`] and serialized loses them.
    pub fn when<F>(mut self, f: F) -> Self
    where
        F: Fn(&RequestInfo<'_>) -> bool + Send + Sync + 'static,
    {
        self.predicate = Some(Arc::new(f));
        self
    }

    /// The rule's priority.
    pub fn priority(&self) -> i32 {
        self.priority
    }

    /// The name of the policy it selects.
    pub fn policy_name(&self) -> &str {
        &self.policy
    }
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rule")
            .field("priority", &self.priority)
            .field("policy", &self.policy)
            .field("tenant", &self.tenant)
            .field("tier", &self.tier)
            .field("path_prefix", &self.path_prefix)
            .field("methods", &self.methods)
            .field("predicate", &self.predicate.as_ref().map(|_| "<fn>"))
            .finish()
    }
}

/// Policies, rules choosing among them, tiers, and a default.
#[derive(Clone, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct RuleSet {
    default: String,
    #[cfg_attr(feature = "serde", serde(default))]
    shadow: bool,
    /// Methods other than the standard ones that rules may name, in upper case.
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Vec::is_empty")
    )]
    extension_methods: Vec<String>,
    /// Tiers that rules may name even when no tenant is in them.
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Vec::is_empty")
    )]
    declared_tiers: Vec<String>,
    policies: Vec<Policy>,
    #[cfg_attr(feature = "serde", serde(default))]
    tiers: BTreeMap<String, String>,
    #[cfg_attr(feature = "serde", serde(default))]
    rules: Vec<Rule>,
    /// Tenants' own billing settings for calendar quotas (see [`Billing`]).
    #[cfg(feature = "calendar")]
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "BTreeMap::is_empty")
    )]
    billing: BTreeMap<String, Billing>,
}

/// A tenant's own calendar (feature `calendar`): the day of the month its monthly quotas start
/// on (its billing day), the local time of day and the time zone of its calendar quotas,
/// whatever policy the rules give it. Each setting left out keeps the policy's. A rule set's
/// `billing` table maps tenants (as in `tiers`) to these:
///
/// ```toml
/// [billing]
/// acme = { day = 15, tz = "Europe/Berlin" }
/// globex = { day = 31, at = "09:00", tz = "America/New_York" }
/// ```
///
/// The tenant's buckets are its key's, as always: a tenant whose billing day changes keeps
/// what it used in the window running, carried by the policy's
/// [`OnChange`](crate::OnChange) into its new window (see `docs/algorithms.md`). A policy with
/// no calendar quota is unchanged. Billing settings come from the rule set (a file, the admin
/// API, [`RulesHandle::replace`] from your own lookup), never from the request: a client that
/// could choose its billing day could start a fresh month at will.
#[cfg(feature = "calendar")]
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct Billing {
    /// The day of the month monthly calendar quotas start on, 1 to 31 (past the month's end,
    /// its last day).
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub day: Option<u8>,
    /// The local time of day calendar quotas start at, `HH:MM` or `HH:MM:SS`.
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub at: Option<String>,
    /// The IANA time zone of the calendar quotas (`Europe/Berlin`).
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub tz: Option<String>,
}

#[cfg(feature = "calendar")]
impl Billing {
    /// No setting of its own: the policy's calendar.
    pub fn new() -> Self {
        Self::default()
    }

    /// Monthly quotas start on `day` (1 to 31).
    pub fn day(mut self, day: u8) -> Self {
        self.day = Some(day);
        self
    }

    /// Calendar quotas start at `time` (`HH:MM` or `HH:MM:SS`) local time.
    pub fn at(mut self, time: &str) -> Self {
        self.at = Some(time.to_owned());
        self
    }

    /// Calendar quotas count in the IANA zone `zone`.
    pub fn tz(mut self, zone: &str) -> Self {
        self.tz = Some(zone.to_owned());
        self
    }

    /// `calendar` with these settings.
    fn apply(
        &self,
        mut calendar: crate::quota::Calendar,
    ) -> Result<crate::quota::Calendar, String> {
        if let Some(day) = self.day {
            if !(1..=31).contains(&day) {
                return Err(format!("day {day}: a billing day is 1 to 31"));
            }
            calendar = calendar.with_month_day(day);
        }
        if let Some(at) = &self.at {
            let (h, m, s) =
                crate::quota::parse_time_of_day(at).map_err(|e| format!("at {at:?}: {e}"))?;
            calendar = calendar.at_second(h, m, s);
        }
        if let Some(tz) = &self.tz {
            calendar = calendar.in_zone(tz);
        }
        match calendar.error() {
            Some(e) => Err(e.to_owned()),
            None => Ok(calendar),
        }
    }

    /// `policy` with these settings in its calendar quotas; `None` when it has none.
    fn policy(&self, policy: &Policy) -> Result<Option<Policy>, String> {
        let quotas = policy.quotas();
        if !quotas.iter().any(|q| q.calendar_period().is_some()) {
            return Ok(None);
        }
        let mut changed = Vec::with_capacity(quotas.len());
        for q in quotas {
            changed.push(match q.calendar_period() {
                Some(c) => Some(self.apply(c)?),
                None => None,
            });
        }
        Ok(Some(policy.map_quotas(
            |i, q| match changed.get(i).copied().flatten() {
                Some(c) => q.with_calendar(c),
                None => q,
            },
        )))
    }
}

impl RuleSet {
    /// A rule set whose default policy is `default`.
    pub fn new(default: Policy) -> Self {
        RuleSet {
            default: default.name().to_owned(),
            shadow: false,
            extension_methods: Vec::new(),
            declared_tiers: Vec::new(),
            policies: vec![default],
            tiers: BTreeMap::new(),
            rules: Vec::new(),
            #[cfg(feature = "calendar")]
            billing: BTreeMap::new(),
        }
    }

    /// Adds a policy that rules can name; a policy of the same name is replaced.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policies.retain(|p| p.name() != policy.name());
        self.policies.push(policy);
        self
    }

    /// Adds a rule.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Puts `tenant` in `tier` (replacing its previous tier).
    pub fn tier(mut self, tenant: impl Into<String>, tier: impl Into<String>) -> Self {
        self.tiers.insert(tenant.into(), tier.into());
        self
    }

    /// Declares `tier`, so that rules may name it while no tenant is in it (a tier in use in
    /// [`tier`](Self::tier) needs no declaration). Without it, moving a tier's last tenant
    /// elsewhere would make the rules naming the tier invalid.
    pub fn declare_tier(mut self, tier: impl Into<String>) -> Self {
        let tier = tier.into();
        if !self.declared_tiers.contains(&tier) {
            self.declared_tiers.push(tier);
        }
        self
    }

    /// Declares an extension method (one other than `GET`, `HEAD`, `POST`, `PUT`, `DELETE`,
    /// `CONNECT`, `OPTIONS`, `TRACE` and `PATCH`), so that rules may name it. Methods are
    /// case-sensitive and extension methods must be written in upper case, as clients send
    /// them: `PURGE`, `PROPFIND`.
    pub fn extension_method(mut self, method: Method) -> Self {
        let method = method.as_str().to_owned();
        if !self.extension_methods.contains(&method) {
            self.extension_methods.push(method);
        }
        self
    }

    /// Shadow mode for every policy of the set: decide and log, never reject.
    pub fn shadow(mut self, shadow: bool) -> Self {
        self.shadow = shadow;
        self
    }

    /// The policies.
    pub fn policies(&self) -> &[Policy] {
        &self.policies
    }

    /// The rules, as declared.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Gives `tenant` its own billing settings for calendar quotas (replacing its previous
    /// ones; see [`Billing`]).
    #[cfg(feature = "calendar")]
    pub fn billing(mut self, tenant: impl Into<String>, billing: Billing) -> Self {
        self.billing.insert(tenant.into(), billing);
        self
    }

    /// The tenant → billing settings map.
    #[cfg(feature = "calendar")]
    pub fn billings(&self) -> &BTreeMap<String, Billing> {
        &self.billing
    }

    /// The tenant → tier map.
    pub fn tiers(&self) -> &BTreeMap<String, String> {
        &self.tiers
    }

    /// The default policy's name.
    pub fn default_policy(&self) -> &str {
        &self.default
    }

    /// The declared extension methods (see [`extension_method`](Self::extension_method)).
    pub fn extension_methods(&self) -> &[String] {
        &self.extension_methods
    }

    /// The declared tiers (see [`declare_tier`](Self::declare_tier)).
    pub fn declared_tiers(&self) -> &[String] {
        &self.declared_tiers
    }

    /// Checks the rule set without building anything: unique and valid policies, rules
    /// naming defined policies, standard or declared methods, tiers of the set, and path
    /// prefixes starting with `/` (see the [module docs](self)). Errors name the offending
    /// entry and value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check().map(drop)
    }

    /// Validates and returns the index of each policy by name.
    fn check(&self) -> Result<HashMap<&str, usize>, ConfigError> {
        let mut by_name = HashMap::new();
        for (i, p) in self.policies.iter().enumerate() {
            p.validate().map_err(|e| ConfigError::Invalid {
                option: "policies",
                reason: format!("policies[{i}]: {e}"),
            })?;
            if by_name.insert(p.name(), i).is_some() {
                return Err(ConfigError::Invalid {
                    option: "policies",
                    reason: format!("policies[{i}]: policy `{}` is defined twice", p.name()),
                });
            }
        }
        if !by_name.contains_key(self.default.as_str()) {
            return Err(ConfigError::Invalid {
                option: "default",
                reason: format!("default policy `{}` is not defined", self.default),
            });
        }
        for (i, m) in self.extension_methods.iter().enumerate() {
            check_extension_method(m).map_err(|reason| ConfigError::Invalid {
                option: "extension_methods",
                reason: format!("extension_methods[{i}]: {reason}"),
            })?;
        }
        let tiers: BTreeSet<&str> = self
            .tiers
            .values()
            .chain(&self.declared_tiers)
            .map(String::as_str)
            .collect();
        for (i, r) in self.rules.iter().enumerate() {
            let bad = |reason: String| ConfigError::Invalid {
                option: "rules",
                reason: format!("rules[{i}] (priority {}): {reason}", r.priority),
            };
            if !by_name.contains_key(r.policy.as_str()) {
                return Err(bad(format!("policy `{}` is not defined", r.policy)));
            }
            for m in &r.methods {
                parse_method(m, &self.extension_methods).map_err(bad)?;
            }
            if let Some(t) = &r.tier
                && !tiers.contains(t.as_str())
            {
                return Err(bad(unknown_tier(t, &tiers)));
            }
            if let Some(p) = &r.path_prefix {
                check_path_prefix(p).map_err(bad)?;
            }
            if let Some(t) = &r.tenant {
                tenant_keys(t).map_err(|e| bad(format!("tenant: {e}")))?;
            }
        }
        for tenant in self.tiers.keys() {
            tenant_keys(tenant).map_err(|e| ConfigError::Invalid {
                option: "tiers",
                reason: format!("tenant {tenant:?}: {e}"),
            })?;
        }
        #[cfg(feature = "calendar")]
        for (tenant, billing) in &self.billing {
            let bad = |e: String| ConfigError::Invalid {
                option: "billing",
                reason: format!("tenant {tenant:?}: {e}"),
            };
            tenant_keys(tenant).map_err(bad)?;
            for p in &self.policies {
                billing.policy(p).map_err(bad)?;
            }
        }
        Ok(by_name)
    }
}

/// The standard methods (RFC 9110 and PATCH, RFC 5789): written in any case in rules.
const STANDARD_METHODS: [Method; 9] = [
    Method::GET,
    Method::HEAD,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::CONNECT,
    Method::OPTIONS,
    Method::TRACE,
    Method::PATCH,
];

/// A method as written in a rule. Methods are case-sensitive, but `post` in a config file
/// means `POST`, not an extension method no client sends: the standard methods are matched
/// whatever their case. Any other token must be declared in `extension_methods`: otherwise a
/// typo such as `PSOT`, a valid token, would make a rule that never matches.
fn parse_method(m: &str, extensions: &[String]) -> Result<Method, String> {
    if let Some(standard) = STANDARD_METHODS
        .iter()
        .find(|s| s.as_str().eq_ignore_ascii_case(m))
    {
        return Ok(standard.clone());
    }
    if extensions.iter().any(|e| e == m) {
        // Declarations were checked to be valid tokens.
        return Method::from_bytes(m.as_bytes()).map_err(|e| format!("method {m:?}: {e}"));
    }
    let hint = match extensions.iter().find(|e| e.eq_ignore_ascii_case(m)) {
        Some(e) => format!(" (methods are case-sensitive: `{e}` is declared)"),
        None => String::new(),
    };
    Err(format!(
        "method {m:?} is not a standard HTTP method (GET, HEAD, POST, PUT, DELETE, CONNECT, \
         OPTIONS, TRACE or PATCH, in any case) nor declared in `extension_methods`{hint}"
    ))
}

/// An extension method declaration: a valid token, in upper case as clients send methods.
fn check_extension_method(m: &str) -> Result<(), String> {
    if Method::from_bytes(m.as_bytes()).is_err() {
        return Err(format!(
            "{m:?} is not an HTTP method (a token of letters, digits and `!#$%&'*+-.^_`|~`)"
        ));
    }
    if m.bytes().any(|b| b.is_ascii_lowercase()) {
        return Err(format!(
            "{m:?}: write extension methods in upper case ({:?}): methods are case-sensitive, \
             and clients send them in upper case",
            m.to_ascii_uppercase()
        ));
    }
    Ok(())
}

fn unknown_tier(tier: &str, tiers: &BTreeSet<&str>) -> String {
    let known = if tiers.is_empty() {
        "the rule set has none".to_owned()
    } else {
        let list: Vec<String> = tiers.iter().map(|t| format!("{t:?}")).collect();
        format!("its tiers are {}", list.join(", "))
    };
    format!(
        "tier {tier:?} is not a tier of the rule set ({known}); a tier is a value of `tiers`, \
         or declared in `declared_tiers` while no tenant is in it"
    )
}

/// A path prefix must start with `/` and be written as clients send paths: visible ASCII
/// (percent-encoded), without a query or fragment, and without route-pattern syntax.
fn check_path_prefix(p: &str) -> Result<(), String> {
    if !p.starts_with('/') {
        let fixed = format!("/{}", p.trim_start_matches('/'));
        return Err(format!(
            "path_prefix {p:?} must start with `/` (did you mean {fixed:?}?)"
        ));
    }
    if let Some(c) = p.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "path_prefix {p:?} contains {c:?}: paths are matched as sent, so write it \
             percent-encoded, in visible ASCII"
        ));
    }
    if let Some(c) = p.chars().find(|c| matches!(c, '?' | '#')) {
        return Err(format!(
            "path_prefix {p:?} contains `{c}`: only the path is matched, not the query or \
             fragment"
        ));
    }
    if let Some(c) = p.chars().find(|c| matches!(c, '*' | '{' | '}')) {
        return Err(format!(
            "path_prefix {p:?} contains `{c}`: it is a literal prefix matched by whole \
             segments, not a route pattern"
        ));
    }
    Ok(())
}

/// Whether `path` is `prefix` or lies below it. `prefix` has no trailing `/` and is not
/// empty (the root prefix `/` compiles to no condition at all).
fn under(path: &str, prefix: &str) -> bool {
    path.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// The keys a tenant string stands for: its bytes, and, when it is an IP address, its IP key
/// and (IPv6) the key of its /64, which is what the IP extractors give its clients.
fn tenant_keys(tenant: &str) -> Result<SmallVec<[Key; 3]>, String> {
    let mut keys = SmallVec::new();
    keys.push(Key::from_bytes(tenant).map_err(|e| e.to_string())?);
    if let Ok(ip) = tenant.parse::<IpAddr>() {
        let ip = ip.to_canonical();
        keys.push(Key::ip(ip));
        if ip.is_ipv6() {
            keys.push(crate::key::group(ip, crate::key::DEFAULT_V6_PREFIX));
        }
    }
    Ok(keys)
}

struct CompiledRule {
    policy: usize,
    tenant: SmallVec<[Key; 3]>,
    tier: Option<usize>,
    path_prefix: Option<Box<str>>,
    methods: SmallVec<[Method; 2]>,
    predicate: Option<Predicate>,
}

impl CompiledRule {
    fn matches(&self, req: &RequestInfo<'_>, key: Option<&Key>, tier: Option<usize>) -> bool {
        (self.tenant.is_empty() || key.is_some_and(|k| self.tenant.contains(k)))
            && (self.tier.is_none() || self.tier == tier)
            && self
                .path_prefix
                .as_deref()
                .is_none_or(|p| under(req.uri().path(), p))
            && (self.methods.is_empty() || self.methods.contains(req.method()))
            && self.predicate.as_ref().is_none_or(|f| f(req))
    }
}

/// The methods a rule matches: those it names, and `HEAD` with `GET`, because servers answer
/// `HEAD` with the `GET` handler (axum does): a `GET` limit must not be bypassed with `HEAD`.
fn compile_methods(methods: &[String], extensions: &[String]) -> SmallVec<[Method; 2]> {
    let mut compiled: SmallVec<[Method; 2]> = methods
        .iter()
        .filter_map(|m| parse_method(m, extensions).ok())
        .collect();
    if compiled.contains(&Method::GET) && !compiled.contains(&Method::HEAD) {
        compiled.push(Method::HEAD);
    }
    compiled
}

/// A rule set prepared for a backend.
pub(crate) struct Compiled<P> {
    source: RuleSet,
    policies: Vec<Arc<Prepared<P>>>,
    default: usize,
    rules: Vec<CompiledRule>,
    /// Tenant key → tier id; empty when no rule looks at tiers.
    tiers: HashMap<Key, usize>,
    /// Tenant key → its billing settings' id; empty without a `billing` table.
    #[cfg(feature = "calendar")]
    billing: HashMap<Key, usize>,
    /// (policy, billing id) → the policy under those settings, for the policies with
    /// calendar quotas.
    #[cfg(feature = "calendar")]
    billed: HashMap<(usize, usize), Arc<Prepared<P>>>,
}

impl<P> Compiled<P> {
    pub(crate) fn default_name(&self) -> &str {
        &self.source.default
    }

    pub(crate) fn select(&self, req: &RequestInfo<'_>, key: Option<&Key>) -> &Arc<Prepared<P>> {
        let tier = match key {
            // Tenants name keys of the first key space only (see the module docs).
            Some(k) if !self.tiers.is_empty() => self.tiers.get(k).copied(),
            _ => None,
        };
        let chosen = self
            .rules
            .iter()
            .find(|r| r.matches(req, key, tier))
            .map_or(self.default, |r| r.policy);
        #[cfg(feature = "calendar")]
        if !self.billing.is_empty()
            && let Some(billed) = key
                .and_then(|k| self.billing.get(k))
                .and_then(|b| self.billed.get(&(chosen, *b)))
        {
            return billed;
        }
        &self.policies[chosen]
    }
}

pub(crate) fn compile<Bk: Backend>(
    backend: &Bk,
    set: RuleSet,
) -> Result<Compiled<Bk::Policy>, ConfigError> {
    let by_name = set.check()?;
    let policies = set
        .policies
        .iter()
        .map(|p| {
            let p = if set.shadow {
                p.clone().shadow(true)
            } else {
                p.clone()
            };
            Prepared::new(backend, p).map(Arc::new)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut tier_ids: HashMap<&str, usize> = HashMap::new();
    let mut rules = Vec::with_capacity(set.rules.len());
    for r in &set.rules {
        let next = tier_ids.len();
        rules.push((
            r.priority,
            CompiledRule {
                policy: by_name[r.policy.as_str()],
                tenant: match &r.tenant {
                    Some(t) => tenant_keys(t).unwrap_or_default(),
                    None => SmallVec::new(),
                },
                tier: r
                    .tier
                    .as_deref()
                    .map(|t| *tier_ids.entry(t).or_insert(next)),
                path_prefix: r
                    .path_prefix
                    .as_deref()
                    .map(|p| p.trim_end_matches('/'))
                    .filter(|p| !p.is_empty())
                    .map(Into::into),
                methods: compile_methods(&r.methods, &set.extension_methods),
                predicate: r.predicate.clone(),
            },
        ));
    }
    // Highest priority first; the sort is stable, so ties keep declaration order.
    rules.sort_by_key(|(priority, _)| std::cmp::Reverse(*priority));
    let mut tiers = HashMap::new();
    for (tenant, tier) in &set.tiers {
        // Tiers no rule mentions cannot change a decision: skip them.
        if let Some(&id) = tier_ids.get(tier.as_str()) {
            for k in tenant_keys(tenant).unwrap_or_default() {
                tiers.insert(k, id);
            }
        }
    }
    // Each distinct billing settings once, and the policies with calendar quotas under each.
    #[cfg(feature = "calendar")]
    let (billing, billed) = {
        let mut ids: HashMap<&Billing, usize> = HashMap::new();
        let mut billing = HashMap::new();
        let mut billed = HashMap::new();
        for (tenant, b) in &set.billing {
            let next = ids.len();
            let id = *ids.entry(b).or_insert(next);
            for k in tenant_keys(tenant).unwrap_or_default() {
                billing.insert(k, id);
            }
            if id < next {
                continue;
            }
            for (i, p) in set.policies.iter().enumerate() {
                let bad = |e: String| ConfigError::Invalid {
                    option: "billing",
                    reason: format!("tenant {tenant:?}: {e}"),
                };
                if let Some(p) = b.policy(p).map_err(bad)? {
                    let p = if set.shadow { p.shadow(true) } else { p };
                    billed.insert((i, id), Arc::new(Prepared::new(backend, p)?));
                }
            }
        }
        (billing, billed)
    };
    Ok(Compiled {
        default: by_name[set.default.as_str()],
        policies,
        rules: rules.into_iter().map(|(_, r)| r).collect(),
        tiers,
        #[cfg(feature = "calendar")]
        billing,
        #[cfg(feature = "calendar")]
        billed,
        source: set,
    })
}

/// The live rules of a layer.
pub(crate) struct LiveRules<Bk: Backend> {
    backend: Arc<Bk>,
    pub(crate) current: ArcSwap<Compiled<Bk::Policy>>,
}

impl<Bk: Backend> LiveRules<Bk> {
    pub(crate) fn new(backend: Arc<Bk>, set: RuleSet) -> Result<Self, ConfigError> {
        let compiled = compile(&*backend, set)?;
        Ok(LiveRules {
            backend,
            current: ArcSwap::from_pointee(compiled),
        })
    }
}

trait RulesControl: Send + Sync {
    fn replace(&self, set: RuleSet) -> Result<(), ConfigError>;
    fn current(&self) -> RuleSet;
}

impl<Bk: Backend> RulesControl for LiveRules<Bk> {
    fn replace(&self, set: RuleSet) -> Result<(), ConfigError> {
        let compiled = compile(&*self.backend, set)?;
        self.current.store(Arc::new(compiled));
        Ok(())
    }

    fn current(&self) -> RuleSet {
        self.current.load().source.clone()
    }
}

/// Replaces a layer's rules while it serves. Cheap to clone; get one from
/// [`RateLimitLayer::rules_handle`](crate::RateLimitLayer::rules_handle).
#[derive(Clone)]
pub struct RulesHandle {
    inner: Arc<dyn RulesControl>,
}

impl RulesHandle {
    pub(crate) fn new<Bk: Backend>(live: Arc<LiveRules<Bk>>) -> Self {
        RulesHandle { inner: live }
    }

    /// Validates and prepares `set`, then swaps it in atomically. On error nothing changes.
    pub fn replace(&self, set: RuleSet) -> Result<(), ConfigError> {
        self.inner.replace(set)
    }

    /// The rule set in force.
    pub fn current(&self) -> RuleSet {
        self.inner.current()
    }
}

impl fmt::Debug for RulesHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RulesHandle").finish_non_exhaustive()
    }
}
