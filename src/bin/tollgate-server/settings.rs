//! The server's settings, from environment variables: envoyproxy/ratelimit's names where they
//! mean the same here, tollgate's own (those of `examples/rls`) for the rest. Every value is
//! checked at start; a wrong one stops the server with a message naming the variable.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

/// Everything the server reads from its environment.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// `HOST` / `PORT`: the HTTP endpoints (8080).
    pub(crate) http: SocketAddr,
    /// `GRPC_HOST` / `GRPC_PORT`: the gRPC services (8081).
    pub(crate) grpc: SocketAddr,
    pub(crate) rules: RuleSource,
    /// How often the rules' files are read again to see whether they changed.
    pub(crate) reload_every: Duration,
    pub(crate) store: StoreSettings,
    /// `HEADERS=off`: no IETF fields in the answers.
    pub(crate) headers: bool,
    /// `RESPONSE_DYNAMIC_METADATA=true`.
    pub(crate) dynamic_metadata: bool,
    /// `USE_PROMETHEUS` (on unless `false`): `/metrics`.
    pub(crate) prometheus: bool,
    pub(crate) log: LogSettings,
    /// `GRPC_SERVER_USE_TLS` and its files.
    pub(crate) tls: Option<TlsSettings>,
    /// `DRAIN_SECONDS` (5): how long the server keeps answering after SIGTERM, unhealthy, before
    /// it stops taking connections.
    pub(crate) drain: Duration,
    /// `STORE_CHECK_MS` (2000): how often the store is asked whether it answers.
    pub(crate) store_check: Duration,
}

/// Where the rules come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RuleSource {
    /// `RULES_FILE`: one file, one domain.
    File(PathBuf),
    /// `RULES_DIR`: every `.yaml` / `.yml` file in the directory, one domain each.
    Dir(PathBuf),
    /// envoyproxy/ratelimit's layout: every file (not starting with a dot) in
    /// `RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY` (`config` by default).
    Runtime(PathBuf),
}

/// The store and how it fails.
#[derive(Debug, Clone)]
pub(crate) struct StoreSettings {
    pub(crate) kind: StoreKind,
    /// `ON_FAILURE`: `fallback` (default), `open`, `closed`.
    pub(crate) on_failure: OnFailure,
    /// `STORE_TIMEOUT_MS`: the bound on every call to the store (the backends' default, 100 ms).
    pub(crate) timeout: Option<Duration>,
    /// `LOCAL_CACHE_SIZE_IN_BYTES`: the deny cache's size, in bytes (`None`: the default).
    pub(crate) deny_cache_bytes: Option<usize>,
}

/// `ON_FAILURE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnFailure {
    Fallback,
    Open,
    Closed,
}

impl OnFailure {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            OnFailure::Fallback => "fallback",
            OnFailure::Open => "open",
            OnFailure::Closed => "closed",
        }
    }
}

/// `BACKEND`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoreKind {
    Local,
    Redis(RedisSettings),
    /// `redis_approx`; `APPROX=sync` for the synchronous mode.
    RedisApprox(RedisSettings, bool),
    /// `DATABASE_URL`.
    Postgres(String),
    Mysql(String),
}

impl StoreKind {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            StoreKind::Local => "local",
            StoreKind::Redis(_) => "redis",
            StoreKind::RedisApprox(..) => "redis_approx",
            StoreKind::Postgres(_) => "postgres",
            StoreKind::Mysql(_) => "mysql",
        }
    }
}

/// Redis, as envoyproxy/ratelimit names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RedisSettings {
    /// `REDIS_TYPE=single` (the default): one URL.
    Single(String),
    /// `REDIS_TYPE=cluster`, or tollgate's `REDIS_CLUSTER_NODES`: the seed nodes' URLs.
    Cluster(Vec<String>),
    /// `REDIS_TYPE=sentinel`: `REDIS_URL` is `master,host:port,host:port...`.
    Sentinel {
        master: String,
        sentinels: Vec<String>,
    },
}

/// `REDIS_TLS_CACERT`, `REDIS_TLS_CLIENT_CERT`, `REDIS_TLS_CLIENT_KEY`: files read at start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RedisTlsFiles {
    pub(crate) ca: Option<PathBuf>,
    pub(crate) client: Option<(PathBuf, PathBuf)>,
}

/// `LOG_LEVEL` and `LOG_FORMAT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LogSettings {
    /// A `tracing` filter directive: the level, lower-cased (`warn`), or `RUST_LOG` as given.
    pub(crate) filter: String,
    pub(crate) json: bool,
}

/// The gRPC server's certificate, and the CA its clients' certificates must chain to (mTLS).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TlsSettings {
    pub(crate) cert: PathBuf,
    pub(crate) key: PathBuf,
    pub(crate) client_ca: Option<PathBuf>,
}

/// The variables of envoyproxy/ratelimit this server reads with another meaning, or not at
/// all: named at start, so that a migrated deployment hears what it set in vain.
pub(crate) const NOT_SUPPORTED: &[(&str, &str)] = &[
    (
        "REDIS_POOL_SIZE",
        "one multiplexed connection per Redis node carries every call (pipelined); no pool to size",
    ),
    (
        "REDIS_PIPELINE_WINDOW",
        "calls made at the same moment are batched without a window",
    ),
    ("REDIS_PIPELINE_LIMIT", "calls are batched without a window"),
    (
        "REDIS_PERSECOND",
        "one store holds every window; a second Redis for per-second limits is not supported",
    ),
    (
        "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
        "the Redis server's name is always verified",
    ),
    (
        "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
        "the store is checked every STORE_CHECK_MS and /healthcheck follows ON_FAILURE",
    ),
    ("MEMCACHE_HOST_PORT", "memcached is not a store here"),
    ("BACKEND_TYPE", "BACKEND names the store here"),
    ("CONFIG_TYPE", "rules come from files only (no xDS)"),
    (
        "MERGE_DOMAIN_CONFIG",
        "a domain given in two files is an error",
    ),
    ("SHADOW_MODE", "use shadow_mode on the rules"),
    (
        "LIMIT_RESPONSE_HEADERS_ENABLED",
        "the IETF RateLimit fields are sent by default (HEADERS=off turns them off)",
    ),
    ("USE_STATSD", "metrics are Prometheus's, at /metrics"),
    ("USE_DOG_STATSD", "metrics are Prometheus's, at /metrics"),
    ("PROMETHEUS_ADDR", "/metrics is served on PORT"),
    ("DEBUG_PORT", "/rlconfig is served on PORT"),
    ("GRPC_UDS", "gRPC is served on TCP only"),
    (
        "GRPC_CLIENT_TLS_SAN",
        "clients are checked against GRPC_CLIENT_TLS_CACERT, not a SAN",
    ),
    ("NEAR_LIMIT_RATIO", "no near-limit statistics"),
    (
        "EXPIRATION_JITTER_MAX_SECONDS",
        "keys expire when their window ends",
    ),
    (
        "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
        "a refused request takes nothing (always)",
    ),
    (
        "CACHE_KEY_PREFIX",
        "keys are prefixed by the backend; not configurable here",
    ),
    ("TRACING_ENABLED", "no OpenTelemetry tracing"),
];

/// A configuration error: the variable and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SettingsError(pub(crate) String);

impl std::fmt::Display for SettingsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SettingsError {}

fn err(var: &str, reason: impl std::fmt::Display) -> SettingsError {
    SettingsError(format!("{var}: {reason}"))
}

/// Reads the settings through `get` (the environment, or a map in tests). An empty value is
/// the same as none.
pub(crate) fn read(get: impl Fn(&str) -> Option<String>) -> Result<Settings, SettingsError> {
    let get = |name: &str| get(name).filter(|v| !v.trim().is_empty());
    let host = |var: &str| -> Result<IpAddr, SettingsError> {
        get(var).map_or(Ok(IpAddr::V4(Ipv4Addr::UNSPECIFIED)), |h| {
            h.trim()
                .parse()
                .map_err(|_| err(var, format!("{h:?} is not an IP address")))
        })
    };
    let port = |var: &str, default: u16| -> Result<u16, SettingsError> {
        get(var).map_or(Ok(default), |p| {
            p.trim()
                .parse()
                .map_err(|_| err(var, format!("{p:?} is not a port")))
        })
    };
    let http = SocketAddr::new(host("HOST")?, port("PORT", 8080)?);
    let grpc = SocketAddr::new(host("GRPC_HOST")?, port("GRPC_PORT", 8081)?);
    let boolean = |var: &str, default: bool| -> Result<bool, SettingsError> {
        get(var).map_or(Ok(default), |v| {
            parse_bool(&v).ok_or_else(|| err(var, "use true or false"))
        })
    };
    let millis = |var: &str, default: u64| -> Result<Duration, SettingsError> {
        get(var).map_or(Ok(Duration::from_millis(default)), |v| {
            match v.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
                _ => Err(err(
                    var,
                    format!("{v:?}: a whole number of milliseconds, > 0"),
                )),
            }
        })
    };

    let rules = rule_source(&get)?;
    let store = store(&get, &boolean)?;
    let tls = if boolean("GRPC_SERVER_USE_TLS", false)? {
        let file = |var: &str| {
            get(var)
                .map(PathBuf::from)
                .ok_or_else(|| err(var, "required with GRPC_SERVER_USE_TLS=true"))
        };
        Some(TlsSettings {
            cert: file("GRPC_SERVER_TLS_CERT")?,
            key: file("GRPC_SERVER_TLS_KEY")?,
            client_ca: get("GRPC_CLIENT_TLS_CACERT").map(PathBuf::from),
        })
    } else {
        None
    };
    let log = LogSettings {
        filter: match (get("RUST_LOG"), get("LOG_LEVEL")) {
            (Some(directives), _) => directives,
            (None, Some(level)) => log_level(&level)?,
            (None, None) => "info".to_owned(),
        },
        json: match get("LOG_FORMAT")
            .as_deref()
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            None | Some("text") => false,
            Some("json") => true,
            Some(other) => return Err(err("LOG_FORMAT", format!("{other:?}: text or json"))),
        },
    };
    let drain = match get("DRAIN_SECONDS") {
        None => Duration::from_secs(5),
        Some(v) => Duration::from_secs_f64(
            v.trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && (0.0..=3600.0).contains(s))
                .ok_or_else(|| err("DRAIN_SECONDS", format!("{v:?}: seconds, 0 to 3600")))?,
        ),
    };
    Ok(Settings {
        http,
        grpc,
        rules,
        reload_every: millis("RULES_RELOAD_MS", 1000)?,
        store,
        headers: match get("HEADERS").as_deref() {
            None | Some("on") => true,
            Some("off") => false,
            Some(other) => return Err(err("HEADERS", format!("{other:?}: on or off"))),
        },
        dynamic_metadata: boolean("RESPONSE_DYNAMIC_METADATA", false)?,
        prometheus: boolean("USE_PROMETHEUS", true)?,
        log,
        tls,
        drain,
        store_check: millis("STORE_CHECK_MS", 2000)?,
    })
}

fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// envoyproxy/ratelimit's levels (logrus's: `debug`, `info`, `warn`, `error`, any case; also
/// `trace`, `warning`, `fatal`, `panic`).
fn log_level(level: &str) -> Result<String, SettingsError> {
    Ok(match level.trim().to_ascii_lowercase().as_str() {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "warn" | "warning" => "warn",
        "error" | "fatal" | "panic" => "error",
        other => {
            return Err(err(
                "LOG_LEVEL",
                format!("{other:?}: one of debug, info, warn, error"),
            ));
        }
    }
    .to_owned())
}

fn rule_source(get: &impl Fn(&str) -> Option<String>) -> Result<RuleSource, SettingsError> {
    let given: Vec<&str> = ["RULES_FILE", "RULES_DIR", "RUNTIME_ROOT"]
        .into_iter()
        .filter(|v| get(v).is_some())
        .collect();
    if given.len() > 1 {
        return Err(SettingsError(format!(
            "{} are all set: give one source of rules",
            given.join(" and ")
        )));
    }
    if let Some(file) = get("RULES_FILE") {
        return Ok(RuleSource::File(file.into()));
    }
    if let Some(dir) = get("RULES_DIR") {
        return Ok(RuleSource::Dir(dir.into()));
    }
    if let Some(root) = get("RUNTIME_ROOT") {
        let mut path = PathBuf::from(root);
        if let Some(sub) = get("RUNTIME_SUBDIRECTORY") {
            path.push(sub);
        }
        path.push(get("RUNTIME_APPDIRECTORY").unwrap_or_else(|| "config".to_owned()));
        return Ok(RuleSource::Runtime(path));
    }
    Err(SettingsError(
        "no rules: set RULES_FILE (one file), RULES_DIR (a directory of .yaml files), or \
         RUNTIME_ROOT and RUNTIME_SUBDIRECTORY (envoyproxy/ratelimit's layout)"
            .to_owned(),
    ))
}

fn store(
    get: &impl Fn(&str) -> Option<String>,
    boolean: &impl Fn(&str, bool) -> Result<bool, SettingsError>,
) -> Result<StoreSettings, SettingsError> {
    let backend = get("BACKEND").unwrap_or_else(|| "local".to_owned());
    let redis = || redis(get, boolean);
    let database = |default: &str| get("DATABASE_URL").unwrap_or_else(|| default.to_owned());
    let kind = match backend.trim() {
        "local" | "memory" => StoreKind::Local,
        "redis" => StoreKind::Redis(redis()?),
        "redis_approx" => StoreKind::RedisApprox(
            redis()?,
            match get("APPROX").as_deref() {
                None | Some("async") => false,
                Some("sync") => true,
                Some(other) => return Err(err("APPROX", format!("{other:?}: async or sync"))),
            },
        ),
        "postgres" => StoreKind::Postgres(database("postgres://postgres@127.0.0.1:5432/test")),
        "mysql" => StoreKind::Mysql(database("mysql://root@127.0.0.1:3306/test")),
        other => {
            return Err(err(
                "BACKEND",
                format!("{other:?}: one of local, redis, redis_approx, postgres, mysql"),
            ));
        }
    };
    let on_failure = match get("ON_FAILURE").as_deref() {
        None | Some("fallback") | Some("local") => OnFailure::Fallback,
        Some("open") => OnFailure::Open,
        Some("closed") => OnFailure::Closed,
        Some(other) => {
            return Err(err(
                "ON_FAILURE",
                format!("{other:?}: fallback, open or closed"),
            ));
        }
    };
    let timeout = match get("STORE_TIMEOUT_MS") {
        None => None,
        Some(v) => Some(
            v.trim()
                .parse::<u64>()
                .ok()
                .filter(|ms| (1..=60_000).contains(ms))
                .map(Duration::from_millis)
                .ok_or_else(|| err("STORE_TIMEOUT_MS", format!("{v:?}: 1 to 60000")))?,
        ),
    };
    let deny_cache_bytes = match get("LOCAL_CACHE_SIZE_IN_BYTES") {
        None => None,
        Some(v) => Some(v.trim().parse::<usize>().map_err(|_| {
            err(
                "LOCAL_CACHE_SIZE_IN_BYTES",
                format!("{v:?}: a number of bytes"),
            )
        })?),
    };
    Ok(StoreSettings {
        kind,
        on_failure,
        timeout,
        deny_cache_bytes,
    })
}

/// Redis from envoyproxy/ratelimit's variables (`REDIS_TYPE`, `REDIS_URL` as `host:port`, a
/// Unix socket's path or a `redis://` URL, `REDIS_AUTH`, `REDIS_TLS`), or tollgate's
/// `REDIS_CLUSTER_NODES`.
fn redis(
    get: &impl Fn(&str) -> Option<String>,
    boolean: &impl Fn(&str, bool) -> Result<bool, SettingsError>,
) -> Result<RedisSettings, SettingsError> {
    let tls = boolean("REDIS_TLS", false)?;
    let auth = get("REDIS_AUTH");
    let url = |node: &str| redis_url(node, auth.as_deref(), tls);
    let list = |var: &str, v: &str| -> Result<Vec<String>, SettingsError> {
        let nodes: Vec<String> = (v.split(','))
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(url)
            .collect();
        if nodes.is_empty() {
            return Err(err(var, "no node given"));
        }
        Ok(nodes)
    };
    if let Some(nodes) = get("REDIS_CLUSTER_NODES") {
        return Ok(RedisSettings::Cluster(list("REDIS_CLUSTER_NODES", &nodes)?));
    }
    let given = get("REDIS_URL");
    let kind = get("REDIS_TYPE").map(|t| t.trim().to_ascii_lowercase());
    match kind.as_deref() {
        None | Some("single") => Ok(RedisSettings::Single(url(given
            .as_deref()
            .unwrap_or("127.0.0.1:6379")))),
        Some("cluster") => Ok(RedisSettings::Cluster(list(
            "REDIS_URL",
            &given.ok_or_else(|| err("REDIS_URL", "the cluster's nodes, host:port,host:port"))?,
        )?)),
        Some("sentinel") => {
            let v = given.ok_or_else(|| {
                err(
                    "REDIS_URL",
                    "with REDIS_TYPE=sentinel: master,host:port,host:port",
                )
            })?;
            let mut parts = v.split(',').map(str::trim).filter(|p| !p.is_empty());
            let master = parts.next().unwrap_or_default().to_owned();
            let sentinels: Vec<String> = parts.map(url).collect();
            if master.is_empty() || sentinels.is_empty() {
                return Err(err(
                    "REDIS_URL",
                    "with REDIS_TYPE=sentinel: the master's name, then the sentinels: \
                     mymaster,host:port,host:port",
                ));
            }
            Ok(RedisSettings::Sentinel { master, sentinels })
        }
        Some(other) => Err(err(
            "REDIS_TYPE",
            format!("{other:?}: single, sentinel or cluster"),
        )),
    }
}

/// A Redis URL from envoyproxy/ratelimit's forms: `host:port` (`rediss://` with TLS), a Unix
/// socket's path, or a URL as it is; `REDIS_AUTH` (`password` or `user:password`) added
/// where the URL has no credentials.
pub(crate) fn redis_url(node: &str, auth: Option<&str>, tls: bool) -> String {
    let (scheme, rest) = if let Some((scheme, rest)) = node.split_once("://") {
        (scheme.to_owned(), rest.to_owned())
    } else if node.starts_with('/') {
        ("unix".to_owned(), node.to_owned())
    } else if tls {
        ("rediss".to_owned(), node.to_owned())
    } else {
        ("redis".to_owned(), node.to_owned())
    };
    let scheme = if tls && scheme == "redis" {
        "rediss".to_owned()
    } else {
        scheme
    };
    match auth {
        Some(auth) if scheme != "unix" && !rest.contains('@') => {
            let creds = match auth.split_once(':') {
                Some((user, password)) => format!("{}:{}", encode(user), encode(password)),
                None => format!(":{}", encode(auth)),
            };
            format!("{scheme}://{creds}@{rest}")
        }
        Some(auth) if scheme == "unix" && !rest.contains('?') => {
            let pass = auth.split_once(':').map_or(auth, |(_, p)| p);
            format!("unix://{rest}?pass={}", encode(pass))
        }
        _ => format!("{scheme}://{rest}"),
    }
}

/// Percent-encodes what a URL's user information cannot hold as it is.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Reads `REDIS_TLS_*` files' paths.
pub(crate) fn redis_tls_files(get: impl Fn(&str) -> Option<String>) -> RedisTlsFiles {
    let get = |name: &str| {
        get(name)
            .filter(|v| !v.trim().is_empty())
            .map(PathBuf::from)
    };
    RedisTlsFiles {
        ca: get("REDIS_TLS_CACERT"),
        client: get("REDIS_TLS_CLIENT_CERT").zip(get("REDIS_TLS_CLIENT_KEY")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(vars: &[(&str, &str)]) -> Result<Settings, SettingsError> {
        let map: HashMap<String, String> = (vars.iter())
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        read(|k| map.get(k).cloned())
    }

    #[test]
    fn envoyproxy_ratelimit_deployment() {
        let s = with(&[
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("BACKEND", "redis"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis.default.svc:6379"),
            ("REDIS_AUTH", "s3cr:t"),
            ("USE_PROMETHEUS", "true"),
            ("LOG_LEVEL", "WARN"),
            ("LOG_FORMAT", "json"),
        ])
        .unwrap();
        assert_eq!(s.http.port(), 8080);
        assert_eq!(s.grpc.port(), 8081);
        assert_eq!(
            s.rules,
            RuleSource::Runtime("/data/ratelimit/config".into())
        );
        assert_eq!(
            s.store.kind,
            StoreKind::Redis(RedisSettings::Single(
                "redis://s3cr:t@redis.default.svc:6379".into()
            ))
        );
        assert_eq!(s.log.filter, "warn");
        assert!(s.log.json);
        assert!(s.prometheus);
        assert_eq!(s.store.on_failure, OnFailure::Fallback);
    }

    #[test]
    fn redis_forms() {
        assert_eq!(redis_url("h:1", None, false), "redis://h:1");
        assert_eq!(redis_url("h:1", None, true), "rediss://h:1");
        assert_eq!(redis_url("redis://h:1", None, true), "rediss://h:1");
        assert_eq!(redis_url("h:1", Some("p@ss"), false), "redis://:p%40ss@h:1");
        assert_eq!(redis_url("h:1", Some("u:p"), false), "redis://u:p@h:1");
        assert_eq!(
            redis_url("redis://:x@h:1", Some("p"), false),
            "redis://:x@h:1"
        );
        assert_eq!(
            redis_url("/run/redis.sock", None, false),
            "unix:///run/redis.sock"
        );
        assert_eq!(
            redis_url("/run/redis.sock", Some("p"), false),
            "unix:///run/redis.sock?pass=p"
        );
        let cluster = with(&[
            ("RULES_FILE", "r.yaml"),
            ("BACKEND", "redis"),
            ("REDIS_TYPE", "CLUSTER"),
            ("REDIS_URL", "a:1, b:2,"),
        ])
        .unwrap();
        assert_eq!(
            cluster.store.kind,
            StoreKind::Redis(RedisSettings::Cluster(vec![
                "redis://a:1".into(),
                "redis://b:2".into()
            ]))
        );
        let sentinel = with(&[
            ("RULES_FILE", "r.yaml"),
            ("BACKEND", "redis_approx"),
            ("REDIS_TYPE", "sentinel"),
            ("REDIS_URL", "mymaster,s1:26379,s2:26379"),
        ])
        .unwrap();
        assert_eq!(
            sentinel.store.kind,
            StoreKind::RedisApprox(
                RedisSettings::Sentinel {
                    master: "mymaster".into(),
                    sentinels: vec!["redis://s1:26379".into(), "redis://s2:26379".into()],
                },
                false
            )
        );
    }

    #[test]
    fn errors_name_the_variable() {
        let e = |vars: &[(&str, &str)]| with(vars).unwrap_err().0;
        assert!(e(&[]).contains("RULES_FILE"));
        assert!(e(&[("RULES_FILE", "a"), ("RULES_DIR", "b")]).contains("RULES_FILE and RULES_DIR"));
        assert!(e(&[("RULES_FILE", "a"), ("PORT", "http")]).starts_with("PORT:"));
        assert!(e(&[("RULES_FILE", "a"), ("BACKEND", "memcache")]).starts_with("BACKEND:"));
        assert!(e(&[("RULES_FILE", "a"), ("ON_FAILURE", "maybe")]).starts_with("ON_FAILURE:"));
        assert!(e(&[("RULES_FILE", "a"), ("LOG_LEVEL", "loud")]).starts_with("LOG_LEVEL:"));
        assert!(e(&[("RULES_FILE", "a"), ("USE_PROMETHEUS", "si")]).starts_with("USE_PROMETHEUS:"));
        assert!(
            e(&[("RULES_FILE", "a"), ("GRPC_SERVER_USE_TLS", "true")])
                .starts_with("GRPC_SERVER_TLS_CERT:")
        );
        assert!(
            e(&[
                ("RULES_FILE", "a"),
                ("BACKEND", "redis"),
                ("REDIS_TYPE", "sentinel")
            ])
            .starts_with("REDIS_URL:")
        );
        assert!(e(&[("RULES_FILE", "a"), ("DRAIN_SECONDS", "-1")]).starts_with("DRAIN_SECONDS:"));
    }
}
