use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

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

pub(crate) fn check_prefix(prefix: u8) -> Result<(), ConfigError> {
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
/// address (`unknown`, an obfuscated identifier such as `_hidden`, garbage) stops the walk at
/// the last trusted hop, which then becomes the key: such requests share one bucket rather than
/// escaping limits. So does a line that is not visible ASCII, and a `Forwarded` element whose
/// `for=` is missing or repeated.
///
/// An entry may carry a port, which is ignored: numeric or obfuscated, as RFC 7239 §6 writes
/// nodes, for both families (`1.2.3.4:8080`, `1.2.3.4:_a1`, `[2001:db8::1]:4711`,
/// `[2001:db8::1]:_a1`). A malformed port (`1.2.3.4:`, `1.2.3.4:_`, `1.2.3.4:99999`) makes the
/// entry unreadable, like garbage.
///
/// `X-Real-IP` holds one address and is only believed as exactly one line with one address.
/// Several lines, or a comma-separated list, mean that something besides the nearest proxy
/// wrote it (a proxy that appends rather than replaces passes the client's own line through),
/// and guessing which line is the proxy's could let the client choose its key: the request is
/// keyed by the peer instead, the trusted proxy's address, as after an unreadable
/// `X-Forwarded-For` line. Have the proxy replace the header (nginx
/// `proxy_set_header X-Real-IP $remote_addr` does).
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
    /// `X-Real-IP: client` (a single address, e.g. nginx `proxy_set_header X-Real-IP`, which
    /// replaces what the client sent). Several lines or a list are not believed: the peer is
    /// the key.
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
            ForwardedHeader::XRealIp => real_ip(headers).unwrap_or(peer),
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

/// The address in the request's `X-Real-IP`, if it has exactly one line holding one address.
///
/// The header holds a single address, so several lines (or one with a comma-separated list,
/// which is how several lines may be folded into one) mean that something besides the nearest
/// proxy wrote it: a proxy that appends rather than replaces passes the client's own line
/// through. Which line is whose is a guess about the proxy, so none is believed (`None`), as
/// with a line that is not visible ASCII or not an address.
fn real_ip(headers: &HeaderMap) -> Option<IpAddr> {
    let mut lines = headers.get_all("x-real-ip").into_iter();
    let line = lines.next()?;
    if lines.next().is_some() {
        return None;
    }
    let line = line.to_str().ok()?;
    if line.contains(',') {
        return None;
    }
    parse_node(line)
}

/// Splits a `Forwarded` field value into its comma-separated elements, ignoring commas inside
/// quoted strings.
fn split_outside_quotes(value: &str) -> impl Iterator<Item = &str> {
    split_unquoted(value, ',')
}

/// Splits `value` at every `sep` that is not inside a quoted string.
fn split_unquoted(value: &str, sep: char) -> impl Iterator<Item = &str> {
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
            c if c == sep && !in_quotes => return true,
            _ => {}
        }
        false
    })
}

/// The `for=` node of one `Forwarded` element, parsed; `None` when absent, not an IP, or given
/// more than once (RFC 7239 §4 allows each parameter once per element: taking either copy would
/// be a guess). Parameters are split outside quoted strings, so a `;for=` inside another
/// parameter's quoted value (`host="a;for=6.6.6.6"`) is not read as one.
fn forwarded_for(element: &str) -> Option<IpAddr> {
    let mut fors = split_unquoted(element, ';').filter_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        k.trim().eq_ignore_ascii_case("for").then_some(v)
    });
    let v = fors.next()?;
    if fors.next().is_some() {
        return None;
    }
    let v = v.trim();
    let v = v
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(v);
    parse_node(v)
}

/// Parses a node with an optional port, as RFC 7239 §6 writes it (`node = nodename [ ":"
/// node-port ]`), plus a bare IPv6 address as `X-Forwarded-For` writes it: `1.2.3.4`,
/// `1.2.3.4:80`, `1.2.3.4:_obf`, `2001:db8::1`, `[2001:db8::1]`, `[2001:db8::1]:80` or
/// `[2001:db8::1]:_obf`. The port is checked and dropped; `None` for anything else, including an
/// obfuscated node name (`_hidden`), `unknown`, or a malformed port (`1.2.3.4:`, `1.2.3.4:_`,
/// `1.2.3.4:99999`, `[2001:db8::1]x`).
fn parse_node(s: &str) -> Option<IpAddr> {
    let s = s.trim();
    let (ip, port) = if let Some(bracketed) = s.strip_prefix('[') {
        let (v6, rest) = bracketed.split_once(']')?;
        let port = match rest {
            "" => None,
            _ => Some(rest.strip_prefix(':')?),
        };
        (IpAddr::V6(v6.parse::<Ipv6Addr>().ok()?), port)
    } else if let Ok(ip) = s.parse::<IpAddr>() {
        (ip, None)
    } else {
        // An IPv4 address and a port: unbracketed IPv6 cannot carry one.
        let (v4, port) = s.split_once(':')?;
        (IpAddr::V4(v4.parse::<Ipv4Addr>().ok()?), Some(port))
    };
    if port.is_some_and(|port| !is_node_port(port)) {
        return None;
    }
    Some(ip.to_canonical())
}

/// RFC 7239 §6 `node-port = port / obfport`: `port = 1*5DIGIT` (here also at most 65535) and
/// `obfport = "_" 1*(ALPHA / DIGIT / "." / "_" / "-")`.
fn is_node_port(port: &str) -> bool {
    match port.strip_prefix('_') {
        Some(obf) => {
            !obf.is_empty()
                && obf
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        }
        // Digits only: `u16::from_str` alone would also take a sign (`+80`).
        None => {
            (1..=5).contains(&port.len())
                && port.bytes().all(|b| b.is_ascii_digit())
                && port.parse::<u16>().is_ok()
        }
    }
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
    fn real_ip_with_several_lines_is_unusable() {
        let real = proxied().forwarded_header(ForwardedHeader::XRealIp);
        let peer = ip("10.0.0.1");
        // The client sent 6.6.6.6 and a proxy appended the real address rather than replacing
        // the header: neither line is believed, in either order, and the peer is the key.
        for lines in [["6.6.6.6", "1.2.3.4"], ["1.2.3.4", "6.6.6.6"]] {
            let h = headers(&[("x-real-ip", lines[0]), ("x-real-ip", lines[1])]);
            assert_eq!(real.client(peer, &h), peer, "{lines:?}");
        }
        // The same folded into one line is not a single address either.
        for value in ["6.6.6.6, 1.2.3.4", "6.6.6.6,1.2.3.4", "1.2.3.4,"] {
            let h = headers(&[("x-real-ip", value)]);
            assert_eq!(real.client(peer, &h), peer, "{value}");
        }
        // A line that is not visible ASCII next to a readable one: still several lines.
        let mut h = headers(&[("x-real-ip", "6.6.6.6")]);
        h.append(
            "x-real-ip",
            http::HeaderValue::from_bytes(b"1.2.3.4\xff").unwrap(),
        );
        assert_eq!(real.client(peer, &h), peer);
        // One line with one address (a port is allowed) is the client.
        let h = headers(&[("x-real-ip", " 1.2.3.4:8080 ")]);
        assert_eq!(real.client(peer, &h), ip("1.2.3.4"));
        let h = headers(&[("x-real-ip", "[2001:db8::7]")]);
        assert_eq!(real.client(peer, &h), ip("2001:db8::7"));
        // One unreadable line: the peer, as before.
        for value in ["", "unknown", "_hidden", "1.2.3.4:_"] {
            let h = headers(&[("x-real-ip", value)]);
            assert_eq!(real.client(peer, &h), peer, "{value:?}");
        }
    }

    #[test]
    fn rfc7239_ports_numeric_and_obfuscated_for_both_families() {
        let fwd = proxied().forwarded_header(ForwardedHeader::Forwarded);
        let peer = ip("10.0.0.1");
        for (value, client) in [
            (r#"for="1.2.3.4:_abc""#, "1.2.3.4"),
            (r#"for="1.2.3.4:_A.b_c-9""#, "1.2.3.4"),
            (r#"for="1.2.3.4:_""#, ""),
            (r#"for="1.2.3.4:8080""#, "1.2.3.4"),
            (r#"for="1.2.3.4:0""#, "1.2.3.4"),
            (r#"for="1.2.3.4:65535""#, "1.2.3.4"),
            ("for=1.2.3.4:_abc", "1.2.3.4"),
            (r#"for="[2001:db8::1]:_x""#, "2001:db8::1"),
            (r#"for="[2001:db8::1]:4711""#, "2001:db8::1"),
            (r#"for="[2001:db8::1]""#, "2001:db8::1"),
            (r#"for="[::ffff:1.2.3.4]:_p""#, "1.2.3.4"),
        ] {
            let h = headers(&[("forwarded", value)]);
            let want = if client.is_empty() { peer } else { ip(client) };
            assert_eq!(fwd.client(peer, &h), want, "{value}");
        }
        // Malformed ports make the node unreadable: the walk stops at the last trusted hop.
        for node in [
            "1.2.3.4:",
            "1.2.3.4:_",
            "1.2.3.4:99999",
            "1.2.3.4:123456",
            "1.2.3.4:+80",
            "1.2.3.4:-1",
            "1.2.3.4:8a",
            "1.2.3.4:_a b",
            "1.2.3.4:_a:b",
            "1.2.3.4:_a/b",
            "1.2.3.4::80",
            "1.2.3.4 :80",
            "[2001:db8::1]:",
            "[2001:db8::1]:_",
            "[2001:db8::1]:99999",
            "[2001:db8::1]_x",
            "[2001:db8::1]x",
            "[2001:db8::1",
            "[1.2.3.4]:80",
            "[2001:db8::1]:_x]",
        ] {
            let h = headers(&[("forwarded", &format!("for=\"{node}\", for=10.0.0.5"))]);
            assert_eq!(fwd.client(peer, &h), ip("10.0.0.5"), "{node}");
            let h = headers(&[("forwarded", &format!("for=\"{node}\""))]);
            assert_eq!(fwd.client(peer, &h), peer, "{node}");
        }
    }

    #[test]
    fn rfc7239_obfuscated_and_unknown_nodes_stop_the_walk() {
        let fwd = proxied().forwarded_header(ForwardedHeader::Forwarded);
        let peer = ip("10.0.0.1");
        for node in [
            "_hidden",
            "\"_hidden\"",
            "unknown",
            "\"unknown:80\"",
            "\"_x:_y\"",
        ] {
            // The obfuscated or unknown hop is not believed, nor anything left of it.
            let h = headers(&[(
                "forwarded",
                &format!("for=6.6.6.6, for={node}, for=10.0.0.5"),
            )]);
            assert_eq!(fwd.client(peer, &h), ip("10.0.0.5"), "{node}");
            let h = headers(&[("forwarded", &format!("for=6.6.6.6, for={node}"))]);
            assert_eq!(fwd.client(peer, &h), peer, "{node}");
        }
    }

    #[test]
    fn rfc7239_element_with_a_repeated_or_hidden_for_is_unreadable() {
        let fwd = proxied().forwarded_header(ForwardedHeader::Forwarded);
        let peer = ip("10.0.0.1");
        for element in [
            // RFC 7239 §4: a parameter occurs at most once per element.
            "for=_hidden;for=6.6.6.6",
            "for=1.2.3.4;for=6.6.6.6",
            // A `for=` inside another parameter's quoted value is not a parameter.
            r#"host="a;for=6.6.6.6;b";for=_hidden"#,
            // No `for=` at all.
            "proto=https",
        ] {
            let h = headers(&[("forwarded", element)]);
            assert_eq!(fwd.client(peer, &h), peer, "{element}");
        }
        let h = headers(&[(
            "forwarded",
            r#"host="a;for=6.6.6.6, b";for=1.2.3.4;proto=https"#,
        )]);
        assert_eq!(fwd.client(peer, &h), ip("1.2.3.4"));
    }

    #[test]
    fn xff_entries_with_ports() {
        let peer = ip("10.0.0.1");
        for (value, client) in [
            ("6.6.6.6, 1.2.3.4:8080", "1.2.3.4"),
            ("6.6.6.6, [2001:db8::1]:8080", "2001:db8::1"),
            ("6.6.6.6, 2001:db8::1", "2001:db8::1"),
            ("6.6.6.6, 1.2.3.4:_obf", "1.2.3.4"),
            ("6.6.6.6, 1.2.3.4:99999", "10.0.0.1"),
            ("6.6.6.6, [2001:db8::1]junk", "10.0.0.1"),
        ] {
            let h = headers(&[("x-forwarded-for", value)]);
            assert_eq!(proxied().client(peer, &h), ip(client), "{value}");
        }
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
