//! Property tests: no panics on hostile input, and the rate bound holds for any traffic.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::FakeRelativeClock;
use proptest::prelude::*;
use tollgate::backend::{Backend, LocalBackend};
use tollgate::key::{ClientIp, ForwardedHeader, Header, KeyExtractor, KeyExtractorExt};
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
                (any::<[u8; 4]>(), node_port())
                    .prop_map(|(o, port)| format!("for=\"{}:{port}\"", IpAddr::from(o))),
                Just("unknown".to_owned()),
                Just("for=\"_x\"".to_owned()),
                "[a-z0-9=;:\"\\[\\], ]{0,20}",
            ],
            0..10
        )
        .prop_map(|parts| parts.join(", ").into_bytes()),
    ]
}

/// A valid RFC 7239 `node-port`: numeric, or obfuscated (`_` and letters, digits, `._-`).
fn node_port() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<u16>().prop_map(|p| p.to_string()),
        "_[A-Za-z0-9._-]{1,12}",
    ]
}

/// A malformed `node-port`: empty, a bare `_`, out of range, signed, or with a stray byte.
fn bad_node_port() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("_".to_owned()),
        (65_536u32..=99_999).prop_map(|p| p.to_string()),
        (100_000u32..).prop_map(|p| p.to_string()),
        any::<u16>().prop_map(|p| format!("+{p}")),
        // The stray bytes are followed by a valid one: trailing spaces would be trimmed.
        r"_[A-Za-z0-9._-]{0,6}[ :/\\\[\]@!]+[A-Za-z0-9._-]{1,6}",
        "[0-9]{1,4}[a-z:_]",
    ]
}

/// A request from `peer` whose `name` lines are `lines`, in order.
fn request(peer: SocketAddr, name: &'static str, lines: &[Vec<u8>]) -> http::Request<()> {
    let mut req = http::Request::get("/").body(()).unwrap();
    for line in lines {
        if let Ok(v) = http::HeaderValue::from_bytes(line) {
            req.headers_mut().append(name, v);
        }
    }
    req.extensions_mut().insert(peer);
    req
}

proptest! {
    #[test]
    fn extractors_never_panic(
        xff in proptest::collection::vec(header_value(), 0..3),
        fwd in proptest::collection::vec(header_value(), 0..3),
        real in proptest::collection::vec(header_value(), 0..3),
        api in header_value(),
        peer in any::<[u8; 4]>(),
        trusted in any::<bool>(),
    ) {
        let mut req = http::Request::get("/").body(()).unwrap();
        for (name, lines) in [("x-forwarded-for", &xff), ("forwarded", &fwd), ("x-real-ip", &real), ("x-api-key", &vec![api])] {
            for v in lines {
                if let Ok(v) = http::HeaderValue::from_bytes(v) {
                    req.headers_mut().append(name, v);
                }
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
        for header in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded, ForwardedHeader::XRealIp] {
            let key = client.clone().forwarded_header(header).extract(&info).unwrap();
            if !trusted {
                prop_assert_eq!(key, Key::ip(peer.ip()));
            }
        }
        // The fallback covers a missing header; an over-long one is reported, not hidden.
        let r = Header::new("x-api-key").or(client).extract(&info);
        prop_assert!(r.is_ok() || matches!(r, Err(tollgate::KeyError::TooLong { .. })), "{:?}", r);
    }

    /// Whatever the client sends, the entry the trusted proxy adds after it decides the key, or
    /// the request falls back to the proxy's own address: the client never picks its key.
    #[test]
    fn a_client_cannot_outvote_the_proxy(
        header in prop_oneof![
            Just(ForwardedHeader::XForwardedFor),
            Just(ForwardedHeader::Forwarded),
            Just(ForwardedHeader::XRealIp),
        ],
        sent in proptest::collection::vec(header_value(), 0..3),
        real in any::<[u8; 4]>(),
        port in proptest::option::of(node_port()),
        fold in any::<bool>(),
    ) {
        let real = Ipv4Addr::from(real);
        prop_assume!(real.octets()[0] != 10);
        let peer = SocketAddr::from(([10, 0, 0, 1], 1000));
        let (name, entry) = match header {
            ForwardedHeader::XForwardedFor => ("x-forwarded-for", real.to_string()),
            ForwardedHeader::Forwarded => match &port {
                Some(port) => ("forwarded", format!("for=\"{real}:{port}\"")),
                None => ("forwarded", format!("for={real}")),
            },
            _ => ("x-real-ip", real.to_string()),
        };
        // The proxy appends its entry: on a line of its own, or folded into the last line.
        let mut lines = sent.clone();
        match lines.last_mut() {
            Some(last) if fold => last.extend_from_slice(format!(", {entry}").as_bytes()),
            _ => lines.push(entry.into_bytes()),
        }
        let req = request(peer, name, &lines);
        let key = ClientIp::new()
            .trust_proxies(["10.0.0.0/8"])
            .unwrap()
            .forwarded_header(header)
            .extract(&RequestInfo::new(&req))
            .unwrap();
        let (real, peer) = (Key::ip(real.into()), Key::ip(peer.ip()));
        prop_assert!(key == real || key == peer, "{key:?}");
        let client_sent = req.headers().get_all(name).iter().count() > 1 || (fold && !sent.is_empty());
        match header {
            // The rightmost entry is the proxy's, and it is untrusted: it is the client.
            ForwardedHeader::XForwardedFor => prop_assert_eq!(key, real),
            // Folded, an unclosed quote the client left open swallows the proxy's element.
            ForwardedHeader::Forwarded if !fold => prop_assert_eq!(key, real),
            // Several values: none is believed.
            ForwardedHeader::XRealIp if client_sent => prop_assert_eq!(key, peer),
            ForwardedHeader::XRealIp => prop_assert_eq!(key, real),
            _ => {}
        }
    }

    /// RFC 7239 nodes key by their address whatever their port, numeric or obfuscated, for both
    /// families; a malformed port makes the node unreadable, so the walk stops at the proxy.
    #[test]
    fn forwarded_ports_are_parsed_for_both_families(
        addr in prop_oneof![
            any::<[u8; 4]>().prop_map(IpAddr::from),
            any::<[u8; 16]>().prop_map(IpAddr::from),
        ],
        port in node_port(),
        bad in bad_node_port(),
    ) {
        let canonical = addr.to_canonical();
        prop_assume!(!matches!(canonical, IpAddr::V4(v4) if v4.octets()[0] == 10));
        let node = match addr {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => format!("[{v6}]"),
        };
        let peer = SocketAddr::from(([10, 0, 0, 1], 1000));
        let key = ClientIp::new()
            .trust_proxies(["10.0.0.0/8"])
            .unwrap()
            .forwarded_header(ForwardedHeader::Forwarded)
            .ipv6_prefix(128);
        let extract = |value: String| {
            let req = request(peer, "forwarded", &[b"for=6.6.6.6".to_vec(), value.into_bytes()]);
            key.extract(&RequestInfo::new(&req)).unwrap()
        };
        prop_assert_eq!(extract(format!("for=\"{node}:{port}\"")), Key::ip(canonical));
        prop_assert_eq!(extract(format!("for=\"{node}\"")), Key::ip(canonical));
        prop_assert_eq!(extract(format!("for=\"{node}:{bad}\"")), Key::ip(peer.ip()));
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
