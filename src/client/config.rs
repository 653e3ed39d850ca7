//! The client layers from a configuration file (feature `serde`): TOML, YAML or JSON, read
//! with any serde format crate.

use super::{RetryBudget, RetryLayer, Throttle};
use crate::ConfigError;

use crate::quota::config_duration as duration;

/// A [`Throttle`]'s settings, checked when read (an unknown field is an error naming it) and
/// when built (a value out of range is an error naming the field). Every field is optional.
///
/// ```toml
/// name = "payments"     # the metrics' `upstream` label
/// k = 2.0               # the upstream receives about K times what it accepts (>= 1)
/// window = "250ms"      # at least 100 ms
/// ```
///
/// ```
/// use tollgate::client::ThrottleConfig;
///
/// let config: ThrottleConfig = toml::from_str("name = \"payments\"\nk = 1.5").unwrap();
/// let throttle = config.throttle().unwrap();
/// let bad: ThrottleConfig = toml::from_str("k = 0.5").unwrap();
/// assert!(bad.throttle().unwrap_err().to_string().contains("k"));
/// assert!(toml::from_str::<ThrottleConfig>("windw = \"1s\"").unwrap_err().to_string().contains("windw"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ThrottleConfig {
    /// The upstream's name in metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// K (at least 1; 2 by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k: Option<f64>,
    /// The window (`"250ms"` by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
}

impl ThrottleConfig {
    /// The throttle these settings describe, or the first setting that is wrong, named.
    pub fn throttle(&self) -> Result<Throttle, ConfigError> {
        let mut b = Throttle::builder();
        if let Some(name) = &self.name {
            b = b.name(name);
        }
        if let Some(k) = self.k {
            b = b.k(k);
        }
        if let Some(w) = &self.window {
            b = b.window(duration("window", w)?);
        }
        b.build()
    }
}

/// A [`RetryLayer`]'s settings and its [`RetryBudget`]'s, checked as [`ThrottleConfig`]'s
/// are.
///
/// ```toml
/// name = "payments"         # the metrics' `upstream` label
/// ratio = 0.1               # retries per first attempt over the window
/// min_per_second = 1.0      # retries a second however few the calls
/// window = "10s"
/// max_retries = 3
/// backoff = ["25ms", "1s"]  # base and most, full jitter
/// max_wait = "10s"          # the longest Retry-After waited out
/// ```
///
/// ```
/// use tollgate::client::RetryConfig;
///
/// let config: RetryConfig = toml::from_str("ratio = 0.2\nmax_retries = 2").unwrap();
/// let layer = config.layer().unwrap();
/// let bad: RetryConfig = toml::from_str("ratio = -1.0").unwrap();
/// assert!(bad.layer().unwrap_err().to_string().contains("ratio"));
/// let bad: RetryConfig = toml::from_str("backoff = [\"1s\", \"soon\"]").unwrap();
/// assert!(bad.layer().unwrap_err().to_string().contains("backoff"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// The upstream's name in metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Retries per first attempt (0 to 1000; 0.1 by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    /// Retries a second however few the calls (0 or more; 1 by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_per_second: Option<f64>,
    /// The budget's window (`"10s"` by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
    /// The most retries of a call (3 by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_retries: Option<u32>,
    /// The backoff's base and most (`["25ms", "1s"]` by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<[String; 2]>,
    /// The longest `Retry-After` waited out (`"10s"` by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait: Option<String>,
}

impl RetryConfig {
    /// The budget these settings describe, or the first setting that is wrong, named.
    pub fn budget(&self) -> Result<RetryBudget, ConfigError> {
        let mut b = RetryBudget::builder();
        if let Some(name) = &self.name {
            b = b.name(name);
        }
        if let Some(r) = self.ratio {
            b = b.ratio(r);
        }
        if let Some(m) = self.min_per_second {
            b = b.min_per_second(m);
        }
        if let Some(w) = &self.window {
            b = b.window(duration("window", w)?);
        }
        b.build()
    }

    /// The retry layer these settings describe, with a budget of its own (share it between
    /// the clients of one upstream), or the first setting that is wrong, named.
    pub fn layer(&self) -> Result<RetryLayer, ConfigError> {
        let mut layer = RetryLayer::new(self.budget()?);
        if let Some(n) = self.max_retries {
            layer = layer.max_retries(n);
        }
        if let Some([base, max]) = &self.backoff {
            layer = layer.backoff(duration("backoff", base)?, duration("backoff", max)?);
        }
        if let Some(w) = &self.max_wait {
            layer = layer.max_wait(duration("max_wait", w)?);
        }
        Ok(layer)
    }
}
