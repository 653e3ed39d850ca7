//! The `rules_admin` example's admin API over real HTTP.

#[allow(dead_code)]
#[path = "../examples/rules_admin.rs"]
mod example;

use std::net::SocketAddr;

async fn serve(token: Option<&str>) -> String {
    let app = example::app(example::default_rules().unwrap(), token.map(str::to_owned)).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap()
    });
    format!("http://{addr}")
}

/// The admin API's rules, read with the token.
async fn read_rules(client: &reqwest::Client, base: &str) -> serde_json::Value {
    client
        .get(format!("{base}/admin/rules"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Writes `rules` back with the token, and checks they were taken.
async fn write_rules(client: &reqwest::Client, base: &str, rules: &serde_json::Value) {
    let res = client
        .put(format!("{base}/admin/rules"))
        .bearer_auth("s3cret")
        .json(rules)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
}

#[tokio::test]
async fn admin_raises_a_merchants_limit_live() {
    let base = serve(Some("s3cret")).await;
    let client = reqwest::Client::new();
    let orders = || {
        client
            .get(format!("{base}/api/orders"))
            .header("x-merchant-id", "merchant-9")
            .send()
    };
    // Free tier: burst 5.
    for _ in 0..5 {
        assert_eq!(orders().await.unwrap().status(), 200);
    }
    let res = orders().await.unwrap();
    assert_eq!(res.status(), 429);

    // Read, change, write back.
    let mut rules = read_rules(&client, &base).await;
    assert_eq!(rules["default"], "free");
    rules["tiers"]["merchant-9"] = "pro".into();
    write_rules(&client, &base, &rules).await;

    // The very next request is under the pro policy.
    let res = orders().await.unwrap();
    assert_eq!(res.status(), 200);
    assert!(
        res.headers()["ratelimit-policy"]
            .to_str()
            .unwrap()
            .starts_with(r#""pro-0";q=50"#)
    );
}

#[tokio::test]
async fn wrong_or_missing_token_and_invalid_rules_change_nothing() {
    let base = serve(Some("s3cret")).await;
    let client = reqwest::Client::new();
    let bogus =
        serde_json::json!({"default": "free", "policies": [{"name": "free", "quotas": ["1/h"]}]});
    for auth in [None, Some("wrong"), Some("s3cret-but-longer")] {
        let mut req = client.put(format!("{base}/admin/rules")).json(&bogus);
        if let Some(t) = auth {
            req = req.bearer_auth(t);
        }
        assert_eq!(req.send().await.unwrap().status(), 401);
        let mut req = client.get(format!("{base}/admin/rules"));
        if let Some(t) = auth {
            req = req.bearer_auth(t);
        }
        assert_eq!(req.send().await.unwrap().status(), 401);
    }
    // Authorized but invalid: a rule names a policy that does not exist.
    let invalid = serde_json::json!({
        "default": "free",
        "policies": [{"name": "free", "quotas": ["1/h"]}],
        "rules": [{"priority": 1, "policy": "gold"}]
    });
    let res = client
        .put(format!("{base}/admin/rules"))
        .bearer_auth("s3cret")
        .json(&invalid)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 422);
    let text = res.text().await.unwrap();
    assert!(text.contains("rules[0]") && text.contains("gold"), "{text}");
    // The shipped rules are still in force: free tier allows a burst of 5.
    for _ in 0..5 {
        let res = client
            .get(format!("{base}/api/orders"))
            .header("x-merchant-id", "m-x")
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
    }
}

#[tokio::test]
async fn admin_api_is_off_without_a_token() {
    let base = serve(None).await;
    let res = reqwest::Client::new()
        .get(format!("{base}/admin/rules"))
        .bearer_auth("")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
}

/// Typos in rules sent to the admin API are rejected with the rule and the value; a declared
/// tier may lose its last merchant.
#[tokio::test]
async fn admin_rejects_typos_and_keeps_declared_tiers() {
    let base = serve(Some("s3cret")).await;
    let client = reqwest::Client::new();
    let current: serde_json::Value = client
        .get(format!("{base}/admin/rules"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let put = |rules: serde_json::Value| {
        client
            .put(format!("{base}/admin/rules"))
            .bearer_auth("s3cret")
            .json(&rules)
            .send()
    };
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut rules = current.clone();
        f(&mut rules);
        rules
    };
    for (typo, expected) in [
        (
            edit(&|r| r["rules"][0]["tier"] = "por".into()),
            r#"rules[0] (priority 10): tier "por" is not a tier of the rule set"#,
        ),
        (
            edit(&|r| r["rules"][2]["path_prefix"] = "api/search".into()),
            r#"rules[2] (priority 20): path_prefix "api/search" must start with `/`"#,
        ),
        (
            edit(&|r| r["rules"][2]["methods"] = serde_json::json!(["GET", "PSOT"])),
            r#"rules[2] (priority 20): method "PSOT" is not a standard HTTP method"#,
        ),
    ] {
        let res = put(typo).await.unwrap();
        assert_eq!(res.status(), 422);
        let text = res.text().await.unwrap();
        assert!(text.contains(expected), "{text}");
    }
    // Nothing changed.
    let now: serde_json::Value = client
        .get(format!("{base}/admin/rules"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(now, current);

    // Moving the only enterprise merchant to pro leaves the enterprise tier empty: its rules
    // stay valid, as the example's rules declare the tier.
    let res = put(edit(&|r| r["tiers"]["merchant-2"] = "pro".into()))
        .await
        .unwrap();
    assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
    let res = client
        .get(format!("{base}/api/orders"))
        .header("x-merchant-id", "merchant-2")
        .send()
        .await
        .unwrap();
    assert!(
        res.headers()["ratelimit-policy"]
            .to_str()
            .unwrap()
            .starts_with(r#""pro-0""#)
    );
}

/// A quota changed live keeps what keys used (`on_change = "keep"`, the default): merchant-9
/// spent 5 of free's `1000/h`; after the admin changes it to `900/h`, the next answer counts
/// those 5 against the 900: 894 left after the sixth request (without `keep`: 899).
#[tokio::test]
async fn a_changed_quota_keeps_what_keys_used() {
    let base = serve(Some("s3cret")).await;
    let client = reqwest::Client::new();
    let orders = || {
        client
            .get(format!("{base}/api/orders"))
            .header("x-merchant-id", "merchant-9")
            .send()
    };
    for _ in 0..5 {
        assert_eq!(orders().await.unwrap().status(), 200);
    }
    let mut rules = read_rules(&client, &base).await;
    let free = (rules["policies"].as_array_mut().unwrap().iter_mut())
        .find(|p| p["name"] == "free")
        .unwrap();
    assert_eq!(free["quotas"][1], "1000/h");
    free["quotas"][1] = "900/h".into();
    write_rules(&client, &base, &rules).await;
    // A unit of free's burst (2/s) comes back, so that the next request passes and reports
    // both quotas (a 429 reports only the quota that refused).
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    let res = orders().await.unwrap();
    assert_eq!(res.status(), 200);
    let header = res.headers()["ratelimit"].to_str().unwrap().to_owned();
    let policy = res.headers()["ratelimit-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(policy.contains(r#""free-1";q=900"#), "{policy}");
    assert!(header.contains(r#""free-1";r=894"#), "{header}");
}
