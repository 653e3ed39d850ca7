//! The Redis backend over TLS, against a real `redis-server --tls-port` with certificates made
//! by the test; passwords and ACL users, on real servers.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use support::{RedisServer, cost, key, no_refill, prepare};
use tollgate::backend::Backend;
use tollgate::backend::redis::{FailurePolicy, RedisBackend, RedisFailure};
use tollgate::{BackendErrorKind, Policy};

#[cfg(feature = "redis-tls")]
#[tokio::test]
async fn decisions_over_tls_with_a_private_ca_and_client_certificates() {
    let tls = support::TlsFiles::new();
    for auth_clients in [false, true] {
        let server = RedisServer::start_tls(&tls, auth_clients);
        let mut builder = RedisBackend::builder()
            .url(server.tls_url())
            .timeout(Duration::from_secs(2))
            .tls_ca_pem(tls.ca_pem.clone());
        if auth_clients {
            builder =
                builder.tls_client_cert(tls.client_cert_pem.clone(), tls.client_key_pem.clone());
        }
        let b = builder.build().unwrap();
        let p = prepare(&b, &Policy::new("tls", no_refill(2)));
        for allowed in [true, true, false] {
            let d = b.decide(&p, &key("k"), cost(1)).await.unwrap();
            assert_eq!(d.is_allowed(), allowed, "{d:?}");
        }
        assert_eq!(b.stats().errors, 0, "{:?}", b.stats());
    }
}

/// TLS material with a plain `redis://` URL is a configuration error, not a clear-text
/// connection.
#[cfg(feature = "redis-tls")]
#[test]
fn tls_material_without_rediss_is_refused() {
    let err = RedisBackend::builder()
        .url("redis://:pw@127.0.0.1:6379")
        .tls_ca_pem("-----BEGIN CERTIFICATE-----\n")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("not `rediss://`"), "{err}");
    assert!(!err.to_string().contains("pw@"), "{err}");
}

/// A server whose certificate the client does not trust: the failure policy answers, the
/// cause is a connection failure, and nothing secret is shown.
#[cfg(feature = "redis-tls")]
#[tokio::test]
async fn an_untrusted_server_fails_clearly_and_the_failure_policy_applies() {
    let tls = support::TlsFiles::new();
    let server = RedisServer::start_tls(&tls, false);
    let url = server.tls_url().replace("rediss://", "rediss://:s3cret@");
    let b = RedisBackend::builder()
        .url(&url)
        .timeout(Duration::from_millis(500))
        .on_failure(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("untrusted", no_refill(2)));
    let err = b.decide(&p, &key("k"), cost(1)).await.unwrap_err();
    assert!(
        matches!(
            err.kind(),
            BackendErrorKind::Unavailable | BackendErrorKind::Timeout
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(!text.contains("s3cret"), "{text}");
    assert!(!format!("{b:?}").contains("s3cret"));
    assert_eq!(b.stats().fail_closed, 1);
}

/// Without the feature, a `rediss://` URL is a configuration error naming it.
#[cfg(not(feature = "redis-tls"))]
#[test]
fn rediss_without_the_feature_names_it() {
    let err = RedisBackend::builder()
        .url("rediss://user:s3cret@localhost:6380")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("redis-tls"), "{err}");
    assert!(
        err.to_string().contains("rediss://user:***@localhost:6380"),
        "{err}"
    );
}

/// A password from the URL; a wrong one is reported as such.
#[tokio::test]
async fn passwords_from_the_url() {
    let server = RedisServer::start_with(&["--requirepass", "pw-123"]);
    let url = format!("redis://:pw-123@127.0.0.1:{}", server.port);
    let b = RedisBackend::builder().url(url).build().unwrap();
    let p = prepare(&b, &Policy::new("pw", no_refill(1)));
    assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    assert!(!b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());

    let wrong = RedisBackend::builder()
        .url(format!("redis://:nope@127.0.0.1:{}", server.port))
        .timeout(Duration::from_millis(500))
        .on_failure(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let p = prepare(&wrong, &Policy::new("pw", no_refill(1)));
    let err = wrong.decide(&p, &key("k"), cost(1)).await.unwrap_err();
    assert!(!err.to_string().contains("nope"), "{err}");
    support::eventually("the cause is known", || wrong.stats().failing.is_some()).await;
    assert_eq!(wrong.stats().failing, Some(RedisFailure::Authentication));
}

/// Creates the ACL user `tollgate` (password `s3cret`, keys `tollgate:*`) allowed only
/// `commands`, and returns a URL that logs in as it.
fn acl_user(server: &RedisServer, commands: &str) -> String {
    let acl = format!("ACL SETUSER tollgate on >s3cret ~tollgate:* resetchannels -@all {commands}");
    let args: Vec<&str> = acl.split_whitespace().collect();
    assert_eq!(server.cmd(&args).trim(), "+OK");
    format!("redis://tollgate:s3cret@127.0.0.1:{}", server.port)
}

/// The least-privilege ACL user of docs/redis.md: decisions, script loading after a flush,
/// resets and the probe all work with only these commands and keys.
#[tokio::test]
async fn a_least_privilege_acl_user_is_enough() {
    let server = RedisServer::start();
    let url = acl_user(
        &server,
        "+evalsha +eval +script|load +ping +del +get +set +time",
    );
    let b = RedisBackend::builder().url(url).build().unwrap();
    let p = prepare(&b, &Policy::new("acl", no_refill(2)));
    assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    // The script is loaded again after a flush, by the same user.
    assert_eq!(server.cmd(&["SCRIPT", "FLUSH"]).trim(), "+OK");
    assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    assert!(!b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    b.reset(&p, &key("k")).await.unwrap();
    assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    assert_eq!(b.stats().errors, 0, "{:?}", b.stats());
    // Another prefix is out of the user's keys: refused, reported as a permission failure.
    let other = RedisBackend::builder()
        .url(format!("redis://tollgate:s3cret@127.0.0.1:{}", server.port))
        .prefix("other")
        .on_failure(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let p = prepare(&other, &Policy::new("acl", no_refill(2)));
    assert!(other.decide(&p, &key("k"), cost(1)).await.is_err());
}

/// The ACL of docs/redis.md with what concurrent quotas and the fleet's count add: slots are
/// held and given back, and two instances falling back to local limits count each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_covers_slots_and_the_fleet() {
    use tollgate::backend::Mode;
    use tollgate::backend::redis::Fleet;
    let server = RedisServer::start();
    let url = acl_user(
        &server,
        "+evalsha +eval +script|load +ping +del +get +set +time \
         +zadd +zrem +zremrangebyscore +zcard +pexpire +pexpireat",
    );
    let make = || {
        RedisBackend::builder()
            .url(url.clone())
            .on_failure(FailurePolicy::FallbackLocal)
            .fleet(Fleet::Announced {
                every: Duration::from_millis(100),
            })
            .build()
            .unwrap()
    };
    let (a, b) = (make(), make());
    let slots = Policy::new("slots", tollgate::Quota::concurrent(1));
    let (pa, _pb) = (prepare(&a, &slots), prepare(&b, &slots));
    let hold = a.decide_with(&pa, &key("k"), cost(1), Mode::Hold { lease: 7 });
    assert!(hold.await.unwrap().is_allowed());
    let second = a.decide_with(&pa, &key("k"), cost(1), Mode::Hold { lease: 8 });
    assert!(!second.await.unwrap().is_allowed());
    let release = a.decide_with(&pa, &key("k"), cost(1), Mode::Release { lease: 7 });
    release.await.unwrap();
    let again = a.decide_with(&pa, &key("k"), cost(1), Mode::Hold { lease: 9 });
    assert!(again.await.unwrap().is_allowed());
    support::eventually("two instances count each other", || {
        a.stats().fleet_size == 2 && b.stats().fleet_size == 2
    })
    .await;
    assert_eq!(a.stats().errors, 0, "{:?}", a.stats());
}

/// The approximate mode's commands in the ACL of docs/redis.md: counts sent and read, the
/// fleet counted, a key past its allowance announced and the announcement read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_covers_the_approximate_mode_and_its_allowances() {
    use tollgate::backend::redis::{Approximate, Fleet};
    let server = RedisServer::start();
    let url = acl_user(
        &server,
        "+incrby +mget +pexpire +del +set +eval +time +zadd +zremrangebyscore +zcard \
         +xadd +xread",
    );
    let make = || {
        RedisBackend::builder()
            .url(url.clone())
            .fleet(Fleet::Announced {
                every: Duration::from_millis(100),
            })
            .build_approximate(Approximate::asynchronous())
            .unwrap()
    };
    let (a, b) = (make(), make());
    let policy = Policy::new(
        "acl",
        tollgate::Quota::per_minute(40)
            .sliding_window()
            .resolution(Duration::from_secs(1)),
    );
    let (pa, pb) = (prepare(&a, &policy), prepare(&b, &policy));
    // Both count the fleet from their first decision on (kept in step until then): 2
    // instances, an allowance of 40 x 0.5 / 2 = 10 each.
    let k = key("k");
    assert!(
        a.decide(&pa, &key("warm"), cost(1))
            .await
            .unwrap()
            .is_allowed()
    );
    assert!(
        b.decide(&pb, &key("warm"), cost(1))
            .await
            .unwrap()
            .is_allowed()
    );
    support::eventually("two instances count each other", || {
        a.stats().fleet_size == 2 && b.stats().fleet_size == 2
    })
    .await;
    // And read the announcements (a flush does at once): allowances on.
    a.flush().await;
    b.flush().await;
    for _ in 0..2 {
        assert!(b.decide(&pb, &k, cost(1)).await.unwrap().is_allowed());
    }
    for _ in 0..11 {
        assert!(a.decide(&pa, &k, cost(1)).await.unwrap().is_allowed());
    }
    a.flush().await;
    b.flush().await;
    assert!(b.decide(&pb, &k, cost(1)).await.unwrap().is_allowed());
    b.flush().await;
    a.reset(&pa, &key("warm")).await.unwrap();
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!((sa.announced, sa.failed_calls), (1, 0), "{sa:?}");
    assert_eq!((sb.allowances_recalled, sb.failed_calls), (1, 0), "{sb:?}");
    // The warm-up's 2, A's 11 and B's 3.
    assert_eq!(sa.units_sent + sb.units_sent, 16, "{sa:?} {sb:?}");
}

/// A Redis Cluster whose nodes speak only TLS (between themselves too): decisions through
/// `rediss://` cluster node URLs.
#[cfg(feature = "redis-tls")]
#[tokio::test]
async fn decisions_on_a_tls_cluster() {
    use std::process::Command;
    let tls = support::TlsFiles::new();
    let cert = |name: &str| tls.dir.path().join(name).display().to_string();
    let nodes: Vec<RedisServer> = (0..3)
        .map(|_| {
            RedisServer::start_tls_with(
                &tls,
                false,
                &[
                    "--tls-cluster",
                    "yes",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ],
            )
        })
        .collect();
    let mut create = Command::new("redis-cli");
    create.args(["--tls", "--cacert", &cert("ca.crt"), "--cluster", "create"]);
    for n in &nodes {
        create.arg(format!("127.0.0.1:{}", n.port));
    }
    let out = create
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let urls: Vec<String> = nodes.iter().map(|n| n.tls_url()).collect();
    let b = RedisBackend::builder()
        .cluster_nodes(urls)
        .timeout(Duration::from_secs(2))
        .tls_ca_pem(tls.ca_pem.clone())
        .build()
        .unwrap();
    let p = prepare(&b, &Policy::new("tls-cluster", no_refill(2)));
    // The cluster settles its slots within a few seconds of creation.
    let started = std::time::Instant::now();
    loop {
        match b.decide(&p, &key("k"), cost(1)).await {
            Ok(d) if !d.quotas().is_empty() => break,
            _ if started.elapsed() < Duration::from_secs(20) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => panic!("no decision over TLS: {other:?} {:?}", b.stats()),
        }
    }
    assert!(b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
    assert!(!b.decide(&p, &key("k"), cost(1)).await.unwrap().is_allowed());
}
