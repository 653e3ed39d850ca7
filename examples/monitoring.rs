//! Writes tollgate's Grafana dashboard, Prometheus alerts and recording rules.
//!
//! Run with: `cargo run --example monitoring -- [--out DIR] [--selector 'job="api"'] [options]`
//!
//! The committed files under `monitoring/` are this program's output with no option; import
//! them as they are. Run it to make them for your labels and thresholds:
//!
//! - `--selector`: label matchers every expression carries (`job="api",env="prod"`; default
//!   none: every job that exports tollgate's metrics);
//! - `--rate-window` (default `5m`): the window of the alerts' and recording rules' rates;
//! - `--for` (default: each alert's own): how long a condition holds before its alert fires;
//! - thresholds, defaults argued in `docs/observability.md`: `--store-failing-ratio` (0.01),
//!   `--store-p99-seconds` (0.08, for the default 100 ms store timeout), `--limited-ratio`
//!   (0.5), `--limited-min-rps` (1), `--memory-ratio` (0.9), `--approx-over-limit-rps` (1),
//!   `--adaptive-rejected-ratio` (0.05), `--adaptive-min-rps` (1);
//! - `--runbook` (default the crate's `docs/observability.md` on GitHub): the runbook links' base.
//!
//! It writes `tollgate-dashboard.json`, `tollgate-alerts.yaml` and `tollgate-rules.yaml` to
//! `--out` (default `monitoring`). `tests/monitoring.rs` checks that the committed files are
//! its output, runs `promtool check rules` and `promtool test rules` on them, and runs every
//! expression against a real Prometheus.

use serde_json::{Value, json};

/// What the files are made for.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// Extra label matchers, without braces (`job="api"`), or empty.
    pub(crate) selector: String,
    /// The window of the rules' rates (`5m`).
    pub(crate) rate_window: String,
    /// Every alert's `for`, when given (else each its own).
    pub(crate) for_all: Option<String>,
    /// The share of an instance's decisions made by the failure policy (the store failing)
    /// that alerts.
    pub(crate) store_failing_ratio: f64,
    /// Store p99 latency alert threshold, seconds.
    pub(crate) store_p99_seconds: f64,
    /// The share of a policy's requests refused that is unusual.
    pub(crate) limited_ratio: f64,
    /// The least rate (requests a second) of a policy for its refused share to alert.
    pub(crate) limited_min_rps: f64,
    /// The store's memory in use over its limit that alerts.
    pub(crate) memory_ratio: f64,
    /// Estimated over-limit units a second (approximate mode) that alert.
    pub(crate) approx_over_limit_rps: f64,
    /// The share of an adaptive limit's requests rejected that alerts.
    pub(crate) adaptive_rejected_ratio: f64,
    /// The least rate (requests a second) of an adaptive limit for its rejected share to
    /// alert.
    pub(crate) adaptive_min_rps: f64,
    /// The runbooks' base address.
    pub(crate) runbook: String,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            selector: String::new(),
            rate_window: "5m".into(),
            for_all: None,
            store_failing_ratio: 0.01,
            store_p99_seconds: 0.08,
            limited_ratio: 0.5,
            limited_min_rps: 1.0,
            memory_ratio: 0.9,
            approx_over_limit_rps: 1.0,
            adaptive_rejected_ratio: 0.05,
            adaptive_min_rps: 1.0,
            runbook: "https://github.com/tollgate-rs/tollgate/blob/main/docs/observability.md"
                .into(),
        }
    }
}

impl Settings {
    /// The settings from command-line arguments (`--name value` or `--name=value`), and the
    /// output directory.
    pub(crate) fn from_args(args: &[String]) -> Result<(Self, String), String> {
        let mut s = Settings::default();
        let mut out = "monitoring".to_owned();
        let mut i = 0;
        while i < args.len() {
            let (name, value) = match args[i].split_once('=') {
                Some((n, v)) => (n.to_owned(), v.to_owned()),
                None => {
                    i += 1;
                    let v = args
                        .get(i)
                        .ok_or_else(|| format!("{} needs a value", args[i - 1]))?;
                    (args[i - 1].clone(), v.clone())
                }
            };
            i += 1;
            let number = |v: &str| {
                v.parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .ok_or_else(|| format!("{name}={v:?}: not a number of 0 or more"))
            };
            match name.as_str() {
                "--out" => out = value,
                "--selector" => s.selector = value.trim_matches(['{', '}']).to_owned(),
                "--rate-window" => s.rate_window = duration(&name, &value)?,
                "--for" => s.for_all = Some(duration(&name, &value)?),
                "--store-failing-ratio" => s.store_failing_ratio = number(&value)?,
                "--store-p99-seconds" => s.store_p99_seconds = number(&value)?,
                "--limited-ratio" => s.limited_ratio = number(&value)?,
                "--limited-min-rps" => s.limited_min_rps = number(&value)?,
                "--memory-ratio" => s.memory_ratio = number(&value)?,
                "--approx-over-limit-rps" => s.approx_over_limit_rps = number(&value)?,
                "--adaptive-rejected-ratio" => s.adaptive_rejected_ratio = number(&value)?,
                "--adaptive-min-rps" => s.adaptive_min_rps = number(&value)?,
                "--runbook" => s.runbook = value,
                other => return Err(format!("unknown option {other}")),
            }
        }
        Ok((s, out))
    }

    /// `name{selector, extra}`.
    fn m(&self, name: &str, extra: &str) -> String {
        let parts: Vec<&str> = [self.selector.as_str(), extra]
            .into_iter()
            .filter(|p| !p.is_empty())
            .collect();
        if parts.is_empty() {
            return name.to_owned();
        }
        format!("{name}{{{}}}", parts.join(","))
    }
}

/// A Prometheus duration (`30s`, `5m`, `1h`).
fn duration(name: &str, v: &str) -> Result<String, String> {
    let digits = v.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = &v[digits.len()..];
    if digits.is_empty()
        || !digits.chars().all(|c| c.is_ascii_digit())
        || !["ms", "s", "m", "h", "d"].contains(&unit)
    {
        return Err(format!("{name}={v:?}: a duration such as 30s, 5m or 1h"));
    }
    Ok(v.to_owned())
}

/// One alert: its name, expression, `for`, severity, summary and description (the runbook
/// is `docs/observability.md#<name in lowercase>`).
pub(crate) struct Alert {
    /// The alert's name.
    pub(crate) name: &'static str,
    /// What it compares: a healthy service's metrics give it series too (the live test runs
    /// it against a real Prometheus).
    #[allow(dead_code)] // read by tests/monitoring.rs
    pub(crate) query: String,
    /// Its expression: the query and its threshold.
    pub(crate) expr: String,
    /// Its own `for`.
    pub(crate) r#for: &'static str,
    /// `warning` or `critical`.
    pub(crate) severity: &'static str,
    /// One line.
    pub(crate) summary: &'static str,
    /// What it means, with the values.
    pub(crate) description: &'static str,
}

/// The recording rules: name and expression.
pub(crate) fn recording_rules(s: &Settings) -> Vec<(&'static str, String)> {
    let w = &s.rate_window;
    vec![
        (
            "tollgate:decisions:rate",
            format!(
                "sum by (job, instance, policy, outcome) (rate({}[{w}]))",
                s.m("tollgate_decisions_total", "")
            ),
        ),
        (
            "tollgate:policy_limited:ratio",
            "sum by (job, policy) (tollgate:decisions:rate{outcome=~\"denied|never_fits\"}) \
             / sum by (job, policy) (tollgate:decisions:rate)"
                .into(),
        ),
        (
            "tollgate:failure_policy:rate",
            "sum by (job, instance, outcome) (tollgate:decisions:rate{outcome=~\"fail_open|fallback_allowed|fallback_denied|fail_closed|shadow_error\"})"
                .into(),
        ),
        (
            "tollgate:backend_latency_seconds:p99",
            format!(
                "histogram_quantile(0.99, sum by (job, instance, backend, le) (rate({}[{w}])))",
                s.m("tollgate_backend_latency_seconds_bucket", "")
            ),
        ),
    ]
}

/// An alert whose expression is `query` then `cmp` (its comparison).
#[allow(clippy::too_many_arguments)]
fn alert(
    name: &'static str,
    query: String,
    cmp: String,
    r#for: &'static str,
    severity: &'static str,
    summary: &'static str,
    description: &'static str,
) -> Alert {
    let expr = format!("{query} {cmp}");
    Alert {
        name,
        query,
        expr,
        r#for,
        severity,
        summary,
        description,
    }
}

/// The alerts.
pub(crate) fn alerts(s: &Settings) -> Vec<Alert> {
    let w = &s.rate_window;
    // An instance's decisions, all of them: the failure policy's share is over these.
    let decisions = "sum by (job, instance) (tollgate:decisions:rate)";
    // An adaptive limit's requests, summed over its partitions (`admitted` and `rejected`
    // partition them; the other outcomes are what became of the admitted).
    let adaptive = |outcome: &str| {
        format!(
            "sum by (job, instance, limit) (rate({}[{w}]))",
            s.m("tollgate_adaptive_requests_total", outcome)
        )
    };
    let adaptive_seen = adaptive("outcome=~\"admitted|rejected\"");
    let adaptive_gauge = |name: &str| format!("max by (job, instance, limit) ({})", s.m(name, ""));
    vec![
        alert(
            "TollgateStoreFailing",
            format!("sum by (job, instance) (tollgate:failure_policy:rate) / {decisions}"),
            format!("> {}", s.store_failing_ratio),
            "5m",
            "warning",
            "tollgate's store is failing: requests are decided by the failure policy",
            "{{ $labels.instance }} ({{ $labels.job }}) decided {{ $value | humanizePercentage }} of its requests by its failure policy (fail open, the local fallback or fail closed) instead of its store.",
        ),
        alert(
            "TollgateFailOpen",
            format!(
                "sum by (job, instance) (tollgate:failure_policy:rate{{outcome=\"fail_open\"}}) / {decisions}"
            ),
            format!("> {}", s.store_failing_ratio),
            "1m",
            "critical",
            "tollgate fails open: rate limits are lifted",
            "{{ $labels.instance }} ({{ $labels.job }}) let {{ $value | humanizePercentage }} of its requests through unlimited because its store fails and its failure policy is fail-open.",
        ),
        alert(
            "TollgateCircuitBreakerOpen",
            format!(
                "max by (job, instance, backend) ({})",
                s.m("tollgate_circuit_breaker_open", "")
            ),
            "== 1".into(),
            "1m",
            "warning",
            "tollgate's circuit breaker to its store is open",
            "{{ $labels.instance }} ({{ $labels.job }}) stopped calling its {{ $labels.backend }} store after repeated failures; decisions follow the failure policy until a probe succeeds.",
        ),
        alert(
            "TollgateStoreMemoryNearLimit",
            format!(
                "max by (job, backend) ({}) / max by (job, backend) ({} > 0)",
                s.m("tollgate_store_memory_used_bytes", ""),
                s.m("tollgate_store_memory_max_bytes", ""),
            ),
            format!("> {}", s.memory_ratio),
            "5m",
            "warning",
            "tollgate's store is near its memory limit",
            "The {{ $labels.backend }} store of {{ $labels.job }} uses {{ $value | humanizePercentage }} of its maxmemory: at the limit it refuses writes or evicts rate-limit keys.",
        ),
        alert(
            "TollgateStoreEvicting",
            format!(
                "max by (job, backend) (rate({}[{w}]))",
                s.m("tollgate_store_evicted_keys_total", "")
            ),
            "> 0".into(),
            "5m",
            "warning",
            "tollgate's store is evicting keys: counts are lost",
            "The {{ $labels.backend }} store of {{ $labels.job }} evicts {{ $value | humanize }} keys a second: each evicted rate-limit key is a client's count forgotten.",
        ),
        alert(
            "TollgateLocalKeysEvicting",
            format!(
                "sum by (job, instance) (rate({}[{w}]))",
                s.m("tollgate_local_evicted_keys_total", "")
            ),
            "> 0".into(),
            "10m",
            "warning",
            "tollgate's local key table is full and evicting",
            "{{ $labels.instance }} ({{ $labels.job }}) evicts {{ $value | humanize }} local buckets a second to make room: an evicted client starts afresh.",
        ),
        alert(
            "TollgateStoreSlow",
            "max by (job, instance, backend) (tollgate:backend_latency_seconds:p99)".into(),
            format!("> {}", s.store_p99_seconds),
            "5m",
            "warning",
            "tollgate's store p99 latency is near the call timeout",
            "{{ $labels.instance }} ({{ $labels.job }}): the {{ $labels.backend }} store's p99 is {{ $value | humanizeDuration }}; past the call timeout, decisions fail and follow the failure policy.",
        ),
        alert(
            "TollgatePolicyLimitingUnusually",
            "tollgate:policy_limited:ratio".into(),
            format!(
                "> {} and on (job, policy) sum by (job, policy) (tollgate:decisions:rate) > {}",
                s.limited_ratio, s.limited_min_rps
            ),
            "10m",
            "warning",
            "a tollgate policy refuses an unusual share of its requests",
            "Policy {{ $labels.policy }} of {{ $labels.job }} refuses {{ $value | humanizePercentage }} of its requests: a limit set too low, a client misbehaving, or an attack.",
        ),
        alert(
            "TollgateApproxOverLimitRising",
            format!(
                "max by (job) (rate({}[{w}]))",
                s.m("tollgate_approx_over_limit_units_total", "")
            ),
            format!("> {}", s.approx_over_limit_rps),
            "10m",
            "warning",
            "tollgate's approximate mode over-admits",
            "{{ $labels.job }}: the approximate mode estimates {{ $value | humanize }} units a second admitted over their limits: allowances too large for the traffic, or a partitioned fleet.",
        ),
        // The gauges are set when a window of samples closes: they keep their last value
        // when traffic stops, so the limit must also see requests; and a limit whose range is
        // one value (minimum = maximum) is always at its minimum.
        alert(
            "TollgateAdaptiveLimitAtMinimum",
            adaptive_gauge("tollgate_adaptive_limit"),
            format!(
                "<= on (job, instance, limit) {min} \
                 and on (job, instance, limit) ({min} < on (job, instance, limit) {max}) \
                 and on (job, instance, limit) {adaptive_seen} > 0",
                min = adaptive_gauge("tollgate_adaptive_limit_min"),
                max = adaptive_gauge("tollgate_adaptive_limit_max"),
            ),
            "10m",
            "warning",
            "tollgate's adaptive limit is pinned at its minimum",
            "The adaptive limit {{ $labels.limit }} of {{ $labels.instance }} ({{ $labels.job }}) has stayed at its minimum while serving requests: the service behind it is overloaded or slow whatever the load, or the minimum is too high to protect it.",
        ),
        alert(
            "TollgateAdaptiveRejecting",
            format!("{} / {adaptive_seen}", adaptive("outcome=\"rejected\"")),
            format!(
                "> {} and on (job, instance, limit) {adaptive_seen} > {}",
                s.adaptive_rejected_ratio, s.adaptive_min_rps
            ),
            "10m",
            "warning",
            "tollgate's adaptive limit rejects a steady share of requests: the service is shedding load",
            "The adaptive limit {{ $labels.limit }} of {{ $labels.instance }} ({{ $labels.job }}) rejects {{ $value | humanizePercentage }} of its requests: the service behind it cannot take more at its current latency, and the limit sheds the rest.",
        ),
    ]
}

/// The recording rules' file.
pub(crate) fn rules_yaml(s: &Settings) -> String {
    let rules: Vec<Value> = recording_rules(s)
        .into_iter()
        .map(|(record, expr)| json!({ "record": record, "expr": expr }))
        .collect();
    yaml(&json!({ "groups": [{ "name": "tollgate.rules", "rules": rules }] }))
}

/// The alerts' file.
pub(crate) fn alerts_yaml(s: &Settings) -> String {
    let rules: Vec<Value> = alerts(s)
        .into_iter()
        .map(|a| {
            json!({
                "alert": a.name,
                "expr": a.expr,
                "for": s.for_all.as_deref().unwrap_or(a.r#for),
                "labels": { "severity": a.severity },
                "annotations": {
                    "summary": a.summary,
                    "description": a.description,
                    "runbook_url": format!("{}#{}", s.runbook, a.name.to_lowercase()),
                },
            })
        })
        .collect();
    yaml(&json!({ "groups": [{ "name": "tollgate.alerts", "rules": rules }] }))
}

fn yaml(v: &Value) -> String {
    let text = serde_norway::to_string(v).unwrap_or_default();
    format!("# Generated by `cargo run --example monitoring`; see docs/observability.md.\n{text}")
}

/// A panel: title, description (what to do when it looks wrong), unit, and its queries
/// (expression, legend).
struct Panel {
    title: &'static str,
    description: &'static str,
    unit: &'static str,
    targets: Vec<(String, &'static str)>,
}

/// The dashboard's rows of panels, with the dashboard's own selector (its variables).
fn rows(s: &Settings) -> Vec<(&'static str, Vec<Panel>)> {
    let base = |extra: &str| {
        let mut parts = vec!["job=~\"$job\"", "instance=~\"$instance\""];
        if !s.selector.is_empty() {
            parts.insert(0, s.selector.as_str());
        }
        if !extra.is_empty() {
            parts.push(extra);
        }
        parts.join(",")
    };
    let m = |name: &str, extra: &str| format!("{name}{{{}}}", base(extra));
    let pol = |name: &str, extra: &str| {
        let e = if extra.is_empty() {
            "policy=~\"$policy\"".to_owned()
        } else {
            format!("policy=~\"$policy\",{extra}")
        };
        m(name, &e)
    };
    let r = "$__rate_interval";
    vec![
        (
            "Decisions",
            vec![
                Panel {
                    title: "Decisions by outcome",
                    description: "Requests a second per policy and outcome. A sudden rise of `denied` is a client over its quota (or a limit set too low); `missing_key` and `no_peer_address` are requests the key extractor could not key: check the trusted proxies and the key's header.",
                    unit: "reqps",
                    targets: vec![(
                        format!(
                            "sum by (policy, outcome) (rate({}[{r}]))",
                            pol("tollgate_decisions_total", "")
                        ),
                        "{{policy}} {{outcome}}",
                    )],
                },
                Panel {
                    title: "Limited ratio",
                    description: "The share of each policy's requests refused (denied or never fits). A share that jumps is a misconfigured limit or an attack: look at which quota refuses in `Decisions by outcome` (label `quota`).",
                    unit: "percentunit",
                    targets: vec![(
                        format!(
                            "sum by (policy) (rate({}[{r}])) / sum by (policy) (rate({}[{r}]))",
                            pol("tollgate_decisions_total", "outcome=~\"denied|never_fits\""),
                            pol("tollgate_decisions_total", "")
                        ),
                        "{{policy}}",
                    )],
                },
                Panel {
                    title: "Near the limit",
                    description: "Allowed requests after which the tightest quota had under a tenth left. Rising while denials stay low: clients are about to be refused; raise the quota if that is their normal load.",
                    unit: "reqps",
                    targets: vec![(
                        format!(
                            "sum by (policy, quota) (rate({}[{r}]))",
                            pol("tollgate_near_limit_total", "")
                        ),
                        "{{policy}} {{quota}}",
                    )],
                },
                Panel {
                    title: "Never fits",
                    description: "Requests whose cost is more than a quota's whole limit (413): they can never pass. Any at all is a client sending a cost the policy never allows, or a limit set below the largest cost.",
                    unit: "reqps",
                    targets: vec![(
                        format!(
                            "sum by (policy, quota) (rate({}[{r}]))",
                            pol("tollgate_decisions_total", "outcome=\"never_fits\"")
                        ),
                        "{{policy}} {{quota}}",
                    )],
                },
                Panel {
                    title: "Deny cache hits",
                    description: "Denials answered from the in-process deny cache without asking the store. High under an attack on one key: the cache is what keeps the store's load flat.",
                    unit: "reqps",
                    targets: vec![(
                        format!(
                            "sum by (policy) (rate({}[{r}]))",
                            pol("tollgate_deny_cache_hits_total", "")
                        ),
                        "{{policy}}",
                    )],
                },
            ],
        ),
        (
            "Store",
            vec![
                Panel {
                    title: "Failure policy engaged",
                    description: "Requests decided without the store: `fail_open` (limits lifted), `fallback_allowed`/`fallback_denied` (the local fallback), `fail_closed` (refused with 503). Anything here means the store is failing: see `Store errors` and the breaker.",
                    unit: "reqps",
                    targets: vec![(
                        format!(
                            "sum by (instance, outcome) (rate({}[{r}]))",
                            m(
                                "tollgate_decisions_total",
                                "outcome=~\"fail_open|fallback_allowed|fallback_denied|fail_closed|shadow_error\""
                            )
                        ),
                        "{{instance}} {{outcome}}",
                    )],
                },
                Panel {
                    title: "Store latency",
                    description: "p50 and p99 from a decision's start to the store's answer. A p99 near the call timeout (100 ms by default) turns into failures: check the store's load and the network.",
                    unit: "s",
                    targets: vec![
                        (
                            format!(
                                "histogram_quantile(0.5, sum by (backend, le) (rate({}[{r}])))",
                                m("tollgate_backend_latency_seconds_bucket", "")
                            ),
                            "p50 {{backend}}",
                        ),
                        (
                            format!(
                                "histogram_quantile(0.99, sum by (backend, le) (rate({}[{r}])))",
                                m("tollgate_backend_latency_seconds_bucket", "")
                            ),
                            "p99 {{backend}}",
                        ),
                    ],
                },
                Panel {
                    title: "Store errors",
                    description: "Failed store calls by kind: `timeout` (slow store or network), `unavailable` (down, refused, read-only), `protocol` (an answer tollgate cannot read: a version mismatch).",
                    unit: "reqps",
                    targets: vec![(
                        format!(
                            "sum by (backend, kind) (rate({}[{r}]))",
                            m("tollgate_backend_errors_total", "")
                        ),
                        "{{backend}} {{kind}}",
                    )],
                },
                Panel {
                    title: "Circuit breaker",
                    description: "1 while the breaker to the store is open (calls are not made; the failure policy decides). Open for long: the store is down for this instance.",
                    unit: "short",
                    targets: vec![(
                        format!(
                            "max by (instance, backend) ({})",
                            m("tollgate_circuit_breaker_open", "")
                        ),
                        "{{instance}} {{backend}}",
                    )],
                },
                Panel {
                    title: "Fleet size",
                    description: "Instances sharing the store, as each counts them (the local fallback gives each its share of a limit). A count that differs between instances, or drops, is instances that cannot reach the store.",
                    unit: "short",
                    targets: vec![(
                        format!(
                            "max by (instance, backend) ({})",
                            m("tollgate_fleet_size", "")
                        ),
                        "{{instance}} {{backend}}",
                    )],
                },
                Panel {
                    title: "Store memory",
                    description: "The store's memory in use against its limit (Redis `maxmemory`; 0 is none). Near the limit it refuses writes (noeviction) or evicts keys: raise the limit or give rate limits their own Redis.",
                    unit: "bytes",
                    targets: vec![
                        (
                            format!(
                                "max by (backend) ({})",
                                m("tollgate_store_memory_used_bytes", "")
                            ),
                            "used {{backend}}",
                        ),
                        (
                            format!(
                                "max by (backend) ({})",
                                m("tollgate_store_memory_max_bytes", "")
                            ),
                            "limit {{backend}}",
                        ),
                    ],
                },
                Panel {
                    title: "Store evictions",
                    description: "Keys the store evicted: each evicted rate-limit key is a client's count lost (the limit resets for it). Any at all: give the store more memory or a noeviction policy.",
                    unit: "cps",
                    targets: vec![(
                        format!(
                            "max by (backend) (rate({}[{r}]))",
                            m("tollgate_store_evicted_keys_total", "")
                        ),
                        "{{backend}}",
                    )],
                },
            ],
        ),
        (
            "Local keys",
            vec![
                Panel {
                    title: "Local tracked keys",
                    description: "Buckets the local backends hold (Redis fallbacks included). Growing without bound is keys that never repeat (a key from a header clients choose).",
                    unit: "short",
                    targets: vec![(
                        format!(
                            "sum by (instance) ({})",
                            m("tollgate_local_tracked_keys", "")
                        ),
                        "{{instance}}",
                    )],
                },
                Panel {
                    title: "Local evictions",
                    description: "Buckets evicted from a full table to make room: an evicted client starts afresh. Raise the key cap, or key by something with fewer values.",
                    unit: "cps",
                    targets: vec![(
                        format!(
                            "sum by (instance) (rate({}[{r}]))",
                            m("tollgate_local_evicted_keys_total", "")
                        ),
                        "{{instance}}",
                    )],
                },
            ],
        ),
        (
            "Approximate mode",
            vec![
                Panel {
                    title: "Store calls",
                    description: "The approximate mode's calls to Redis by outcome. `failed` rising: Redis is failing, and instances decide from their last counts.",
                    unit: "reqps",
                    targets: vec![(
                        format!(
                            "sum by (outcome) (rate({}[{r}]))",
                            m("tollgate_approx_store_calls_total", "")
                        ),
                        "{{outcome}}",
                    )],
                },
                Panel {
                    title: "Keys and allowances",
                    description: "Keys counted; allowances granted, exhausted and recalled; keys announced past their allowance. Many recalls: keys shared by many instances at once; the allowance is then small.",
                    unit: "short",
                    targets: vec![
                        (
                            format!("sum by (instance) ({})", m("tollgate_approx_keys", "")),
                            "keys {{instance}}",
                        ),
                        (
                            format!(
                                "sum by (event) (rate({}[{r}]))",
                                m("tollgate_approx_allowances_total", "")
                            ),
                            "{{event}}",
                        ),
                        (
                            format!(
                                "sum by (direction) (rate({}[{r}]))",
                                m("tollgate_approx_announcements_total", "")
                            ),
                            "announced {{direction}}",
                        ),
                    ],
                },
                Panel {
                    title: "Estimated over-limit units",
                    description: "Units the fleet admitted over the limits, as each instance read it (take the largest, not the sum). Rising: allowances too large for the traffic, or instances that cannot see each other's counts.",
                    unit: "short",
                    targets: vec![(
                        format!(
                            "max by (job) (rate({}[{r}]))",
                            m("tollgate_approx_over_limit_units_total", "")
                        ),
                        "{{job}}",
                    )],
                },
                Panel {
                    title: "Writes and reads",
                    description: "Increments and reads the approximate mode sends to Redis a second, and the units the increments carry: its load on Redis. Writes close to the decisions' rate: allowances too small to save round trips.",
                    unit: "reqps",
                    targets: vec![
                        (
                            format!(
                                "sum (rate({}[{r}]))",
                                m("tollgate_approx_store_writes_total", "")
                            ),
                            "writes",
                        ),
                        (
                            format!(
                                "sum (rate({}[{r}]))",
                                m("tollgate_approx_store_reads_total", "")
                            ),
                            "reads",
                        ),
                        (
                            format!(
                                "sum (rate({}[{r}]))",
                                m("tollgate_approx_units_sent_total", "")
                            ),
                            "units sent",
                        ),
                    ],
                },
            ],
        ),
        (
            "Rate limit service",
            vec![
                Panel {
                    title: "RLS calls",
                    description: "Calls to the Envoy rate limit service by domain and answer. `unavailable` rising: its store fails, and the gateway applies its own failure mode.",
                    unit: "reqps",
                    targets: vec![(
                        format!(
                            "sum by (domain, code) (rate({}[{r}]))",
                            m("tollgate_rls_requests_total", "")
                        ),
                        "{{domain}} {{code}}",
                    )],
                },
                Panel {
                    title: "RLQS streams and assignments",
                    description: "Envoy's rate limit quota service: streams open (one per Envoy), usage reports a second by domain (each Envoy reports every 5 s), assignments answered by action, and reported buckets past a stream's cap (given no assignment: the filter's no_assignment_behavior decides for them). `deny_all` rising: buckets whose long windows are spent; `abandon`: rules removed.",
                    unit: "short",
                    targets: vec![
                        (
                            format!("sum ({})", m("tollgate_rlqs_streams", "")),
                            "streams",
                        ),
                        (
                            format!(
                                "sum by (domain) (rate({}[{r}]))",
                                m("tollgate_rlqs_reports_total", "")
                            ),
                            "reports/s {{domain}}",
                        ),
                        (
                            format!(
                                "sum by (action) (rate({}[{r}]))",
                                m("tollgate_rlqs_assignments_total", "")
                            ),
                            "assignments/s {{action}}",
                        ),
                        (
                            format!(
                                "sum (rate({}[{r}]))",
                                m("tollgate_rlqs_buckets_refused_total", "")
                            ),
                            "buckets past the cap/s",
                        ),
                    ],
                },
            ],
        ),
        (
            "Adaptive concurrency",
            vec![
                Panel {
                    title: "Adaptive limit and in flight",
                    description: "The adaptive limit, its range (minimum and maximum), and the requests in flight. A limit at its minimum for long while requests come: the service behind it is slow whatever the load (or the minimum is too high to protect it). The gauges are set when a window of samples closes: with no traffic they keep their last values.",
                    unit: "short",
                    targets: vec![
                        (
                            format!(
                                "max by (instance, limit) ({})",
                                m("tollgate_adaptive_limit", "")
                            ),
                            "limit {{instance}} {{limit}}",
                        ),
                        (
                            format!(
                                "max by (instance, limit) ({})",
                                m("tollgate_adaptive_limit_min", "")
                            ),
                            "minimum {{instance}} {{limit}}",
                        ),
                        (
                            format!(
                                "max by (instance, limit) ({})",
                                m("tollgate_adaptive_limit_max", "")
                            ),
                            "maximum {{instance}} {{limit}}",
                        ),
                        (
                            format!(
                                "max by (instance, limit) ({})",
                                m("tollgate_adaptive_in_flight", "")
                            ),
                            "in flight {{instance}} {{limit}}",
                        ),
                    ],
                },
                Panel {
                    title: "Adaptive outcomes per partition",
                    description: "Requests admitted, rejected, dropped (overload) and cancelled, per partition. Critical partitions rejected: their share is too small for their demand.",
                    unit: "reqps",
                    targets: vec![(
                        format!(
                            "sum by (limit, partition, outcome) (rate({}[{r}]))",
                            m("tollgate_adaptive_requests_total", "")
                        ),
                        "{{limit}} {{partition}} {{outcome}}",
                    )],
                },
                Panel {
                    title: "Adaptive shedding by criticality",
                    description: "Requests admitted and refused per criticality level (critical, default, sheddable), and those refused because their flow held more than its share of a full limit. Under overload sheddable is refused first and critical last; over-share refusals rising with one tenant's load: fairness keeps that tenant from taking the others' slots.",
                    unit: "reqps",
                    targets: vec![
                        (
                            format!(
                                "sum by (limit, criticality, outcome) (rate({}[{r}]))",
                                m("tollgate_adaptive_criticality_total", "")
                            ),
                            "{{limit}} {{criticality}} {{outcome}}",
                        ),
                        (
                            format!(
                                "sum by (limit, criticality) (rate({}[{r}]))",
                                m("tollgate_adaptive_over_share_total", "")
                            ),
                            "{{limit}} {{criticality}} over share",
                        ),
                    ],
                },
                Panel {
                    title: "Adaptive RTT",
                    description: "The window's mean round trip and the no-load baseline. The sample far above the baseline: requests queue in the service, and the limit shrinks.",
                    unit: "s",
                    targets: vec![(
                        format!(
                            "max by (limit, kind) ({})",
                            m("tollgate_adaptive_rtt_seconds", "")
                        ),
                        "{{limit}} {{kind}}",
                    )],
                },
            ],
        ),
        (
            "Clients and deadlines",
            vec![
                Panel {
                    title: "Calls throttled and retries",
                    description: "Calls this process's clients refused themselves (adaptive throttling: the upstream accepted too few lately), and retries taken or refused by the retry budget, per upstream. Throttled rising: the upstream is overloaded or failing, and its clients keep their load to about twice what it accepts. Retries refused: the budget holds a retry storm back.",
                    unit: "reqps",
                    targets: vec![
                        (
                            format!(
                                "sum by (upstream) (rate({}[{r}]))",
                                m("tollgate_client_throttled_total", "")
                            ),
                            "throttled {{upstream}}",
                        ),
                        (
                            format!(
                                "sum by (upstream, outcome) (rate({}[{r}]))",
                                m("tollgate_client_retries_total", "")
                            ),
                            "retries {{upstream}} {{outcome}}",
                        ),
                    ],
                },
                Panel {
                    title: "Requests dropped at their deadline",
                    description: "Requests whose caller's deadline (grpc-timeout or the deadline header) passed: before they started, or while they waited or ran (their work dropped). Rising: callers give up before this service answers, so it is slower than they wait.",
                    unit: "reqps",
                    targets: vec![(
                        format!(
                            "sum by (stage) (rate({}[{r}]))",
                            m("tollgate_deadline_dropped_total", "")
                        ),
                        "{{stage}}",
                    )],
                },
            ],
        ),
    ]
}

/// The dashboard's JSON.
pub(crate) fn dashboard(s: &Settings) -> Value {
    let ds = json!({ "type": "prometheus", "uid": "${datasource}" });
    let mut panels = Vec::new();
    let (mut id, mut y) = (1, 0);
    for (row, list) in rows(s) {
        panels.push(json!({
            "type": "row", "title": row, "id": id, "collapsed": false, "panels": [],
            "gridPos": { "h": 1, "w": 24, "x": 0, "y": y },
        }));
        id += 1;
        y += 1;
        for (i, p) in list.into_iter().enumerate() {
            let targets: Vec<Value> = (p.targets.iter().enumerate())
                .map(|(j, (expr, legend))| {
                    json!({
                        "refId": char::from(b'A' + j as u8).to_string(),
                        "datasource": ds, "expr": expr, "legendFormat": legend,
                    })
                })
                .collect();
            panels.push(json!({
                "type": "timeseries", "id": id, "title": p.title, "description": p.description,
                "datasource": ds, "targets": targets,
                "gridPos": { "h": 8, "w": 12, "x": (i % 2) * 12, "y": y + (i / 2) as i64 * 8 },
                "fieldConfig": { "defaults": { "unit": p.unit }, "overrides": [] },
                "options": { "legend": { "displayMode": "list", "placement": "bottom" }, "tooltip": { "mode": "multi" } },
            }));
            id += 1;
        }
        y += list_height(&panels);
    }
    let selector = if s.selector.is_empty() {
        String::new()
    } else {
        format!("{},", s.selector)
    };
    let var = |name: &str, query: String| {
        json!({
            "name": name, "label": name, "type": "query", "datasource": ds,
            "query": { "query": query, "refId": name }, "definition": query,
            "includeAll": true, "multi": true, "allValue": ".*", "refresh": 2, "sort": 1,
            "current": { "text": "All", "value": "$__all" },
        })
    };
    json!({
        "title": "tollgate",
        "uid": null,
        "description": "tollgate's rate limits, store, approximate mode, rate limit service and adaptive concurrency. Generated by `cargo run --example monitoring`; see docs/observability.md.",
        "tags": ["tollgate", "rate-limit"],
        "editable": true,
        "schemaVersion": 39,
        "time": { "from": "now-1h", "to": "now" },
        "refresh": "30s",
        "templating": { "list": [
            { "name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "current": {} },
            var("job", format!("label_values({{{selector}__name__=~\"tollgate_.+\"}}, job)")),
            var("instance", format!("label_values({{{selector}__name__=~\"tollgate_.+\",job=~\"$job\"}}, instance)")),
            var("policy", format!("label_values(tollgate_decisions_total{{{selector}job=~\"$job\"}}, policy)")),
        ] },
        "panels": panels,
    })
}

/// The height the last row's panels take (two to a line, 8 high).
fn list_height(panels: &[Value]) -> i64 {
    let last_row = panels.iter().rposition(|p| p["type"] == "row").unwrap_or(0);
    let n = (panels.len() - last_row - 1) as i64;
    (n + 1) / 2 * 8
}

/// A panel's expression with the dashboard's variables filled in as Grafana does with every
/// value selected (`$__rate_interval` as `1m`).
#[allow(dead_code)] // used by tests/monitoring.rs and tests/monitoring_live.rs
pub(crate) fn filled(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$job", ".*")
        .replace("$instance", ".*")
        .replace("$policy", ".*")
}

/// Every file: name and text.
pub(crate) fn files(s: &Settings) -> Vec<(&'static str, String)> {
    let dash = serde_json::to_string_pretty(&dashboard(s)).unwrap_or_default() + "\n";
    vec![
        ("tollgate-dashboard.json", dash),
        ("tollgate-alerts.yaml", alerts_yaml(s)),
        ("tollgate-rules.yaml", rules_yaml(s)),
    ]
}

#[allow(dead_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (settings, out) = Settings::from_args(&args)?;
    std::fs::create_dir_all(&out)?;
    for (name, text) in files(&settings) {
        let path = std::path::Path::new(&out).join(name);
        std::fs::write(&path, text)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
