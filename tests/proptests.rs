//! Property tests: no panics on hostile input, and the rate bound holds for any traffic.

use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::FakeRelativeClock;
use proptest::prelude::*;
use tollgate::backend::{Backend, LocalBackend};
use tollgate::key::{ClientIp, Header, KeyExtractor, KeyExtractorExt};
use tollgate::{Key, Policy, Quota, RequestInfo};

fn header_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        // Arbitrary visible bytes, as a client may send.
        proptest::collection::vec(0x20u8..0x7f, 0..200),
        // Plausible forwarding lists with noise.
        proptest::collection::vec(
            prop_oneof![
                any::<[u8; 4]>().prop_map(|o| IpAddr::from(o).to_string()),
                any::<[u8; 16]>().prop_map(|o| format!("[{}]:80", IpAddr::from(o))),
                Just("unknown".to_owned()),
                Just("for=\"_x\"".to_owned()),
                "[a-z0-9=;:\"\\[\\], ]{0,20}",
            ],
            0..10
        )
        .prop_map(|parts| parts.join(", ").into_bytes()),
    ]
}

proptest! {
    #[test]
    fn extractors_never_panic(
        xff in header_value(),
        fwd in header_value(),
        real in header_value(),
        api in header_value(),
        peer in any::<[u8; 4]>(),
        trusted in any::<bool>(),
    ) {
        let mut req = http::Request::get("/").body(()).unwrap();
        for (name, v) in [("x-forwarded-for", &xff), ("forwarded", &fwd), ("x-real-ip", &real), ("x-api-key", &api)] {
            if let Ok(v) = http::HeaderValue::from_bytes(v) {
                req.headers_mut().insert(name, v);
            }
        }
        let peer = SocketAddr::from((peer, 1000));
        req.extensions_mut().insert(peer);
        let client = if trusted {
            ClientIp::new().trust_proxies(["0.0.0.0/0", "::/0"]).unwrap()
        } else {
            ClientIp::new()
        };
        let info = RequestInfo::new(&req);
        let key = client.extract(&info).unwrap();
        if !trusted {
            prop_assert_eq!(key, Key::ip(peer.ip()));
        }
        let _ = Header::new("x-api-key").or(client).extract(&info).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// GCRA's promise: over any span of time `T`, at most `burst + T / interval` units pass,
    /// whatever the arrival pattern and costs.
    #[test]
    fn allowed_units_never_exceed_burst_plus_rate(
        burst in 1u32..20,
        per_sec in 1u32..50,
        traffic in proptest::collection::vec((0u64..200, 1u32..5), 1..300),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let clock = FakeRelativeClock::default();
        let backend = LocalBackend::builder().clock(clock.clone()).build();
        let policy = Policy::new("p", Quota::per_second(per_sec).burst(burst));
        let prepared = backend.prepare(&policy, &policy.validate().unwrap()).unwrap();
        let key = Key::from_bytes("k").unwrap();
        let mut elapsed = Duration::ZERO;
        let mut allowed_units = 0u64;
        for (advance_ms, cost) in traffic {
            clock.advance(Duration::from_millis(advance_ms));
            elapsed += Duration::from_millis(advance_ms);
            let d = rt.block_on(backend.decide(&prepared, &key, NonZeroU32::new(cost).unwrap())).unwrap();
            if d.is_allowed() {
                allowed_units += u64::from(cost);
            }
            let interval = Duration::from_secs(1) / per_sec;
            let bound = u64::from(burst) + (elapsed.as_nanos() / interval.as_nanos()) as u64;
            prop_assert!(allowed_units <= bound, "{allowed_units} > {bound}");
            prop_assert!(d.quotas()[0].remaining <= burst);
        }
    }
}
