//! The shipped Grafana dashboard, Prometheus alerts and recording rules (`monitoring/`, issue
//! 47): the committed files are the generator's output, promtool accepts them and their unit
//! tests pass, every panel's expression parses, every metric they name is one tollgate emits,
//! and every alert has its runbook.

use std::path::Path;
use std::process::Command;

#[allow(dead_code)]
#[path = "../examples/monitoring.rs"]
mod generator;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/monitoring");

/// promtool: `PROMTOOL`, else on the PATH (`./scripts/test.sh` installs Debian's
/// `prometheus`, which has it).
fn promtool() -> String {
    std::env::var("PROMTOOL").unwrap_or_else(|_| "promtool".into())
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e} (install Debian's `prometheus` for promtool)"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

#[test]
fn the_committed_files_are_the_generators_output() {
    for (name, text) in generator::files(&generator::Settings::default()) {
        let committed = std::fs::read_to_string(Path::new(DIR).join(name)).unwrap();
        assert!(
            committed == text,
            "monitoring/{name} differs from the generator's output: run `cargo run --example monitoring`"
        );
    }
}

#[test]
fn promtool_accepts_the_rules_and_their_unit_tests_pass() {
    let out = run(Command::new(promtool()).args([
        "check",
        "rules",
        &format!("{DIR}/tollgate-rules.yaml"),
        &format!("{DIR}/tollgate-alerts.yaml"),
    ]));
    // The recording rules, then the alerts.
    let alerts = generator::alerts(&generator::Settings::default()).len();
    assert_eq!(alerts, 11);
    assert!(out.contains("SUCCESS: 4 rules found"), "{out}");
    assert!(
        out.contains(&format!("SUCCESS: {alerts} rules found")),
        "{out}"
    );
    let out = run(Command::new(promtool()).args([
        "test",
        "rules",
        &format!("{DIR}/tests/tollgate-alerts.test.yaml"),
    ]));
    assert!(out.contains("SUCCESS"), "{out}");
    // Every alert has a unit test that expects it to fire.
    let tests = std::fs::read_to_string(format!("{DIR}/tests/tollgate-alerts.test.yaml")).unwrap();
    for a in generator::alerts(&generator::Settings::default()) {
        let fires = format!(
            "alertname: {}\n        exp_alerts:\n          - exp_labels",
            a.name
        );
        assert!(tests.contains(&fires), "no test where {} fires", a.name);
        let silent = format!("alertname: {}, exp_alerts: [] }}", a.name);
        assert!(tests.contains(&silent), "no healthy test for {}", a.name);
    }
}

/// Every panel's expression, with the dashboard's variables filled in as Grafana would, parses
/// (as a recording rule promtool checks), and the dashboard imports as is.
#[test]
fn every_panel_parses_and_the_dashboard_imports_as_is() {
    let dash = generator::dashboard(&generator::Settings::default());
    assert!(dash["uid"].is_null(), "no hard-coded uid");
    let vars: Vec<&str> = (dash["templating"]["list"].as_array().unwrap().iter())
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(vars, ["datasource", "job", "instance", "policy"]);
    assert_eq!(dash["templating"]["list"][0]["type"], "datasource");
    let mut rules = String::from("groups:\n- name: panels\n  rules:\n");
    let mut n = 0;
    let mut ids = std::collections::BTreeSet::new();
    for p in dash["panels"].as_array().unwrap() {
        let id = p["id"].as_u64().unwrap();
        assert!(ids.insert(id), "panel id {id} twice");
        if p["type"] == "row" {
            continue;
        }
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{}: no target", p["title"]);
        for t in targets {
            assert!(
                !t["expr"].as_str().unwrap_or_default().trim().is_empty(),
                "{}: a target without an expression",
                p["title"]
            );
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        let description = p["description"].as_str().unwrap_or_default();
        assert!(description.len() > 40, "{}: say what to do", p["title"]);
        for t in p["targets"].as_array().unwrap() {
            let expr = generator::filled(t["expr"].as_str().unwrap());
            n += 1;
            rules.push_str(&format!(
                "  - record: panel:{n}\n    expr: {}\n",
                serde_json::to_string(&expr).unwrap()
            ));
        }
    }
    // And each alert's query, without its threshold (what the live test runs).
    for a in generator::alerts(&generator::Settings::default()) {
        n += 1;
        rules.push_str(&format!(
            "  - record: query:{n}\n    expr: {}\n",
            serde_json::to_string(&a.query).unwrap()
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("panels.yaml");
    std::fs::write(&file, rules).unwrap();
    let out = run(Command::new(promtool()).args(["check", "rules", file.to_str().unwrap()]));
    assert!(out.contains(&format!("SUCCESS: {n} rules found")), "{out}");
}

/// Every `tollgate_*` metric an expression names is one `src/metrics.rs` documents (a typo
/// would be a panel forever empty, an alert that never fires), and every documented metric is
/// on the dashboard.
#[test]
fn every_metric_named_exists_and_every_metric_is_shown() {
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/metrics.rs")).unwrap();
    let documented: std::collections::BTreeSet<String> = (docs.lines())
        .filter_map(|l| l.strip_prefix("//! | `tollgate_"))
        .map(|l| format!("tollgate_{}", &l[..l.find('`').unwrap()]))
        .collect();
    assert!(documented.len() > 25, "{documented:?}");
    let mut text = String::new();
    for (_, t) in generator::files(&generator::Settings::default()) {
        text.push_str(&t);
    }
    let mut named = std::collections::BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("tollgate_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = tail[..end].trim_end_matches("_bucket");
        // `tollgate_.+`: the dashboard's variables, any of them.
        if name != "tollgate_" {
            named.insert(name.to_owned());
        }
        rest = &tail[end..];
    }
    for name in &named {
        assert!(
            documented.contains(name),
            "{name} is not a metric tollgate emits"
        );
    }
    let dash =
        serde_json::to_string(&generator::dashboard(&generator::Settings::default())).unwrap();
    for name in &documented {
        // The clock source is a setting seen once, not a time series to watch.
        if name == "tollgate_store_time_source"
            || name == "tollgate_circuit_breaker_transitions_total"
        {
            continue;
        }
        assert!(dash.contains(name.as_str()), "{name} is on no panel");
    }
}

/// Every alert has a runbook in `docs/observability.md`, where its link points.
#[test]
fn every_alert_has_its_runbook() {
    let docs = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/observability.md"
    ))
    .unwrap();
    for a in generator::alerts(&generator::Settings::default()) {
        assert!(
            docs.contains(&format!("\n### {}\n", a.name)),
            "docs/observability.md has no runbook for {}",
            a.name
        );
    }
}

#[test]
fn the_generators_options_are_checked() {
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let (s, out) = generator::Settings::from_args(&args(&[
        "--selector",
        "{job=\"api\"}",
        "--out=x",
        "--for",
        "30s",
        "--store-failing-ratio=0.02",
        "--adaptive-rejected-ratio",
        "0.1",
        "--adaptive-min-rps",
        "5",
    ]))
    .unwrap();
    assert_eq!((s.selector.as_str(), out.as_str()), ("job=\"api\"", "x"));
    let alerts = generator::alerts_yaml(&s);
    assert!(
        alerts.contains("tollgate_circuit_breaker_open{job=\"api\"}"),
        "{alerts}"
    );
    assert!(
        alerts.contains(
            "tollgate_adaptive_requests_total{job=\"api\",outcome=~\"admitted|rejected\"}"
        ),
        "{alerts}"
    );
    assert!(alerts.contains("for: 30s") && !alerts.contains("for: 1m"));
    // The thresholds are where they belong.
    let expr = |name: &str| {
        let a = generator::alerts(&s);
        a.into_iter().find(|a| a.name == name).unwrap().expr
    };
    assert!(
        expr("TollgateStoreFailing").ends_with("(tollgate:decisions:rate) > 0.02"),
        "{}",
        expr("TollgateStoreFailing")
    );
    let rejecting = expr("TollgateAdaptiveRejecting");
    assert!(
        rejecting.contains(" > 0.1 and on (job, instance, limit) ") && rejecting.ends_with(" > 5"),
        "{rejecting}"
    );
    for (bad, word) in [
        (&["--rate-window", "5 minutes"][..], "--rate-window"),
        (&["--memory-ratio", "-1"], "--memory-ratio"),
        (&["--store-failing-ratio", "x"], "--store-failing-ratio"),
        (&["--adaptive-min-rps", "-2"], "--adaptive-min-rps"),
        (&["--colour", "red"], "--colour"),
        (&["--for"], "--for"),
    ] {
        let err = generator::Settings::from_args(&args(bad)).unwrap_err();
        assert!(err.contains(word), "{err}");
    }
}
