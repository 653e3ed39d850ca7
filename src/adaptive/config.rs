//! An adaptive limit and its layer from a configuration file (feature `serde`): TOML, YAML or
//! JSON, read with any serde format crate.

use super::{AdaptiveLayer, AdaptiveLimit, Aimd, Gradient, QueueOrder};
use crate::ConfigError;

/// An adaptive limit's settings in a configuration file, checked when read (an unknown field
/// is an error naming it) and when built (a value out of its range is an error naming the
/// field). Every field is optional; the defaults are [`AdaptiveLimit::builder`]'s.
///
/// ```toml
/// name = "api"                  # the metrics' `limit` label
/// initial = 20
/// min = 4
/// max = 500
/// algorithm = "gradient"        # or "aimd"
/// tolerance = 1.25              # gradient: latency over the baseline tolerated (>= 1)
/// smoothing = 0.2               # gradient: share of the way down per window (0 < s <= 1)
/// backoff = 0.9                 # aimd: the limit times this on a drop (0.5 to 0.99)
/// increase = 1.0                # aimd: added per window at the limit (> 0)
/// min_samples = 10
/// window = ["100ms", "1s"]      # shortest and longest window
/// retry_after = "1s"            # the layer's refusals
/// sample_at = "head"            # or "body_end"
/// dry_run = false
/// partitions = [{ name = "critical", share = 0.5 }]
/// partition_header = "x-tier"   # a request's partition from this header (set by your gateway)
/// flow_header = "x-tenant"      # fairness between the flows this header names
/// criticality_header = "x-criticality"  # critical, default or sheddable (set by your gateway)
/// flow_headroom = 0.125         # the share of the limit the heaviest flow leaves the others
/// flow_lanes = 256              # lanes flows are hashed into
/// queue = { max_waiting = 64, order = "lifo", deadline = "50ms" }   # none by default
/// ```
///
/// ```
/// use tollgate::adaptive::AdaptiveConfig;
///
/// let config: AdaptiveConfig = toml::from_str(r#"
///     name = "api"
///     min = 4
///     max = 500
///     partitions = [{ name = "critical", share = 0.5 }]
/// "#).unwrap();
/// let layer = config.layer().unwrap();
/// assert_eq!(layer.limit().partitions()[0].name.as_ref(), "critical");
///
/// let typo = toml::from_str::<AdaptiveConfig>("tolerence = 2.0").unwrap_err();
/// assert!(typo.to_string().contains("tolerence"));
/// let bad: AdaptiveConfig = toml::from_str("algorithm = \"aimd\"\nbackoff = 1.5").unwrap();
/// assert!(bad.limit().unwrap_err().to_string().contains("backoff"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveConfig {
    /// The limit's name in metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The limit to start at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial: Option<u32>,
    /// The lowest the limit goes (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<u32>,
    /// The highest the limit goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<u32>,
    /// `gradient` (the default) or `aimd`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    /// The gradient's tolerance (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerance: Option<f64>,
    /// The gradient's smoothing (more than 0, at most 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub smoothing: Option<f64>,
    /// AIMD's backoff (0.5 to 0.99).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<f64>,
    /// AIMD's increase (more than 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub increase: Option<f64>,
    /// The fewest samples a window needs (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_samples: Option<u32>,
    /// The shortest and longest window, as durations (`"100ms"`, `"1s"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<[String; 2]>,
    /// The `Retry-After` of the layer's refusals (`"1s"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<String>,
    /// `head` (the default: a sample ends with the response's head) or `body_end`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_at: Option<String>,
    /// Compute and report without refusing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dry_run: Option<bool>,
    /// Partitions with their guaranteed shares, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<PartitionConfig>,
    /// The header whose value names a request's partition
    /// ([`AdaptiveLayer::partition_by_header`]); only one a trusted gateway sets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition_header: Option<String>,
    /// A short queue for requests over the limit (none by default: refused at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueConfig>,
    /// The header whose value keys a request's flow, for fairness between flows
    /// ([`AdaptiveLayer::flow_by_header`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_header: Option<String>,
    /// The header whose value is a request's criticality
    /// ([`AdaptiveLayer::criticality_from_header`]); only one a trusted gateway sets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub criticality_header: Option<String>,
    /// The share of the limit the heaviest flow leaves to the others (0 to 0.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_headroom: Option<f64>,
    /// The lanes flows are hashed into (1 to 65 536).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_lanes: Option<usize>,
}

/// The queue of an [`AdaptiveConfig`]:
/// `{ max_waiting = 64, order = "lifo", deadline = "50ms" }`.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct QueueConfig {
    /// The most requests waiting at once (at least 1).
    pub max_waiting: usize,
    /// `lifo` (the default) or `fifo`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<String>,
    /// How long a request waits for a slot in the layer (`"50ms"` by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
}

/// A partition of an [`AdaptiveConfig`]: `{ name = "critical", share = 0.5 }`.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct PartitionConfig {
    /// Its name.
    pub name: String,
    /// Its guaranteed share of the limit once the limit is reached (0 to 1).
    pub share: f64,
}

fn bad(option: &'static str, reason: String) -> ConfigError {
    ConfigError::Invalid { option, reason }
}

use crate::quota::config_duration as duration;

impl AdaptiveConfig {
    /// The limit these settings describe, or the first setting that is wrong, named.
    pub fn limit(&self) -> Result<AdaptiveLimit, ConfigError> {
        let mut b = AdaptiveLimit::builder();
        if let Some(name) = &self.name {
            b = b.name(name);
        }
        if let Some(initial) = self.initial {
            b = b.initial(initial);
        }
        if self.min.is_some() || self.max.is_some() {
            b = b.range(self.min.unwrap_or(1), self.max.unwrap_or(1000));
        }
        if let Some(n) = self.min_samples {
            b = b.min_samples(n);
        }
        if let Some([min, max]) = &self.window {
            b = b.window(duration("window", min)?, duration("window", max)?);
        }
        // Their ranges are the algorithms' own, checked by `build()`.
        let (tolerance, smoothing) = (self.tolerance, self.smoothing);
        let (backoff, increase) = (self.backoff, self.increase);
        let gradient_only = |option: &'static str, set: bool| {
            if set {
                Err(bad(option, "only for `algorithm = \"gradient\"`".into()))
            } else {
                Ok(())
            }
        };
        match self.algorithm.as_deref().unwrap_or("gradient") {
            "gradient" => {
                if backoff.is_some() || increase.is_some() {
                    let option = if backoff.is_some() {
                        "backoff"
                    } else {
                        "increase"
                    };
                    return Err(bad(option, "only for `algorithm = \"aimd\"`".into()));
                }
                let mut g = Gradient::new();
                if let Some(t) = tolerance {
                    g = g.tolerance(t);
                }
                if let Some(s) = smoothing {
                    g = g.smoothing(s);
                }
                b = b.gradient(g);
            }
            "aimd" => {
                gradient_only("tolerance", tolerance.is_some())?;
                gradient_only("smoothing", smoothing.is_some())?;
                let mut a = Aimd::new();
                if let Some(r) = backoff {
                    a = a.backoff(r);
                }
                if let Some(i) = increase {
                    a = a.increase(i);
                }
                b = b.algorithm(a);
            }
            other => {
                return Err(bad(
                    "algorithm",
                    format!("{other:?}: use \"gradient\" or \"aimd\""),
                ));
            }
        }
        for p in &self.partitions {
            b = b.partition(&p.name, p.share);
        }
        if let Some(q) = &self.queue {
            let order = match q.order.as_deref() {
                None | Some("lifo") => QueueOrder::Lifo,
                Some("fifo") => QueueOrder::Fifo,
                Some(other) => {
                    return Err(bad(
                        "queue.order",
                        format!("{other:?}: use \"lifo\" or \"fifo\""),
                    ));
                }
            };
            b = b.queue(q.max_waiting, order);
        }
        if let Some(share) = self.flow_headroom {
            b = b.flow_headroom(share);
        }
        if let Some(lanes) = self.flow_lanes {
            b = b.flow_lanes(lanes);
        }
        b.build()
    }

    /// A layer with the limit these settings describe and the layer's own (`retry_after`,
    /// `sample_at`, `dry_run`, the headers), or the first setting that is wrong, named.
    pub fn layer(&self) -> Result<AdaptiveLayer, ConfigError> {
        let mut layer = AdaptiveLayer::new(self.limit()?);
        let header = |option: &'static str, name: &String| {
            http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|e| bad(option, format!("{name:?}: {e}")))
        };
        if let Some(name) = &self.partition_header {
            layer = layer.partition_by_header(header("partition_header", name)?);
        }
        if let Some(name) = &self.flow_header {
            layer = layer.flow_by_header(header("flow_header", name)?);
        }
        if let Some(name) = &self.criticality_header {
            layer = layer.criticality_from_header(header("criticality_header", name)?);
        }
        if let Some(after) = &self.retry_after {
            layer = layer.retry_after(duration("retry_after", after)?);
        }
        match self.sample_at.as_deref() {
            None | Some("head") => {}
            Some("body_end") => layer = layer.sample_at_body_end(true),
            Some(other) => {
                return Err(bad(
                    "sample_at",
                    format!("{other:?}: use \"head\" or \"body_end\""),
                ));
            }
        }
        if let Some(on) = self.dry_run {
            layer = layer.dry_run(on);
        }
        if let Some(deadline) = self.queue.as_ref().and_then(|q| q.deadline.as_ref()) {
            layer = layer.queue_deadline(duration("queue.deadline", deadline)?);
        }
        Ok(layer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(toml_text: &str) -> Result<AdaptiveLayer, String> {
        let c: AdaptiveConfig = toml::from_str(toml_text).map_err(|e| e.to_string())?;
        c.layer().map_err(|e| e.to_string())
    }

    #[test]
    fn every_format_reads_the_same_settings() {
        let t: AdaptiveConfig =
            toml::from_str("min = 2\nmax = 50\nalgorithm = \"aimd\"\nbackoff = 0.8").unwrap();
        let j: AdaptiveConfig =
            serde_json::from_str(r#"{"min": 2, "max": 50, "algorithm": "aimd", "backoff": 0.8}"#)
                .unwrap();
        let y: AdaptiveConfig =
            serde_norway::from_str("min: 2\nmax: 50\nalgorithm: aimd\nbackoff: 0.8").unwrap();
        assert_eq!(t, j);
        assert_eq!(t, y);
        let limit = t.limit().unwrap();
        assert_eq!(limit.limit(), 20);
    }

    #[test]
    fn errors_name_the_word() {
        for (text, word) in [
            ("tolerence = 2.0", "tolerence"),
            ("min = 0", "range"),
            ("min = 9\nmax = 3", "range"),
            ("algorithm = \"vegas\"", "algorithm"),
            ("tolerance = 0.5", "tolerance"),
            ("smoothing = 0.0", "smoothing"),
            ("algorithm = \"aimd\"\ntolerance = 2.0", "tolerance"),
            ("backoff = 0.8", "backoff"),
            ("algorithm = \"aimd\"\nincrease = -1.0", "increase"),
            ("window = [\"1s\", \"100ms\"]", "window"),
            ("window = [\"soon\", \"1s\"]", "window"),
            ("retry_after = \"1 fortnight\"", "retry_after"),
            ("sample_at = \"tail\"", "sample_at"),
            ("partitions = [{ name = \"a\", share = 1.5 }]", "partition"),
            ("partitions = [{ name = \"a\", shares = 0.5 }]", "shares"),
            ("min_samples = 0", "min_samples"),
            ("queue = { max_waiting = 0 }", "queue"),
            (
                "queue = { max_waiting = 8, order = \"random\" }",
                "queue.order",
            ),
            (
                "queue = { max_waiting = 8, deadline = \"soon\" }",
                "queue.deadline",
            ),
            ("queue = { max_waiting = 8, dedline = \"1s\" }", "dedline"),
            ("partition_header = \"x tier\"", "partition_header"),
            ("flow_header = \"x tenant\"", "flow_header"),
            ("criticality_header = \"\"", "criticality_header"),
            ("flow_headroom = 0.9", "flow_headroom"),
            ("flow_lanes = 0", "flow_lanes"),
            ("flow_lane = 4", "flow_lane"),
        ] {
            let err = read(text)
                .err()
                .unwrap_or_else(|| panic!("{text:?} was accepted"));
            assert!(err.contains(word), "{text:?}: {err}");
        }
    }

    #[test]
    fn the_layer_takes_its_settings() {
        let layer = read(
            "name = \"api\"\ninitial = 30\nmin = 5\nmax = 40\nretry_after = \"3s\"\n\
             sample_at = \"body_end\"\ndry_run = true\nwindow = [\"50ms\", \"2s\"]\n\
             partitions = [{ name = \"critical\", share = 0.5 }]\n\
             partition_header = \"x-tier\"\n\
             queue = { max_waiting = 8, order = \"fifo\", deadline = \"20ms\" }",
        )
        .unwrap();
        assert!(layer.limit().queues());
        assert!(format!("{layer:?}").contains("queue_deadline: 20ms"));
        let dbg = format!("{layer:?}");
        assert!(dbg.contains("retry_after: 3s"), "{dbg}");
        assert!(
            dbg.contains("body_end: true") && dbg.contains("dry_run: true"),
            "{dbg}"
        );
        assert_eq!(layer.limit().limit(), 30);
        let names: Vec<_> = (layer.limit().partitions().iter())
            .map(|p| p.name.to_string())
            .collect();
        assert_eq!(names, ["critical", "other"]);
    }

    /// The headers read from a configuration file sort requests by level and flow.
    #[tokio::test]
    async fn the_flow_and_criticality_headers_are_read() {
        use tower::{Layer, ServiceExt};
        let layer = read(
            "initial = 4\nmin = 4\nmax = 4\nflow_header = \"x-tenant\"\n\
             criticality_header = \"x-criticality\"\nflow_headroom = 0.25\nflow_lanes = 64",
        )
        .unwrap();
        let limit = layer.limit().clone();
        let svc = layer.layer(tower::service_fn(|_req: http::Request<()>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
        }));
        let req = http::Request::get("/")
            .header("x-criticality", "sheddable")
            .header("x-tenant", "t")
            .body(())
            .unwrap();
        assert_eq!(svc.oneshot(req).await.unwrap().status(), 200);
        let levels = limit.levels();
        assert_eq!(
            levels[0].criticality,
            crate::criticality::Criticality::Sheddable
        );
        assert_eq!(levels[0].admitted, 1);
    }
}
