use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use http::HeaderMap;
use ipnet::IpNet;

use super::{Key, KeyError, KeyExtractor};
use crate::{ConfigError, RequestInfo};

/// The default IPv6 grouping: a /64, the usual allocation for one host or site.
pub(crate) const DEFAULT_V6_PREFIX: u8 = 64;

/// The TCP peer's address as recorded by the server, if any.
///
/// Looks for axum's `ConnectInfo<SocketAddr>` (feature `axum`), tonic's `TcpConnectInfo`
/// (feature `tonic`; plain TCP only, as tonic records `TlsConnectInfo` over TLS), and a plain
/// `SocketAddr` extension (for custom servers).
pub(crate) fn peer_addr(req: &RequestInfo<'_>) -> Option<IpAddr> {
    let ext = req.extensions();
    #[cfg(feature = "axum")]
    if let Some(ci) = ext.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(ci.0.ip());
    }
    #[cfg(feature = "tonic")]
    if let Some(addr) = ext
        .get::<tonic::transport::server::TcpConnectInfo>()
        .and_then(|ci| ci.remote_addr())
    {
        return Some(addr.ip());
    }
    ext.get::<SocketAddr>().map(SocketAddr::ip)
}

/// The key of `ip`: IPv4 as is, IPv6 grouped by its first `v6_prefix` bits.
pub(crate) fn group(ip: IpAddr, v6_prefix: u8) -> Key {
    match ip.to_canonical() {
        IpAddr::V6(v6) if v6_prefix < 128 => {
            let mask = if v6_prefix == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(v6_prefix))
            };
            Key::ip(IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask)))
        }
        other => Key::ip(other),
    }
}

fn check_prefix(prefix: u8) -> Result<(), ConfigError> {
    if prefix == 0 || prefix > 128 {
        return Err(ConfigError::Invalid {
            option: "ipv6_prefix",
            reason: format!("{prefix} is not a prefix length between 1 and 128"),
        });
    }
    Ok(())
}

/// Keys requests by the TCP peer's IP address, ignoring every forwarding header.
///
/// Use this when clients connect directly. Behind a load balancer or reverse proxy every request
/// would share the proxy's address: use [`ClientIp`] with the proxy's addresses instead.
///
/// The address comes from axum's `ConnectInfo<SocketAddr>` (serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`) or tonic's `TcpConnectInfo`. When the
/// server did not record it, extraction fails with [`KeyError::NoPeerAddr`], which the layer
/// handles as configured by
/// [`on_missing_key`](crate::RateLimitLayerBuilder::on_missing_key) and logs once at error
/// level.
#[derive(Debug, Clone)]
pub struct PeerIp {
    v6_prefix: u8,
}

impl PeerIp {
    /// Keys by peer address, grouping IPv6 addresses by /64.
    pub fn new() -> Self {
        PeerIp {
            v6_prefix: DEFAULT_V6_PREFIX,
        }
    }

    /// Groups IPv6 addresses by this prefix length (1..=128; 128 keys each address alone).
    pub fn ipv6_prefix(mut self, prefix: u8) -> Self {
        self.v6_prefix = prefix;
        self
    }
}

impl Default for PeerIp {
    fn default() -> Self {
        Self::new()
    }
}

impl KeyExtractor for PeerIp {
    fn extract(&self, req: &RequestInfo<'_>) -> Result<Key, KeyError> {
        peer_addr(req)
            .map(|ip| group(ip, self.v6_prefix))
            .ok_or(KeyError::NoPeerAddr)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        check_prefix(self.v6_prefix)
    }
}

/// Keys requests by the client's IP address, read through trusted proxies.
///
/// Forwarding headers are only believed when the TCP peer is a trusted proxy: from any other
/// peer they are ignored and the peer's own address is the key, so a client cannot pick its
/// bucket by sending `X-Forwarded-For`. With no trusted proxies (the default) this is
/// [`PeerIp`].
///
/// When the peer is trusted, exactly **one** header is read, the one your proxies set
/// ([`ForwardedHeader`], `X-Forwarded-For` by default); the others are ignored, because a proxy
/// passes through the headers it does not manage, and a client could otherwise choose its
/// address by sending one of those. Without that header, the peer address is the key.
///
/// Lists (`X-Forwarded-For`, RFC 7239 `Forwarded` with its `for=` parameters) are walked right
/// to left, skipping every hop that is itself a trusted proxy; the first untrusted address is
/// the client. If all hops are trusted, the leftmost is used. An entry that is not an IP
/// address (`unknown`, an obfuscated identifier, garbage) stops the walk at the last trusted
/// hop, which then becomes the key: such requests share one bucket rather than escaping limits.
///
/// ```
/// use std::net::SocketAddr;
/// use tollgate::key::{ClientIp, ForwardedHeader, KeyExtractor};
/// use tollgate::{Key, RequestInfo};
///
/// let key = ClientIp::new().trust_proxies(["10.0.0.0/8"]).unwrap();
///
/// // From the trusted load balancer: the forwarded client address counts.
/// let mut req = http::Request::get("/")
///     .header("x-forwarded-for", "203.0.113.9, 10.1.2.3")
///     .header("forwarded", "for=192.0.2.1") // not the configured header: ignored
///     .body(())
///     .unwrap();
/// req.extensions_mut().insert("10.0.0.1:443".parse::<SocketAddr>().unwrap());
/// assert_eq!(key.extract(&RequestInfo::new(&req)), Ok(Key::ip("203.0.113.9".parse().unwrap())));
///
/// // A proxy that sets RFC 7239 `Forwarded` instead:
/// let rfc = key.clone().forwarded_header(ForwardedHeader::Forwarded);
/// assert_eq!(rfc.extract(&RequestInfo::new(&req)), Ok(Key::ip("192.0.2.1".parse().unwrap())));
///
/// // From anyone else: the headers are ignored.
/// req.extensions_mut().insert("198.51.100.7:5555".parse::<SocketAddr>().unwrap());
/// assert_eq!(key.extract(&RequestInfo::new(&req)), Ok(Key::ip("198.51.100.7".parse().unwrap())));
/// ```
#[derive(Debug, Clone)]
pub struct ClientIp {
    trusted: Vec<IpNet>,
    v6_prefix: u8,
    header: ForwardedHeader,
}

/// The header trusted proxies put the client address in (see [`ClientIp`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (the default; AWS ALB, nginx, HAProxy, ...).
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client;proto=https, for=proxy1`.
    Forwarded,
    /// `X-Real-IP: client` (a single address, e.g. nginx `proxy_set_header X-Real-IP`).
    XRealIp,
}

impl ClientIp {
    /// Keys by client address with no trusted proxies: forwarding headers are ignored.
    pub fn new() -> Self {
        ClientIp {
            trusted: Vec::new(),
            v6_prefix: DEFAULT_V6_PREFIX,
            header: ForwardedHeader::default(),
        }
    }

    /// The header trusted proxies set (default `X-Forwarded-For`). Only this one is read.
    pub fn forwarded_header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Trusts the proxies in these CIDR ranges (`"10.0.0.0/8"`, `"::1/128"`; a bare address
    /// means that address alone). Returns `Err` naming the first entry that does not parse.
    pub fn trust_proxies<I, S>(mut self, cidrs: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        for cidr in cidrs {
            let s = cidr.as_ref().trim();
            let net = s
                .parse::<IpNet>()
                .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| ConfigError::Invalid {
                    option: "ClientIp::trust_proxies",
                    reason: format!("{s:?} is not a CIDR range or an IP address"),
                })?;
            self.trusted.push(canonical_net(net));
        }
        Ok(self)
    }

    /// Trusts the proxies in these already-parsed ranges.
    pub fn trust_nets(mut self, nets: impl IntoIterator<Item = IpNet>) -> Self {
        self.trusted.extend(nets.into_iter().map(canonical_net));
        self
    }

    /// Groups IPv6 addresses by this prefix length (1..=128; default 64).
    pub fn ipv6_prefix(mut self, prefix: u8) -> Self {
        self.v6_prefix = prefix;
        self
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    /// The client address for a request from `peer`.
    fn client(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        if self.trusted.is_empty() || !self.is_trusted(peer) {
            return peer;
        }
        match self.header {
            ForwardedHeader::Forwarded => self.walk(
                peer,
                hops(headers, http::header::FORWARDED, |line, hops| {
                    hops.extend(split_outside_quotes(line).map(forwarded_for));
                }),
            ),
            ForwardedHeader::XForwardedFor => self.walk(
                peer,
                hops(headers, "x-forwarded-for", |line, hops| {
                    hops.extend(line.split(',').map(parse_node));
                }),
            ),
            ForwardedHeader::XRealIp => headers
                .get("x-real-ip")
                .and_then(|v| v.to_str().ok())
                .and_then(parse_node)
                .unwrap_or(peer),
        }
    }

    /// Walks `hops` (left to right as sent) from the right, starting at the trusted `peer`.
    fn walk(&self, peer: IpAddr, hops: Hops) -> IpAddr {
        let mut client = peer;
        for hop in hops.iter().rev() {
            match hop {
                Some(ip) => {
                    client = *ip;
                    if !self.is_trusted(*ip) {
                        break;
                    }
                }
                None => break,
            }
        }
        client
    }
}

impl Default for ClientIp {
    fn default() -> Self {
        Self::new()
    }
}

impl KeyExtractor for ClientIp {
    fn extract(&self, req: &RequestInfo<'_>) -> Result<Key, KeyError> {
        let peer = peer_addr(req).ok_or(KeyError::NoPeerAddr)?;
        Ok(group(self.client(peer, req.headers()), self.v6_prefix))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        check_prefix(self.v6_prefix)
    }
}

/// The hops of a forwarding header, in the order sent. Header lists are short: they stay on
/// the stack in the common case.
type Hops = smallvec::SmallVec<[Option<IpAddr>; 8]>;

/// Collects the hops of every `name` line, left to right, parsing each line with `parse`.
fn hops<K: http::header::AsHeaderName>(
    headers: &HeaderMap,
    name: K,
    parse: impl Fn(&str, &mut Hops),
) -> Hops {
    let mut hops = Hops::new();
    for line in headers.get_all(name) {
        match line.to_str() {
            Ok(line) => parse(line, &mut hops),
            // A line that is not visible ASCII is garbage, like an entry that is not an
            // address: one hop that stops the walk. Skipping it would walk on into the
            // earlier lines, which the client wrote.
            Err(_) => hops.push(None),
        }
    }
    hops
}

/// A trusted range as the peer addresses it is compared with are written: IPv4-mapped IPv6
/// ranges (`::ffff:10.0.0.0/104`) become IPv4 ranges, as peers are compared in canonical form.
fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.addr().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96)
                .map(|n| IpNet::V4(n.trunc()))
                .unwrap_or(net.trunc()),
            None => net.trunc(),
        },
        _ => net.trunc(),
    }
}

/// Splits a `Forwarded` field value into its comma-separated elements, ignoring commas inside
/// quoted strings.
fn split_outside_quotes(value: &str) -> impl Iterator<Item = &str> {
    let mut in_quotes = false;
    let mut escaped = false;
    value.split(move |c: char| {
        if escaped {
            escaped = false;
            return false;
        }
        match c {
            '\\' if in_quotes => escaped = true,
            '"' => in_quotes = !in_quotes,
            ',' if !in_quotes => return true,
            _ => {}
        }
        false
    })
}

/// The `for=` node of one `Forwarded` element, parsed; `None` when absent or not an IP.
fn forwarded_for(element: &str) -> Option<IpAddr> {
    element.split(';').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        if !k.trim().eq_ignore_ascii_case("for") {
            return None;
        }
        let v = v.trim();
        let v = v
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or(v);
        parse_node(v)
    })
}

/// Parses `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]` or `[2001:db8::1]:80`.
fn parse_node(s: &str) -> Option<IpAddr> {
    let s = s.trim();
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Some(sa.ip().to_canonical());
    }
    let inner = s.strip_prefix('[')?.split(']').next()?;
    inner.parse::<Ipv6Addr>().ok().map(IpAddr::V6)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::try_from(*k).unwrap(),
                http::HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn proxied() -> ClientIp {
        ClientIp::new()
            .trust_proxies(["10.0.0.0/8", "2001:db8:ffff::/48"])
            .unwrap()
    }

    #[test]
    fn untrusted_peer_headers_are_ignored() {
        let h = headers(&[("x-forwarded-for", "1.1.1.1"), ("x-real-ip", "2.2.2.2")]);
        assert_eq!(proxied().client(ip("8.8.8.8"), &h), ip("8.8.8.8"));
        // No trusted proxies at all: the peer, always.
        assert_eq!(ClientIp::new().client(ip("10.0.0.1"), &h), ip("10.0.0.1"));
    }

    #[test]
    fn xff_walks_right_to_left_skipping_trusted_hops() {
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 1.1.1.1, 10.0.0.2")]);
        assert_eq!(proxied().client(ip("10.0.0.1"), &h), ip("1.1.1.1"));
        // Split over several header lines, in order.
        let h = headers(&[
            ("x-forwarded-for", "6.6.6.6"),
            ("x-forwarded-for", "1.1.1.1, 10.0.0.2"),
        ]);
        assert_eq!(proxied().client(ip("10.0.0.1"), &h), ip("1.1.1.1"));
        // All hops trusted: the leftmost.
        let h = headers(&[("x-forwarded-for", "10.9.9.9, 10.0.0.2")]);
        assert_eq!(proxied().client(ip("10.0.0.1"), &h), ip("10.9.9.9"));
        // Garbage stops the walk at the last trusted hop.
        let h = headers(&[("x-forwarded-for", "1.1.1.1, nonsense, 10.0.0.2")]);
        assert_eq!(proxied().client(ip("10.0.0.1"), &h), ip("10.0.0.2"));
    }

    #[test]
    fn a_line_that_is_not_ascii_stops_the_walk() {
        // The proxy appended the real client (1.2.3.4) to a line the client started with
        // bytes that are not visible ASCII; an earlier line is the client's too. Skipping the
        // unreadable line would key the request by the client's choice, 9.9.9.9.
        for name in ["x-forwarded-for", "forwarded"] {
            let mut h = HeaderMap::new();
            let (spoof, garbage) = if name == "forwarded" {
                ("for=9.9.9.9", &b"for=x\xff, for=1.2.3.4"[..])
            } else {
                ("9.9.9.9", &b"x\xff, 1.2.3.4"[..])
            };
            h.append(name, http::HeaderValue::from_static(spoof));
            h.append(name, http::HeaderValue::from_bytes(garbage).unwrap());
            let client = proxied()
                .forwarded_header(if name == "forwarded" {
                    ForwardedHeader::Forwarded
                } else {
                    ForwardedHeader::XForwardedFor
                })
                .client(ip("10.0.0.1"), &h);
            // The walk stops at the garbage: the last trusted hop, the peer.
            assert_eq!(client, ip("10.0.0.1"), "{name}");
        }
    }

    #[test]
    fn ipv4_mapped_trusted_ranges_match_ipv4_peers() {
        let client = ClientIp::new()
            .trust_proxies(["::ffff:10.0.0.0/104"])
            .unwrap();
        let h = headers(&[("x-forwarded-for", "1.1.1.1")]);
        assert_eq!(client.client(ip("10.1.2.3"), &h), ip("1.1.1.1"));
        assert_eq!(client.client(ip("::ffff:10.1.2.3"), &h), ip("1.1.1.1"));
        assert_eq!(client.client(ip("11.0.0.1"), &h), ip("11.0.0.1"));
    }

    #[test]
    fn only_the_configured_header_is_read() {
        // Behind an X-Forwarded-For proxy, a client-sent `Forwarded` or `X-Real-IP` is ignored.
        let h = headers(&[
            ("forwarded", "for=6.6.6.6"),
            ("x-real-ip", "7.7.7.7"),
            ("x-forwarded-for", "1.1.1.1"),
        ]);
        assert_eq!(proxied().client(ip("10.0.0.1"), &h), ip("1.1.1.1"));
        let h = headers(&[("forwarded", "for=6.6.6.6"), ("x-real-ip", "7.7.7.7")]);
        assert_eq!(proxied().client(ip("10.0.0.1"), &h), ip("10.0.0.1"));
        // Behind an X-Real-IP proxy, a client-sent X-Forwarded-For is ignored.
        let real = proxied().forwarded_header(ForwardedHeader::XRealIp);
        let h = headers(&[("x-forwarded-for", "6.6.6.6"), ("x-real-ip", "3.3.3.3")]);
        assert_eq!(real.client(ip("10.0.0.1"), &h), ip("3.3.3.3"));
    }

    #[test]
    fn rfc7239_forwarded() {
        let proxied = || proxied().forwarded_header(ForwardedHeader::Forwarded);
        let h = headers(&[
            ("x-forwarded-for", "9.9.9.9"),
            (
                "forwarded",
                r#"for=192.0.2.60;proto=http, for="[2001:db8:cafe::17]:4711";by=10.0.0.9"#,
            ),
        ]);
        assert_eq!(
            proxied().client(ip("10.0.0.1"), &h),
            ip("2001:db8:cafe::17")
        );
        let h = headers(&[("forwarded", r#"For="_hidden", for=10.0.0.5"#)]);
        assert_eq!(proxied().client(ip("10.0.0.1"), &h), ip("10.0.0.5"));
        let h = headers(&[("forwarded", "for=198.51.100.17:8080")]);
        assert_eq!(proxied().client(ip("10.0.0.1"), &h), ip("198.51.100.17"));
    }

    #[test]
    fn real_ip_only_from_trusted_peer() {
        let real = proxied().forwarded_header(ForwardedHeader::XRealIp);
        let h = headers(&[("x-real-ip", "3.3.3.3")]);
        assert_eq!(real.client(ip("10.0.0.1"), &h), ip("3.3.3.3"));
        assert_eq!(real.client(ip("4.4.4.4"), &h), ip("4.4.4.4"));
    }

    #[test]
    fn ipv6_grouped_by_prefix() {
        let a = group(ip("2001:db8:1:2:aaaa::1"), 64);
        let b = group(ip("2001:db8:1:2:bbbb::2"), 64);
        let c = group(ip("2001:db8:1:3::1"), 64);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(group(ip("2001:db8::1"), 128), group(ip("2001:db8::2"), 128));
        // IPv4-mapped addresses are IPv4.
        assert_eq!(group(ip("::ffff:1.2.3.4"), 64), Key::ip(ip("1.2.3.4")));
    }

    #[test]
    fn bad_config_is_an_error() {
        assert!(ClientIp::new().trust_proxies(["10.0.0.0/33"]).is_err());
        assert!(ClientIp::new().trust_proxies(["not-an-ip"]).is_err());
        assert!(ClientIp::new().ipv6_prefix(0).validate().is_err());
        assert!(ClientIp::new().ipv6_prefix(129).validate().is_err());
    }
}
