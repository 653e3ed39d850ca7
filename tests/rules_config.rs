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
/// would be worse (say, a strict limit on logins). Extension methods are declared, then
/// matched exactly.
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
extension_methods = ["PURGE"]
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
            "rules[0] (priority 10): method \"PO ST\" is not a standard HTTP method",
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

/// Typos that made rules which never match are errors naming the rule and the value.
#[test]
fn typos_in_conditions_are_errors() {
    let cases = [
        (
            TOML.replace("\"POST\"", "\"PSOT\""),
            "rules[0] (priority 10): method \"PSOT\" is not a standard HTTP method (GET, HEAD, \
             POST, PUT, DELETE, CONNECT, OPTIONS, TRACE or PATCH, in any case) nor declared in \
             `extension_methods`",
        ),
        (
            TOML.replace("tier = \"pro\"", "tier = \"por\""),
            "rules[0] (priority 10): tier \"por\" is not a tier of the rule set (its tiers are \
             \"pro\")",
        ),
        (
            TOML.replace("\"/api\"", "\"api\""),
            "rules[0] (priority 10): path_prefix \"api\" must start with `/` (did you mean \
             \"/api\"?)",
        ),
        (
            TOML.replace("\"/api\"", "\"/api/*\""),
            "path_prefix \"/api/*\" contains `*`: it is a literal prefix",
        ),
        (
            TOML.replace("\"/api\"", "\"/api?v=2\""),
            "path_prefix \"/api?v=2\" contains `?`",
        ),
        (
            TOML.replace("\"/api\"", "\"/café\""),
            "path_prefix \"/café\" contains 'é'",
        ),
        // An extension method must be declared, and declared in upper case.
        (
            TOML.replace("\"POST\"", "\"PURGE\""),
            "method \"PURGE\" is not a standard HTTP method",
        ),
        (
            format!("extension_methods = [\"purge\"]\n{TOML}"),
            "extension_methods[0]: \"purge\": write extension methods in upper case (\"PURGE\")",
        ),
        (
            format!("extension_methods = [\"PURGE\"]\n{TOML}").replace("\"POST\"", "\"Purge\""),
            "method \"Purge\" is not a standard HTTP method (GET, HEAD, POST, PUT, DELETE, \
             CONNECT, OPTIONS, TRACE or PATCH, in any case) nor declared in `extension_methods` \
             (methods are case-sensitive: `PURGE` is declared)",
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
    // What is allowed: standard methods in any case, declared extension methods, prefixes
    // with a trailing `/` or percent-encoded bytes, the root.
    for text in [
        TOML.replace("\"POST\"", "\"delete\""),
        format!("extension_methods = [\"PURGE\", \"PROPFIND\"]\n{TOML}")
            .replace("\"POST\"", "\"PROPFIND\""),
        TOML.replace("\"/api\"", "\"/api/\""),
        TOML.replace("\"/api\"", "\"/caf%C3%A9\""),
        TOML.replace("\"/api\"", "\"/\""),
    ] {
        let set: RuleSet = toml::from_str(&text).unwrap();
        set.validate().unwrap();
    }
}

/// A tier may lose its last tenant and keep its rules, when declared.
#[test]
fn declared_tiers_may_be_empty() {
    let emptied = TOML.replace("\"m-1\" = \"pro\"", "");
    let set: RuleSet = toml::from_str(&emptied).unwrap();
    let err = set.validate().unwrap_err().to_string();
    assert!(
        err.contains("tier \"pro\" is not a tier of the rule set (the rule set has none)"),
        "{err}"
    );
    let declared: RuleSet =
        toml::from_str(&format!("declared_tiers = [\"pro\"]\n{emptied}")).unwrap();
    declared.validate().unwrap();
    assert_eq!(declared.declared_tiers(), ["pro"]);
    // The declarations survive a round trip, as through an admin API.
    let json = serde_json::to_string(&declared).unwrap();
    let back: RuleSet = serde_json::from_str(&json).unwrap();
    assert_eq!(back.declared_tiers(), ["pro"]);
    back.validate().unwrap();
    // Serialized without declarations, a rule set looks as it did before they existed.
    let plain: RuleSet = toml::from_str(TOML).unwrap();
    let json = serde_json::to_string(&plain).unwrap();
    assert!(
        !json.contains("declared_tiers") && !json.contains("extension_methods"),
        "{json}"
    );
}

/// `on_change` in configuration files: each strategy by name, round-tripped, `keep` left out
/// when serialized (the default), and a typo refused naming the word and the choices.
#[test]
fn on_change_is_read_and_checked() {
    use tollgate::OnChange;
    for (word, strategy) in [
        ("keep", OnChange::Keep),
        ("reset", OnChange::Reset),
        ("proportional", OnChange::Proportional),
        ("additive", OnChange::Additive),
    ] {
        let text = format!(
            "default = \"p\"\n[[policies]]\nname = \"p\"\nquotas = [\"1000/h\"]\non_change = \"{word}\"\n"
        );
        let set: RuleSet = toml::from_str(&text).unwrap();
        assert_eq!(set.policies()[0].change_strategy(), strategy);
        let back = serde_json::to_string(&set).unwrap();
        assert_eq!(
            back.contains("on_change"),
            strategy != OnChange::Keep,
            "{back}"
        );
        let again: RuleSet = serde_json::from_str(&back).unwrap();
        assert_eq!(again.policies()[0].change_strategy(), strategy);
    }
    let err = toml::from_str::<RuleSet>(
        "default = \"p\"\n[[policies]]\nname = \"p\"\nquotas = [\"1/s\"]\non_change = \"kept\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("\"kept\"") && err.contains("proportional"),
        "{err}"
    );
}
