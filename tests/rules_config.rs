//! Rule sets from configuration files.

use std::time::Duration;

use tollgate::rules::RuleSet;
use tollgate::{Policy, Quota};

const TOML: &str = r#"
default = "free"

[[policies]]
name = "free"
quotas = ["5/s burst 10", "1000/h"]

[[policies]]
name = "pro"
quotas = ["100/s"]
cost = 2
shadow = true

[tiers]
"m-1" = "pro"

[[rules]]
priority = 10
tier = "pro"
policy = "pro"
methods = ["GET", "POST"]
path_prefix = "/api"
"#;

#[test]
fn toml_yaml_and_json_give_the_same_rules() {
    let from_toml: RuleSet = toml::from_str(TOML).unwrap();
    from_toml.validate().unwrap();
    let yaml = serde_norway::to_string(&from_toml).unwrap();
    let from_yaml: RuleSet = serde_norway::from_str(&yaml).unwrap();
    let json = serde_json::to_string(&from_toml).unwrap();
    let from_json: RuleSet = serde_json::from_str(&json).unwrap();
    for set in [&from_toml, &from_yaml, &from_json] {
        assert_eq!(set.default_policy(), "free");
        let free: &Policy = &set.policies()[0];
        assert_eq!(
            free.quotas(),
            &[Quota::per_second(5).burst(10), Quota::per_hour(1000)]
        );
        assert!(set.policies()[1].is_shadow());
        assert_eq!(set.rules().len(), 1);
        assert_eq!(set.rules()[0].priority(), 10);
        assert_eq!(set.tiers()["m-1"], "pro");
    }
    // Hand-written YAML, as an operator would.
    let yaml = r#"
default: basic
policies:
  - name: basic
    quotas: ["3/10s", "5/min burst 10"]
"#;
    let set: RuleSet = serde_norway::from_str(yaml).unwrap();
    assert_eq!(
        set.policies()[0].quotas()[0],
        Quota::new(3, Duration::from_secs(10))
    );
    set.validate().unwrap();
}

/// `methods = ["post"]` in a config file means POST: a rule that silently never matched
/// would be worse (say, a strict limit on logins).
#[tokio::test]
async fn standard_methods_match_whatever_their_case() {
    use bytes::Bytes;
    use http::{Method, Request, Response};
    use http_body_util::Full;
    use tollgate::RateLimitLayer;
    use tollgate::key::Global;
    use tower::{Layer, ServiceExt};

    let toml = r#"
default = "free"
[[policies]]
name = "free"
quotas = ["5/s"]
[[policies]]
name = "writes"
quotas = ["1/s"]
[[rules]]
priority = 1
policy = "writes"
methods = ["post", "Patch", "PURGE"]
"#;
    let set: RuleSet = toml::from_str(toml).unwrap();
    let layer = RateLimitLayer::builder()
        .rules(set)
        .key(Global)
        .build()
        .unwrap();
    let svc = layer.layer(tower::service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    for (method, expected) in [
        (&b"POST"[..], "writes"),
        (b"PATCH", "writes"),
        (b"PURGE", "writes"),
        (b"GET", "free"),
    ] {
        let req = Request::builder()
            .method(Method::from_bytes(method).unwrap())
            .body(Full::default())
            .unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        let policy = res.headers()["ratelimit-policy"].to_str().unwrap();
        assert_eq!(policy.split('"').nth(1), Some(expected), "{policy}");
    }
}

#[test]
fn parse_errors_point_at_the_entry() {
    // A malformed quota: TOML reports the line, and the message names the quota.
    let bad = TOML.replace("\"100/s\"", "\"100 per second\"");
    let err = toml::from_str::<RuleSet>(&bad).unwrap_err().to_string();
    assert!(err.contains("100 per second"), "{err}");
    assert!(err.contains("line 10"), "{err}");
    // An unknown field is an error, not silently ignored.
    let bad = TOML.replace("priority = 10", "priority = 10\nprioritty = 3");
    let err = toml::from_str::<RuleSet>(&bad).unwrap_err().to_string();
    assert!(err.contains("prioritty"), "{err}");
    // JSON: line and column.
    let err = serde_json::from_str::<RuleSet>(
        r#"{"default":"a","policies":[{"name":"a","quotas":["0/"]}]}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("column"), "{err}");
}

#[test]
fn semantic_errors_name_the_entry() {
    let cases = [
        (
            TOML.replace("policy = \"pro\"", "policy = \"gold\""),
            "rules[0] (priority 10): policy `gold` is not defined",
        ),
        (
            TOML.replace("default = \"free\"", "default = \"none\""),
            "default policy `none` is not defined",
        ),
        (
            TOML.replace("\"100/s\"", "\"0/s\""),
            "policies[1]: policy `pro`: invalid quota",
        ),
        (
            TOML.replace("name = \"pro\"", "name = \"free\""),
            "policies[1]: policy `free` is defined twice",
        ),
        (
            TOML.replace("\"POST\"", "\"PO ST\""),
            "rules[0] (priority 10): \"PO ST\" is not an HTTP method",
        ),
    ];
    for (text, expected) in cases {
        let set: RuleSet = toml::from_str(&text).unwrap();
        let err = set.validate().unwrap_err().to_string();
        assert!(
            err.contains(expected),
            "{err:?} should contain {expected:?}"
        );
    }
}
