//! Calendar quotas over real HTTP, through `examples/plans.rs`: the exact seconds to a
//! tenant's billing day in `RateLimit` and `Retry-After`, the boundary on a manual clock, and
//! the status endpoint's window in the tenant's zone.

#[path = "../examples/plans.rs"]
mod example;
mod support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tollgate::quota::Calendar;
use tollgate::rules::RuleSet;
use tollgate::testing::{Fields, ManualClock};

/// A plan of 2 a month for `globex`, billed on the 31st at 09:00 in New York.
const SMALL: &str = r#"
default = "free"

[[policies]]
name = "free"
quotas = ["1000/month"]

[[policies]]
name = "tiny"
quotas = ["2/month"]

[tiers]
"globex" = "tiny"

[[rules]]
priority = 10
tier = "tiny"
policy = "tiny"

[billing]
"globex" = { day = 31, at = "09:00", tz = "America/New_York" }
"#;

async fn get(client: &reqwest::Client, url: &str, tenant: &str) -> (u16, Fields, String) {
    let res = client
        .get(url)
        .header("x-tenant", tenant)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let mut head = http::Response::builder().status(status);
    for (k, v) in res.headers() {
        head = head.header(k, v);
    }
    let fields = Fields::of(&head.body(()).unwrap()).unwrap();
    (status, fields, res.text().await.unwrap())
}

#[tokio::test]
async fn a_monthly_plan_answers_the_exact_seconds_to_the_billing_day() {
    let clock = ManualClock::new();
    let rules: RuleSet = toml::from_str(SMALL).unwrap();
    let app = example::app(rules, clock.backend()).unwrap();
    let addr = support::serve(app).await;
    let url = format!("http://{addr}/api/reports");
    let client = reqwest::Client::new();
    // 2026-02-27 12:00 EST: globex's month runs from 31 January to 28 February, 09:00 EST.
    let start = ManualClock::START.as_secs();
    clock.advance(Duration::from_secs(1_772_211_600 - start));
    let feb_28 = 1_772_287_200 - 1_772_211_600;
    for left in [1, 0] {
        let (status, f, _) = get(&client, &url, "globex").await;
        assert_eq!(status, 200);
        let item = &f.rate_limit.unwrap().items[0];
        assert_eq!(
            (item.remaining, item.reset),
            (left, Some(Duration::from_secs(feb_28))),
            "{item:?}"
        );
        let policy = &f.policy.unwrap().items[0];
        assert_eq!(
            (policy.quota, policy.window),
            (2, Some(Duration::from_secs(30 * 86_400))),
            "{policy:?}"
        );
    }
    let (status, f, _) = get(&client, &url, "globex").await;
    assert_eq!(status, 429);
    assert_eq!(f.retry_after, Some(Duration::from_secs(feb_28)));
    // A second before the billing day: a second to wait.
    clock.advance(Duration::from_secs(feb_28 - 1));
    let (status, f, _) = get(&client, &url, "globex").await;
    assert_eq!((status, f.retry_after), (429, Some(Duration::from_secs(1))));
    // On it: a new month, 31 days less the hour DST takes, to 31 March 09:00 EDT.
    clock.advance(Duration::from_secs(1));
    let (status, f, _) = get(&client, &url, "globex").await;
    assert_eq!(status, 200);
    let item = &f.rate_limit.unwrap().items[0];
    assert_eq!(
        (item.remaining, item.reset),
        (1, Some(Duration::from_secs(31 * 86_400 - 3600)))
    );
    // Another tenant is on the free plan, its own bucket.
    let (status, f, _) = get(&client, &url, "initech").await;
    assert_eq!(status, 200);
    assert_eq!(f.rate_limit.unwrap().items[0].remaining, 999);
}

#[tokio::test]
async fn the_status_endpoint_says_when_each_tenants_month_started_and_ends() {
    let app = example::app(
        example::plans().unwrap(),
        tollgate::backend::LocalBackend::new(),
    );
    let addr = support::serve(app.unwrap()).await;
    let client = reqwest::Client::new();
    let status = format!("http://{addr}/rate_limit");
    let api = format!("http://{addr}/api/reports");
    for (tenant, limit, day, zone) in [
        ("acme", 100_000, "-15T00:00:00", "[Europe/Berlin]"),
        ("umbrella", 1000, "-03T00:00:00+05:30", "[Asia/Kolkata]"),
        ("initech", 1000, "-01T00:00:00+00:00", "[UTC]"),
    ] {
        get(&client, &api, tenant).await;
        let (code, _, body) = get(&client, &status, tenant).await;
        assert_eq!(code, 200, "{body}");
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        let rate = &json["rate"];
        assert_eq!(rate["limit"], limit, "{body}");
        assert_eq!(rate["used"], 1, "{body}");
        for field in ["window_start", "window_end"] {
            let at = rate[field].as_str().unwrap();
            assert!(
                at.contains(day) && at.ends_with(zone),
                "{tenant} {field}: {at}"
            );
        }
        assert!(
            rate["window_start"].as_str() < rate["window_end"].as_str(),
            "{body}"
        );
    }
    // `reset` is the Unix time of acme's next billing day, to the second.
    let (_, _, body) = get(&client, &status, "acme").await;
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    let berlin = Calendar::monthly_on(15).in_zone("Europe/Berlin");
    let end = berlin.window(SystemTime::now()).unwrap().end;
    let end = end.duration_since(UNIX_EPOCH).unwrap().as_secs();
    assert_eq!(json["rate"]["reset"], end, "{body}");
    // The month's end in New York, billed on the 31st at 09:00: the month's last day.
    let (_, _, body) = get(&client, &status, "globex").await;
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    let end = json["rate"]["window_end"].as_str().unwrap();
    assert!(
        end.contains("T09:00:00-0") && end.ends_with("[America/New_York]"),
        "{end}"
    );
}

/// A tenant's billing day changed live (the admin API's `RulesHandle::replace`): what it used
/// in the running month is kept in its new month, whose end is the new billing day.
#[tokio::test]
async fn a_billing_day_changed_live_keeps_what_the_month_used() {
    use axum::routing::get as route;
    use tollgate::RateLimitLayer;
    use tollgate::key::Header;
    use tollgate::rules::Billing;
    let clock = ManualClock::new();
    let rules: RuleSet = toml::from_str(SMALL).unwrap();
    let limit = RateLimitLayer::builder()
        .rules(rules.clone())
        .key(Header::new("x-tenant"))
        .backend(clock.backend())
        .build()
        .unwrap();
    let handle = limit.rules_handle().unwrap();
    let app = axum::Router::new()
        .route("/api/reports", route(|| async { "[]" }))
        .route_layer(limit);
    let addr = support::serve(app).await;
    let url = format!("http://{addr}/api/reports");
    let client = reqwest::Client::new();
    // 2026-02-27 12:00 EST: one of 2 used, the month ends on 28 February 09:00 EST.
    let start = ManualClock::START.as_secs();
    clock.advance(Duration::from_secs(1_772_211_600 - start));
    let (_, f, _) = get(&client, &url, "globex").await;
    let item = &f.rate_limit.unwrap().items[0];
    assert_eq!(item.reset, Some(Duration::from_secs(75_600)));
    // Billed from now on the 15th at midnight in New York: the month runs to 15 March
    // 00:00 EDT (04:00 UTC), and still holds the request made.
    let moved = rules
        .clone()
        .billing("globex", Billing::new().day(15).tz("America/New_York"));
    handle.replace(moved.clone()).unwrap();
    let (status, f, _) = get(&client, &url, "globex").await;
    assert_eq!(status, 200);
    let item = &f.rate_limit.unwrap().items[0];
    let mar_15 = 1_773_547_200 - 1_772_211_600;
    assert_eq!(
        (item.remaining, item.reset),
        (0, Some(Duration::from_secs(mar_15)))
    );
    let (status, f, _) = get(&client, &url, "globex").await;
    assert_eq!(
        (status, f.retry_after),
        (429, Some(Duration::from_secs(mar_15)))
    );
    // Back to the 31st: the two requests of this month are still counted.
    handle.replace(rules.clone()).unwrap();
    let (status, f, _) = get(&client, &url, "globex").await;
    assert_eq!(
        (status, f.retry_after),
        (429, Some(Duration::from_secs(75_600)))
    );
    handle.replace(moved.clone()).unwrap();
    // The rule set reads back with its billing table, through the admin API's JSON.
    let json = serde_json::to_value(handle.current()).unwrap();
    assert_eq!(json["billing"]["globex"]["day"], 15, "{json}");
    let back: RuleSet = serde_json::from_value(json).unwrap();
    assert_eq!(back.billings(), moved.billings());
}

/// Billing settings out of range are refused, naming the tenant and the word; a policy
/// without calendar quotas is unchanged by them.
#[test]
fn billing_settings_are_checked() {
    for (billing, word) in [
        (r#"{ day = 32 }"#, "day 32"),
        (r#"{ day = 0 }"#, "day 0"),
        (r#"{ at = "9" }"#, "at \"9\""),
        (r#"{ tz = "Mars/Olympus_Mons" }"#, "Mars/Olympus_Mons"),
        (r#"{ dday = 3 }"#, "dday"),
    ] {
        let text = format!("{SMALL}\"acme\" = {billing}\n");
        let err = match toml::from_str::<RuleSet>(&text) {
            Ok(rules) => rules.validate().unwrap_err().to_string(),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(word), "{billing}: {err}");
        if word != "dday" {
            assert!(err.contains("acme") && err.contains("billing"), "{err}");
        }
    }
}
