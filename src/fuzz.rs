//! Fuzz targets: one function per target, each feeding bytes to a parser and asserting what
//! must hold for every input (no panic, no overflow, round trips, bounds).
//!
//! The functions are called by the `cargo fuzz` targets in `fuzz/fuzz_targets/` (which build
//! this crate with `--cfg fuzzing`) and, in the normal test suite, by the tests below, which run
//! every input kept in `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/` through them.
//! `scripts/fuzz.sh` runs the targets for a bounded time; see `fuzz/README.md`.
//!
//! The serde targets read TOML, YAML and JSON, whose crates are only dev-dependencies of this
//! crate: they take a [`Formats`], implemented by [`fuzz_formats!`](crate::fuzz_formats) in
//! the crate that has them (the fuzz crate, and this module's tests).
//!
//! Inputs are text where the parser reads text (quota strings, configuration files, header
//! lines), so that the corpus is readable; numeric inputs (store replies, quota numbers) are
//! read with [`Bytes`], which pads with zeros, so that every input means something.

use std::net::{IpAddr, SocketAddr};
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "rls-client"
))]
use std::num::NonZeroU32;
use std::time::Duration;

use http::{HeaderName, HeaderValue};

#[cfg(feature = "redis")]
use crate::backend::redis::script;
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "rls-client"
))]
use crate::backend::{Decision, Mode, Outcome};
use crate::key::{ClientIp, ForwardedHeader, Header, KeyExtractor, KeyExtractorExt};
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "rls-client"
))]
use crate::quota::QuotaParams;
use crate::quota::{Algorithm, QuotaKind};
use crate::{Key, KeyError, Policy, Quota, RequestInfo};

/// Reads numbers from fuzz input, little-endian, as zeros once the input is used up.
#[derive(Debug, Clone)]
pub struct Bytes<'a> {
    data: &'a [u8],
}

impl<'a> Bytes<'a> {
    /// A reader over `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Bytes { data }
    }

    /// Whether every byte was read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The next byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        let (&b, rest) = self.data.split_first().unwrap_or((&0, &[]));
        self.data = rest;
        b
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0; N];
        let n = N.min(self.data.len());
        out[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        out
    }

    /// The next two bytes.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }

    /// The next four bytes.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    /// The next eight bytes.
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }

    /// A number of any size, its size chosen by a first byte: small numbers (store codes,
    /// counts) are then one byte away.
    pub fn int(&mut self) -> i64 {
        match self.u8() % 4 {
            0 => i64::from(self.u8() as i8),
            1 => i64::from(self.u16()),
            2 => i64::from(self.u32()),
            _ => self.u64() as i64,
        }
    }

    /// The rest of the input.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}

// ---------------------------------------------------------------------------------------------
// Forwarding headers and key extraction.

/// Header names the key input may abbreviate, so that the fuzzer finds them at once.
fn header_name(name: &[u8]) -> Option<HeaderName> {
    Some(match name {
        b"x" => HeaderName::from_static("x-forwarded-for"),
        b"f" => http::header::FORWARDED,
        b"r" => HeaderName::from_static("x-real-ip"),
        b"k" => HeaderName::from_static("x-api-key"),
        other => HeaderName::from_bytes(other).ok()?,
    })
}

/// The trusted proxies of the key target, chosen by a flag.
const TRUSTED: [&[&str]; 7] = [
    &[],
    &["10.0.0.0/8"],
    &["10.0.0.0/8", "2001:db8::/32"],
    &["::ffff:10.0.0.0/104"],
    &["0.0.0.0/0", "::/0"],
    &["127.0.0.1", "::1"],
    &["10.0.0.0/8", "192.168.0.0/16", "fd00::/8"],
];

/// A request for the key target: lines of `name: value` (`x`, `f`, `r` and `k` stand for
/// `X-Forwarded-For`, `Forwarded`, `X-Real-IP` and `X-Api-Key`), the peer address given by a
/// `peer: <ip>` line.
fn key_request(lines: &[&[u8]], peer: Option<IpAddr>) -> http::Request<()> {
    let mut req = http::Request::new(());
    for line in lines {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        let value = value.strip_prefix(b" ").unwrap_or(value);
        if let (Some(name), Ok(value)) = (header_name(name), HeaderValue::from_bytes(value)) {
            req.headers_mut().append(name, value);
        }
    }
    if let Some(peer) = peer {
        req.extensions_mut().insert(SocketAddr::new(peer, 443));
    }
    req
}

fn extract(key: &impl KeyExtractor, req: &http::Request<()>) -> Result<Key, KeyError> {
    let key = key.extract(&RequestInfo::new(req));
    if let Ok(k) = &key {
        let mut enc = Vec::new();
        k.encode(&mut enc);
        assert!(!enc.is_empty());
        let shown = k.to_string();
        if let Some(ip) = k.as_ip()
            && k.space() == 0
        {
            assert_eq!(shown.parse::<IpAddr>().ok(), Some(ip), "{k:?}");
        }
    }
    key
}

/// The header a forwarded-header mode reads.
fn mode_header(mode: ForwardedHeader) -> HeaderName {
    match mode {
        ForwardedHeader::Forwarded => http::header::FORWARDED,
        ForwardedHeader::XRealIp => HeaderName::from_static("x-real-ip"),
        _ => HeaderName::from_static("x-forwarded-for"),
    }
}

/// Key extraction from forwarding headers (`ClientIp` in each header mode, trusted proxies
/// from a flag and `trust:` lines) and from a header (`Header`, hashed or not), alone, in an
/// `or` chain and in a tuple.
///
/// Input: a flag byte (bits 0-1 the header mode, 2-4 the trusted proxies, 5 no peer address),
/// then lines: `peer:<ip>`, `trust:<cidr>`, `spoof:<value>` (a line a client adds before the
/// others) and `name: value` header lines.
///
/// Checked: extraction never fails when the peer address is known; headers other than the
/// mode's never change the key; an untrusted peer's headers are ignored; a client cannot change
/// a key that is an untrusted address by adding lines or `X-Forwarded-For` entries on the left
/// (what a client controls); several `X-Real-IP` lines are not believed; `Header` keys are the
/// value, refused when longer than `Key::MAX_LEN`, and hashed keys are 16 bytes; IP keys display
/// as their address.
pub fn key_extract(data: &[u8]) {
    let Some((&flags, text)) = data.split_first() else {
        return;
    };
    let mode = match flags & 3 {
        1 => ForwardedHeader::Forwarded,
        2 => ForwardedHeader::XRealIp,
        _ => ForwardedHeader::XForwardedFor,
    };
    let mut trusted: Vec<&str> = TRUSTED[usize::from((flags >> 2) & 7) % TRUSTED.len()].to_vec();
    let mut peer: Option<IpAddr> = (flags & 32 == 0).then(|| [10, 0, 0, 1].into());
    let mut spoof: Vec<&[u8]> = Vec::new();
    let mut lines: Vec<&[u8]> = Vec::new();
    for line in text.split(|&b| b == b'\n') {
        if let Some(ip) = line.strip_prefix(b"peer:") {
            if let Some(ip) = std::str::from_utf8(ip)
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                peer = Some(ip);
            }
        } else if let Some(cidr) = line.strip_prefix(b"trust:") {
            if let Ok(cidr) = std::str::from_utf8(cidr) {
                trusted.push(cidr);
            }
        } else if let Some(value) = line.strip_prefix(b"spoof:") {
            spoof.push(value);
        } else {
            lines.push(line);
        }
    }
    // Each entry alone: a bad one is an error, never a panic, and leaves the others.
    let mut client = ClientIp::new().forwarded_header(mode);
    for cidr in &trusted {
        if let Ok(c) = client.clone().trust_proxies([cidr]) {
            client = c;
        }
    }
    let exact = client.clone().ipv6_prefix(128);
    let req = key_request(&lines, peer);

    // Every header mode, the default grouping: a key whenever the peer is known.
    for m in [
        ForwardedHeader::XForwardedFor,
        ForwardedHeader::Forwarded,
        ForwardedHeader::XRealIp,
    ] {
        let got = extract(&client.clone().forwarded_header(m), &req);
        match peer {
            Some(_) => assert!(got.is_ok(), "{got:?}"),
            None => assert_eq!(got, Err(KeyError::NoPeerAddr)),
        }
    }
    let Some(peer) = peer else {
        return;
    };
    let key = extract(&exact, &req).expect("a peer address gives a key");
    let ip = key.as_ip().expect("ClientIp keys are IP keys");

    // Only the mode's header is read: the request with that header alone gives the same key.
    let only: Vec<&[u8]> = lines
        .iter()
        .copied()
        .filter(|line| {
            let name = line.split(|&b| b == b':').next().unwrap_or_default();
            header_name(name).is_some_and(|n| n == mode_header(mode))
        })
        .collect();
    assert_eq!(
        extract(&exact, &key_request(&only, Some(peer))),
        Ok(key.clone())
    );

    // Whether `addr` is a trusted proxy, as the extractor sees it: a trusted peer's forwarded
    // address is believed, an untrusted one's is not.
    let probe: IpAddr = if addr_eq(peer, [192, 0, 2, 1].into()) {
        [192, 0, 2, 2].into()
    } else {
        [192, 0, 2, 1].into()
    };
    let trusts = |addr: IpAddr| {
        let xff = exact
            .clone()
            .forwarded_header(ForwardedHeader::XForwardedFor);
        let line = format!("x-forwarded-for:{probe}");
        let r = extract(&xff, &key_request(&[line.as_bytes()], Some(addr)));
        r.ok().and_then(|k| k.as_ip()) == Some(probe.to_canonical())
    };
    let peer_trusted = trusts(peer);
    if !peer_trusted {
        assert!(addr_eq(ip, peer), "untrusted peer {peer}, key {ip}");
    }

    let header = mode_header(mode);
    match mode {
        ForwardedHeader::XRealIp => {
            // A second line is not believed: the key is the peer's.
            let mut twice = req.clone();
            twice
                .headers_mut()
                .append(header.clone(), HeaderValue::from_static("192.0.2.77"));
            if req.headers().contains_key(&header) {
                let k = extract(&exact, &twice).unwrap();
                assert!(addr_eq(k.as_ip().unwrap(), peer), "{k:?}");
            }
        }
        _ if !trusts(ip) => {
            // The key is the first untrusted hop from the right (or the peer): what a client
            // writes left of it cannot change it.
            for s in &spoof {
                let Ok(value) = HeaderValue::from_bytes(s) else {
                    continue;
                };
                let mut before = req.clone();
                let old: Vec<HeaderValue> =
                    before.headers().get_all(&header).iter().cloned().collect();
                before.headers_mut().remove(&header);
                before.headers_mut().append(header.clone(), value.clone());
                for v in &old {
                    before.headers_mut().append(header.clone(), v.clone());
                }
                assert_eq!(
                    extract(&exact, &before),
                    Ok(key.clone()),
                    "spoof line {value:?}"
                );
                // Entries in the proxies' line: only visible ASCII (a line that is not is
                // unreadable as a whole, and keyed by the last trusted hop, by design).
                if mode == ForwardedHeader::XForwardedFor
                    && value.to_str().is_ok()
                    && let Some(first) = old.first()
                {
                    // The client's own entries, then the proxies' in the same line.
                    let mut joined = s.to_vec();
                    joined.extend_from_slice(b", ");
                    joined.extend_from_slice(first.as_bytes());
                    if let Ok(joined) = HeaderValue::from_bytes(&joined) {
                        let mut same = req.clone();
                        same.headers_mut().remove(&header);
                        same.headers_mut().append(header.clone(), joined);
                        for v in &old[1..] {
                            same.headers_mut().append(header.clone(), v.clone());
                        }
                        assert_eq!(extract(&exact, &same), Ok(key.clone()), "spoof entry {s:?}");
                    }
                }
            }
        }
        _ => {}
    }

    // The default grouping is the /64 of the exact key.
    let grouped = extract(&client, &req).unwrap();
    assert_eq!(
        grouped,
        crate::key::group(ip, crate::key::DEFAULT_V6_PREFIX)
    );

    // A header key: its value, or missing, or too long; hashed, always 16 bytes.
    let api = HeaderName::from_static("x-api-key");
    let value = req.headers().get(&api);
    let by_header = extract(&Header::new("x-api-key"), &req);
    match value {
        Some(v) if !v.is_empty() => match Key::from_bytes(v.as_bytes()) {
            Ok(k) => assert_eq!(by_header, Ok(k)),
            Err(e) => assert_eq!(by_header, Err(e)),
        },
        _ => assert!(matches!(by_header, Err(KeyError::Missing(_)))),
    }
    if let Ok(k) = extract(&Header::new("x-api-key").hashed([7; 16]), &req) {
        let mut enc = Vec::new();
        k.encode(&mut enc);
        assert_eq!(enc.len(), 17);
    }
    // A chain falls back only when the header is missing, into a key space of its own.
    let chain = Header::new("x-api-key").or(client.clone());
    match (&by_header, extract(&chain, &req)) {
        (Ok(k), got) => assert_eq!(got.as_ref(), Ok(k)),
        (Err(KeyError::Missing(_)), Ok(k)) => {
            assert_eq!(k.space(), 1);
            assert!(k.same_value(&grouped));
        }
        (Err(e), got) => assert_eq!(got.as_ref(), Err(e)),
    }
    let pair = extract(&(Header::new("x-api-key"), client.clone()), &req);
    assert_eq!(pair.is_ok(), by_header.is_ok());
    // Any header name is accepted by the constructor; a bad one is reported, not a panic.
    for line in &lines {
        let name = line.split(|&b| b == b':').next().unwrap_or_default();
        if let Ok(name) = std::str::from_utf8(name) {
            let h = Header::new(name);
            let _ = extract(&h, &req);
            let _ = h.validate();
        }
    }
}

/// Whether two addresses are the same, IPv4-mapped IPv6 addresses being IPv4.
fn addr_eq(a: IpAddr, b: IpAddr) -> bool {
    a.to_canonical() == b.to_canonical()
}

// ---------------------------------------------------------------------------------------------
// Quotas.

/// The longest bucket or window a valid quota has.
const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// What must hold of a quota whatever its values: its parameters are computed without
/// overflow and, when valid, within their bounds; and a valid quota is written as a string that
/// parses back to it.
fn check_quota(q: &Quota) {
    let _ = q.to_string();
    let _ = q.emission_interval();
    let _ = q.burst_size();
    let Ok(p) = q.params("p") else {
        return;
    };
    assert!(p.emission_ns >= 1, "{q:?}: {p:?}");
    assert!(p.window() <= CENTURY, "{q:?}: {p:?}");
    assert_eq!(p.burst.get(), q.burst_size(), "{q:?}");
    match p.kind {
        QuotaKind::Gcra => assert_eq!(q.algorithm(), Algorithm::Gcra),
        QuotaKind::FixedWindow { window_us } => {
            assert_eq!(q.algorithm(), Algorithm::FixedWindow);
            assert_eq!(u128::from(window_us) * 1000, q.period().as_nanos(), "{q:?}");
        }
        QuotaKind::SlidingWindow { slice_us, slices } => {
            assert_eq!(q.algorithm(), Algorithm::SlidingWindow);
            assert!((1..=Quota::MAX_SUB_WINDOWS).contains(&slices), "{q:?}");
            assert_eq!(
                u128::from(slice_us) * u128::from(slices) * 1000,
                q.period().as_nanos(),
                "{q:?}"
            );
            // The sub-window is the resolution given, or the whole window.
            let slice = q.sub_window().unwrap_or(q.period());
            assert_eq!(
                u128::from(slice_us) * 1000,
                slice.as_nanos(),
                "{q:?}: {p:?}"
            );
        }
        QuotaKind::Concurrent { lease_ms } => {
            assert_eq!(q.algorithm(), Algorithm::Concurrent);
            assert_eq!(u128::from(lease_ms) * 1_000_000, q.period().as_nanos());
        }
        #[cfg(feature = "calendar")]
        QuotaKind::Calendar { calendar } => {
            assert_eq!(q.algorithm(), Algorithm::FixedWindow);
            assert_eq!(calendar.nominal(), q.period(), "{q:?}");
        }
    }
    // A valid quota is written as a string that parses back to it.
    let shown = q.to_string();
    match shown.parse::<Quota>() {
        Ok(back) => assert_eq!(unnamed(q), back, "{shown:?}"),
        Err(e) => panic!("valid quota {q:?} is written {shown:?}, which does not parse: {e}"),
    }
}

/// The quota without its name (`to_string` leaves the name out).
fn unnamed(q: &Quota) -> Quota {
    if q.algorithm() == Algorithm::Concurrent {
        return Quota::concurrent(q.count()).lease(q.period());
    }
    let mut out = Quota::new(q.count(), q.period());
    #[cfg(feature = "calendar")]
    if let Some(calendar) = q.calendar_period() {
        out = Quota::calendar(q.count(), calendar);
    }
    if q.counts_bytes() {
        out = out.bytes();
    }
    if let Some(block) = q.block() {
        out = out.block_for(block);
    }
    if q.burst_size() != q.count() || q.to_string().contains(" burst ") {
        out = out.burst(q.burst_size());
    }
    out = match q.algorithm() {
        Algorithm::FixedWindow => out.fixed_window(),
        Algorithm::SlidingWindow => out.sliding_window(),
        _ => out,
    };
    match q.sub_window() {
        Some(r) => out.resolution(r),
        None => out,
    }
}

/// Quota strings (`"5/min burst 10"`, `"100/min sliding 5s"`): whatever parses is written back
/// as a string that parses to the same quota (and is written the same), and its parameters
/// are within their bounds.
pub fn quota_str(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let Ok(q) = text.parse::<Quota>() else {
        return;
    };
    assert_eq!(q.name(), None);
    let shown = q.to_string();
    let back: Quota = shown
        .parse()
        .unwrap_or_else(|e| panic!("{text:?} parsed, but {shown:?} does not: {e}"));
    assert_eq!(back, q, "{text:?} -> {shown:?}");
    assert_eq!(back.to_string(), shown);
    check_quota(&q);
    let policy = Policy::new("p", q);
    assert_eq!(policy.validate().is_ok(), q.params("p").is_ok());
}

/// A calendar from any bytes: any period, anchor and time of day (in range or not), and a
/// zone among some with DST, odd offsets or a skipped day, UTC, and one that does not exist.
#[cfg(feature = "calendar")]
fn fuzz_calendar(b: &mut Bytes<'_>) -> crate::quota::Calendar {
    use crate::quota::{Calendar, Weekday};
    const ZONES: [&str; 6] = [
        "UTC",
        "America/New_York",
        "Asia/Kathmandu",
        "Australia/Lord_Howe",
        "Pacific/Apia",
        "Nowhere/Atlantis",
    ];
    let (kind, x, y) = (b.u8(), b.u8(), b.u8());
    let calendar = match kind % 4 {
        0 => Calendar::daily(),
        1 => Calendar::weekly_from(match x % 7 {
            0 => Weekday::Monday,
            1 => Weekday::Tuesday,
            2 => Weekday::Wednesday,
            3 => Weekday::Thursday,
            4 => Weekday::Friday,
            5 => Weekday::Saturday,
            _ => Weekday::Sunday,
        }),
        2 => Calendar::monthly_on(x),
        _ => Calendar::yearly_on(x, y),
    };
    let (h, m, sec) = (b.u8(), b.u8(), b.u8());
    let calendar = if kind & 4 != 0 {
        calendar.at_second(h, m, sec)
    } else {
        calendar.at(h % 24, m % 60)
    };
    calendar.in_zone(ZONES[usize::from(b.u8()) % ZONES.len()])
}

/// Quotas built in code from any numbers (count, period, burst, algorithm, resolution): their
/// parameters never overflow, valid ones are within bounds, agree with the quota, and are
/// written as strings that parse back to them.
pub fn quota_params(data: &[u8]) {
    let mut b = Bytes::new(data);
    let flags = b.u8();
    let duration = |b: &mut Bytes<'_>, flag: u8| match flag % 4 {
        0 => Duration::from_millis(u64::from(b.u32())),
        1 => Duration::from_micros(b.u64()),
        2 => Duration::from_nanos(b.u64()),
        _ => Duration::new(b.u64(), b.u32() % 1_000_000_000),
    };
    let count = match flags >> 6 {
        0 => u32::from(b.u8()),
        1 => u32::from(b.u16()),
        _ => b.u32(),
    };
    let period = duration(&mut b, flags);
    let mut q = Quota::new(count, period);
    if flags & 4 != 0 {
        q = q.burst(b.u32());
    }
    q = match (flags >> 3) & 3 {
        1 => q.fixed_window(),
        2 => q.sliding_window(),
        _ => q,
    };
    if flags & 32 != 0 {
        let tag = b.u8();
        q = q.resolution(duration(&mut b, tag));
    }
    // A calendar quota from any settings, valid or not (then a burst or a sliding window on
    // it, which `params` refuses).
    #[cfg(feature = "calendar")]
    if flags & 1 != 0 {
        let calendar = fuzz_calendar(&mut b);
        let (algorithm, burst) = (q.algorithm(), q.burst_size());
        q = Quota::calendar(count, calendar);
        if algorithm == crate::quota::Algorithm::SlidingWindow {
            q = q.sliding_window();
        }
        if flags & 4 != 0 {
            q = q.burst(burst);
        }
    }
    check_quota(&q);
    let policy = Policy::new("p", q);
    assert_eq!(policy.validate().is_ok(), q.params("p").is_ok());
}

// ---------------------------------------------------------------------------------------------
// Serde: quotas, policies and rule sets from TOML, YAML and JSON.

/// serde, for [`fuzz_formats!`](crate::fuzz_formats).
#[cfg(feature = "serde")]
pub use serde;

/// A configuration format.
#[cfg(feature = "serde")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// serde_json.
    Json,
    /// toml.
    Toml,
    /// serde_norway (YAML).
    Yaml,
}

#[cfg(feature = "serde")]
impl Format {
    /// The format a byte names.
    pub fn of(b: u8) -> Format {
        match b % 3 {
            0 => Format::Json,
            1 => Format::Toml,
            _ => Format::Yaml,
        }
    }
}

/// The configuration formats, from the crates that read them (see [`fuzz_formats!`]).
///
/// [`fuzz_formats!`]: crate::fuzz_formats
#[cfg(feature = "serde")]
pub trait Formats {
    /// `text` read as a `T` in `format`.
    fn read<T: serde::de::DeserializeOwned>(&self, format: Format, text: &str)
    -> Result<T, String>;
    /// `value` written in `format`.
    fn write<T: serde::Serialize>(&self, format: Format, value: &T) -> Result<String, String>;
}

/// Defines a unit struct `$name` implementing [`fuzz::Formats`](crate::fuzz::Formats) with
/// `serde_json`, `toml` and `serde_norway`, which the calling crate must depend on.
#[cfg(feature = "serde")]
#[macro_export]
#[doc(hidden)]
macro_rules! fuzz_formats {
    ($vis:vis $name:ident) => {
        /// TOML, YAML and JSON for the serde fuzz targets.
        $vis struct $name;

        impl $crate::fuzz::Formats for $name {
            fn read<T: $crate::fuzz::serde::de::DeserializeOwned>(
                &self,
                format: $crate::fuzz::Format,
                text: &str,
            ) -> Result<T, String> {
                match format {
                    $crate::fuzz::Format::Json => {
                        ::serde_json::from_str(text).map_err(|e| e.to_string())
                    }
                    $crate::fuzz::Format::Toml => ::toml::from_str(text).map_err(|e| e.to_string()),
                    $crate::fuzz::Format::Yaml => {
                        ::serde_norway::from_str(text).map_err(|e| e.to_string())
                    }
                }
            }

            fn write<T: $crate::fuzz::serde::Serialize>(
                &self,
                format: $crate::fuzz::Format,
                value: &T,
            ) -> Result<String, String> {
                match format {
                    $crate::fuzz::Format::Json => {
                        ::serde_json::to_string(value).map_err(|e| e.to_string())
                    }
                    $crate::fuzz::Format::Toml => {
                        ::toml::to_string(value).map_err(|e| e.to_string())
                    }
                    $crate::fuzz::Format::Yaml => {
                        ::serde_norway::to_string(value).map_err(|e| e.to_string())
                    }
                }
            }
        }
    };
}

/// A quota, or a list of them, in a document (TOML's top level is a table).
#[cfg(feature = "serde")]
#[derive(serde::Serialize, serde::Deserialize)]
struct QuotaDoc {
    quota: Quota,
    #[serde(default)]
    quotas: Vec<Quota>,
}

#[cfg(feature = "serde")]
fn same_policy(a: &Policy, b: &Policy) -> bool {
    let req = http::Request::new(());
    let info = RequestInfo::new(&req);
    a.name() == b.name()
        && a.quotas().len() == b.quotas().len()
        && a.quotas().iter().zip(b.quotas()).all(|(x, y)| x == y)
        && a.cost_of(&info) == b.cost_of(&info)
        && a.is_shadow() == b.is_shadow()
        && a.sends_shadow_headers() == b.sends_shadow_headers()
}

/// Whether a quota of these policies has a name too long to keep (`Policy::validate` refuses
/// it): such a quota is not written (an error), as written cut short it would read back valid.
#[cfg(feature = "serde")]
fn cut_names(policies: &[Policy]) -> bool {
    policies
        .iter()
        .any(|p| p.quotas().iter().any(Quota::name_too_long))
}

/// Quotas and policies from configuration files: a first byte names the format, the rest is
/// the text. What reads is checked as a quota (bounds, the string round trip), and written
/// back in the same format reads as the same value.
#[cfg(feature = "serde")]
pub fn quota_serde<F: Formats>(data: &[u8], formats: &F) {
    let Some((&b, text)) = data.split_first() else {
        return;
    };
    let format = Format::of(b);
    let text = String::from_utf8_lossy(text);
    let round_trip = |doc: &QuotaDoc| {
        let written = formats.write(format, doc);
        let cut = std::iter::once(&doc.quota)
            .chain(&doc.quotas)
            .any(Quota::name_too_long);
        if format == Format::Json {
            assert_eq!(written.is_ok(), !cut, "{written:?}");
        }
        let Ok(written) = written else {
            return;
        };
        let back: QuotaDoc = formats
            .read(format, &written)
            .unwrap_or_else(|e| panic!("{format:?}: {written:?} does not read back: {e}"));
        assert_eq!(back.quota, doc.quota, "{written:?}");
        assert_eq!(back.quotas, doc.quotas, "{written:?}");
    };
    if let Ok(q) = formats.read::<Quota>(format, &text) {
        check_quota(&q);
        round_trip(&QuotaDoc {
            quota: q,
            quotas: Vec::new(),
        });
    }
    if let Ok(doc) = formats.read::<QuotaDoc>(format, &text) {
        for q in std::iter::once(&doc.quota).chain(&doc.quotas) {
            check_quota(q);
        }
        round_trip(&doc);
    }
    if let Ok(policy) = formats.read::<Policy>(format, &text) {
        let valid = policy.validate();
        if valid.is_ok() {
            for q in policy.quotas() {
                check_quota(q);
            }
        }
        let written = formats.write(format, &policy);
        if format == Format::Json {
            let cut = cut_names(std::slice::from_ref(&policy));
            assert_eq!(written.is_ok(), !cut, "{written:?}");
        }
        if let Ok(written) = written {
            let back: Policy = formats
                .read(format, &written)
                .unwrap_or_else(|e| panic!("{format:?}: {written:?} does not read back: {e}"));
            assert!(same_policy(&back, &policy), "{written:?}");
            assert_eq!(back.validate().is_ok(), valid.is_ok(), "{written:?}");
        }
    }
}

/// Rule sets from configuration files: a first byte names the format, the rest is the text.
/// A rule set that validates compiles (and one that does not, does not); requests made to
/// match a rule get that rule's policy or one of a rule of at least its priority; and the set
/// written back in the same format reads as a set that validates alike and is written the same.
#[cfg(feature = "serde")]
pub fn rules<F: Formats>(data: &[u8], formats: &F) {
    use crate::rules::RuleSet;

    let Some((&b, text)) = data.split_first() else {
        return;
    };
    let format = Format::of(b);
    let text = String::from_utf8_lossy(text);
    let Ok(set) = formats.read::<RuleSet>(format, &text) else {
        return;
    };
    let valid = set.validate();
    let backend = crate::backend::LocalBackend::new();
    let compiled = crate::rules::compile(&backend, set.clone());
    assert_eq!(
        compiled.is_ok(),
        valid.is_ok(),
        "validate: {valid:?}, compile: {:?}",
        compiled.as_ref().err()
    );
    if let Ok(compiled) = &compiled {
        check_selection(&set, compiled, formats);
    }
    let written = formats.write(format, &set);
    if format == Format::Json {
        assert_eq!(written.is_ok(), !cut_names(set.policies()), "{written:?}");
    }
    if let Ok(written) = written {
        let back: RuleSet = formats
            .read(format, &written)
            .unwrap_or_else(|e| panic!("{format:?}: {written:?} does not read back: {e}"));
        assert_eq!(back.validate().is_ok(), valid.is_ok(), "{written:?}");
        assert_eq!(formats.write(format, &back), Ok(written));
    }
}

/// For each rule, a request that matches it: the policy chosen is its own or that of a rule
/// of at least its priority. Without rules, every request gets the default.
#[cfg(feature = "serde")]
fn check_selection<P, F: Formats>(
    set: &crate::rules::RuleSet,
    compiled: &crate::rules::Compiled<P>,
    formats: &F,
) {
    let chosen = |req: &http::Request<()>, key: Option<&Key>| -> String {
        let p = compiled.select(&RequestInfo::new(req), key);
        p.policy.name().to_owned()
    };
    for probe in ["/", "/login", "/api/x", "/loginfoo"] {
        let req = http::Request::get(probe).body(()).unwrap();
        let name = chosen(&req, None);
        assert!(set.policies().iter().any(|p| p.name() == name), "{name}");
        if set.rules().is_empty() {
            assert_eq!(name, set.default_policy());
        }
    }
    for (i, rule) in set.rules().iter().enumerate() {
        let Some((req, key)) = request_matching(set, i, formats) else {
            continue;
        };
        let name = chosen(&req, key.as_ref());
        let ok = set
            .rules()
            .iter()
            .any(|r| r.priority() >= rule.priority() && r.policy_name() == name);
        assert!(
            ok,
            "rule {i} {rule:?} matches {} {} key {key:?}, got `{name}`",
            req.method(),
            req.uri()
        );
    }
}

/// A rule's conditions, as it is written.
#[cfg(feature = "serde")]
#[derive(serde::Deserialize)]
struct RuleFields {
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    tier: Option<String>,
    #[serde(default)]
    path_prefix: Option<String>,
    #[serde(default)]
    methods: Vec<String>,
}

/// A request that rule `i` of `set` matches (and its key), when one can be made from the rule's
/// conditions.
#[cfg(feature = "serde")]
fn request_matching<F: Formats>(
    set: &crate::rules::RuleSet,
    i: usize,
    formats: &F,
) -> Option<(http::Request<()>, Option<Key>)> {
    // The rule's fields are private: written out, it shows its conditions.
    let written = formats.write(Format::Json, &set.rules()[i]).ok()?;
    let rule: RuleFields = formats.read(Format::Json, &written).ok()?;
    let mut b = http::Request::builder();
    if let Some(path) = &rule.path_prefix {
        b = b.uri(path.as_str());
    }
    if let Some(method) = rule.methods.first() {
        const STANDARD: [&str; 9] = [
            "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
        ];
        let upper = method.to_ascii_uppercase();
        let m = if STANDARD.contains(&upper.as_str()) {
            &upper
        } else {
            method
        };
        b = b.method(http::Method::from_bytes(m.as_bytes()).ok()?);
    }
    let tenant = match (&rule.tenant, &rule.tier) {
        (Some(t), None) => Some(t.clone()),
        (Some(t), Some(tier)) => (set.tiers().get(t) == Some(tier)).then(|| t.clone()),
        (None, Some(tier)) => Some(set.tiers().iter().find(|(_, v)| *v == tier)?.0.clone()),
        (None, None) => None,
    };
    let key = match tenant {
        Some(t) => Some(Key::from_bytes(t.as_bytes()).ok()?),
        None if rule.tier.is_some() || rule.tenant.is_some() => return None,
        None => None,
    };
    let req = b.body(()).ok()?;
    if rule
        .path_prefix
        .as_deref()
        .is_some_and(|p| req.uri().path() != p)
    {
        return None;
    }
    Some((req, key))
}

// ---------------------------------------------------------------------------------------------
// The outbound side: `Retry-After` and `grpc-retry-pushback-ms`.

/// The longest pause taken from an upstream's answer (`wait::MAX_PAUSE`).
const MAX_PAUSE: Duration = Duration::from_secs(3600);

/// How long an upstream answer asks to wait (`Retry-After` on a `429`/`503`, gRPC's
/// `grpc-retry-pushback-ms` with `grpc-status: 8`), and the pause it puts on a key.
///
/// Input: two bytes of status code, then `name: value` lines (`r`, `g` and `p` stand for
/// `retry-after`, `grpc-status` and `grpc-retry-pushback-ms`).
///
/// Checked: a wait only from the answers that carry one; a number of seconds is read exactly;
/// a pause is at most an hour.
pub fn upstream_wait(data: &[u8]) {
    let mut b = Bytes::new(data);
    let status = 100 + b.u16() % 900;
    let mut res = http::Response::new(());
    *res.status_mut() = http::StatusCode::from_u16(status).expect("100 to 999");
    for line in b.rest().split(|&c| c == b'\n') {
        let Some(colon) = line.iter().position(|&c| c == b':') else {
            continue;
        };
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        let name = match name {
            b"r" => http::header::RETRY_AFTER,
            b"g" => HeaderName::from_static("grpc-status"),
            b"p" => HeaderName::from_static("grpc-retry-pushback-ms"),
            other => match HeaderName::from_bytes(other) {
                Ok(n) => n,
                Err(_) => continue,
            },
        };
        if let Ok(value) = HeaderValue::from_bytes(value) {
            res.headers_mut().append(name, value);
        }
    }
    let wait = crate::wait::upstream_wait(&res);
    let h = res.headers();
    let limited = status == 429 || status == 503;
    let retry_after = h.get(http::header::RETRY_AFTER);
    let grpc = h.get("grpc-status").map(HeaderValue::as_bytes) == Some(b"8");
    if wait.is_some() {
        assert!(
            (limited && retry_after.is_some()) || grpc,
            "{res:?}: {wait:?}"
        );
    }
    if limited
        && let Some(secs) = retry_after
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|s| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit()))
            .and_then(|s| s.parse::<u64>().ok())
    {
        assert_eq!(wait, Some(Duration::from_secs(secs)));
    }
    let pauses = crate::wait::Pauses::default();
    let key = Key::global();
    pauses.note(&key, &res);
    let left = pauses.remaining(&key);
    assert!(left <= Some(MAX_PAUSE), "{left:?}");
    if wait.is_none() {
        assert_eq!(left, None);
    }
}

// ---------------------------------------------------------------------------------------------
// Store replies.

/// A policy of one to three valid quotas, of any algorithm, from fuzz bytes.
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "rls-client"
))]
fn fuzz_params(b: &mut Bytes<'_>) -> Vec<QuotaParams> {
    let n = 1 + usize::from(b.u8() % 3);
    let mut params = Vec::new();
    for _ in 0..n {
        let kind = b.u8();
        // Mostly small, sometimes any: most replies are read for ordinary quotas.
        let count = if kind & 4 == 0 {
            1 + u32::from(b.u8() % 100)
        } else {
            b.u32()
        };
        let period = if kind & 8 == 0 {
            Duration::from_millis(1 + u64::from(b.u16()))
        } else {
            Duration::from_micros(b.u64() % CENTURY.as_micros() as u64)
        };
        let q = Quota::new(count, period);
        let q = match kind % 3 {
            0 if kind & 16 != 0 => q.burst(b.u32() % 1000),
            0 => q,
            1 => q.fixed_window(),
            _ if kind & 16 != 0 => {
                let slices = 1 + u64::from(b.u8() % 20);
                q.sliding_window()
                    .resolution(Duration::from_micros(period.as_micros() as u64 / slices))
            }
            _ => q.sliding_window(),
        };
        if let Ok(p) = q.params("p") {
            params.push(p);
        }
    }
    params
}

#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "rls-client"
))]
fn fuzz_cost(b: &mut Bytes<'_>) -> NonZeroU32 {
    let c = match b.u8() {
        0..=200 => 1,
        201..=250 => u32::from(b.u8()),
        _ => b.u32(),
    };
    NonZeroU32::new(c).unwrap_or(NonZeroU32::MIN)
}

#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "rls-client"
))]
fn fuzz_mode(b: &mut Bytes<'_>) -> Mode {
    match b.u8() % 4 {
        0 | 1 => Mode::Decide,
        2 => Mode::Peek,
        _ => Mode::Reserve {
            max_wait: Duration::from_millis(u64::from(b.u32())),
        },
    }
}

/// The reply's integers: the rest of the input, each of the size its first byte names.
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "rls-client"
))]
fn fuzz_reply(b: &mut Bytes<'_>) -> Vec<i64> {
    let mut reply = Vec::new();
    while !b.is_empty() && reply.len() < 4096 {
        reply.push(b.int());
    }
    reply
}

/// What every decision read from a store must be, whatever the store replied: one state per
/// quota in order (or the one quota a request can never fit), each of its quota's limit, with
/// no more remaining than the limit, and its times within what the quota allows (the reply is
/// clamped: a window's times within the window and one more sub-window, a GCRA quota's next
/// unit within one emission interval).
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "rls-client"
))]
fn check_decision(d: &Decision, params: &[QuotaParams], cost: NonZeroU32, mode: Mode) {
    let states = d.quotas();
    assert!(!states.is_empty(), "{d:?}");
    if d.never_fits() {
        assert_eq!(states.len(), 1, "{d:?}");
    } else {
        assert_eq!(states.len(), params.len(), "{d:?}");
    }
    for (i, s) in states.iter().enumerate() {
        let p = params.get(s.index).expect("a quota of the policy");
        if !d.never_fits() {
            assert_eq!(s.index, i, "{d:?}");
        }
        assert_eq!(s.limit, p.burst.get(), "{d:?}");
        assert!(s.remaining <= s.limit, "{d:?}");
        let (next, longest) = match p.kind {
            QuotaKind::Gcra => (Duration::from_nanos(p.emission_ns), None),
            QuotaKind::FixedWindow { window_us } => {
                let w = Duration::from_micros(window_us);
                (w, Some(w))
            }
            QuotaKind::SlidingWindow { slice_us, slices } => {
                let w = Duration::from_micros(slice_us * (u64::from(slices) + 1));
                (w, Some(w))
            }
            QuotaKind::Concurrent { .. } => {
                let retry = crate::backend::window::IN_FLIGHT_RETRY;
                (retry, Some(retry))
            }
            #[cfg(feature = "calendar")]
            QuotaKind::Calendar { calendar } => {
                let w = Duration::from_micros(calendar.longest_us());
                (w, Some(w))
            }
        };
        assert!(s.reset_after <= next, "{s:?} of {p:?}");
        match (s.outcome, longest) {
            (Outcome::Denied { retry_after }, Some(longest)) => {
                assert!(retry_after <= longest, "{s:?} of {p:?}");
            }
            // A GCRA denial waits at most until the latest TAT a bucket can have (a full
            // bucket past the longest reservation, a day) lets the cost in.
            (Outcome::Denied { retry_after }, None) => {
                let units = p.burst.get().max(cost.get());
                let longest = Duration::from_nanos(p.emission_ns) * units + DAY;
                assert!(retry_after <= longest, "{s:?} of {p:?}");
            }
            _ => {}
        }
    }
    let _ = d.tightest();
    if d.is_allowed() {
        assert_eq!(d.retry_after(), None);
    } else {
        assert_eq!(d.wait(), Duration::ZERO, "{d:?}");
    }
    // A reservation never waits longer than the caller accepts (at most a day).
    match mode {
        Mode::Reserve { max_wait } => {
            assert!(d.wait() <= max_wait.min(DAY), "{d:?} for {max_wait:?}");
        }
        _ => assert_eq!(d.wait(), Duration::ZERO, "{d:?}"),
    }
}

/// The longest wait of a reservation (`backend::MAX_RESERVE`).
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "rls-client"
))]
const DAY: Duration = Duration::from_secs(86_400);

/// The Redis script's reply (`gcra.lua`: 2 to 4 integers per quota) read into a decision by
/// the backend's own `script::decision`, for any policy, cost, mode and integers.
///
/// Input: the policy's quotas, a cost and a mode (see [`Bytes`]), then the reply's integers.
#[cfg(feature = "redis")]
pub fn redis_reply(data: &[u8]) {
    let mut b = Bytes::new(data);
    let params = fuzz_params(&mut b);
    if params.is_empty() {
        return;
    }
    let cost = fuzz_cost(&mut b);
    let mode = fuzz_mode(&mut b);
    let reply = fuzz_reply(&mut b);
    let expected = script::reply_len(&params);
    match script::decision(&reply, &params, cost, mode, false) {
        Ok(d) => {
            assert_eq!(reply.len(), expected);
            check_decision(&d, &params, cost, mode);
        }
        Err(e) => assert_eq!(e.kind(), crate::BackendErrorKind::Protocol, "{e}"),
    }
    // The arguments of the same policy: one count, then four numbers per quota, in hex.
    let args = script::policy_args(&params, crate::quota::OnChange::Keep, None);
    assert_eq!(args.len(), 1 + script::PER_QUOTA * params.len());
}

/// A SQL store for the fuzz targets: prepares policies as PostgreSQL's and MySQL's stores do,
/// and is never called.
#[cfg(any(feature = "postgres", feature = "mysql"))]
struct FuzzSql;

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl crate::backend::remote::Store for FuzzSql {
    const KIND: &'static str = "fuzz";
    type Prepared = crate::backend::sql::Prepared;

    fn prepare(
        &self,
        policy: &Policy,
        params: &[QuotaParams],
    ) -> Result<Self::Prepared, crate::ConfigError> {
        Ok(crate::backend::sql::Prepared::new("tg", policy, params))
    }

    async fn call(
        &self,
        _jobs: &[crate::backend::remote::Job<Self>],
        _now_ns: Option<u64>,
    ) -> Result<Vec<Result<Decision, crate::BackendError>>, crate::backend::remote::CallError> {
        Err(crate::backend::remote::CallError::new(
            crate::backend::remote::StoreFailure::Connection,
            "the fuzz store is never called",
        ))
    }

    async fn ping(&self) -> Result<(), crate::backend::remote::CallError> {
        Err(crate::backend::remote::CallError::new(
            crate::backend::remote::StoreFailure::Connection,
            "the fuzz store is never called",
        ))
    }

    async fn announce(
        &self,
        _id: u64,
        _ttl: std::time::Duration,
    ) -> Result<u32, crate::backend::remote::CallError> {
        Err(crate::backend::remote::CallError::new(
            crate::backend::remote::StoreFailure::Connection,
            "the fuzz store is never called",
        ))
    }

    fn can_batch(&self) -> bool {
        true
    }

    fn calls_in_flight(&self) -> usize {
        1
    }

    fn warm_up_timeout(&self, timeout: Duration) -> Duration {
        timeout
    }
}

/// A SQL store's reply (the row of integers PostgreSQL's function and MySQL's procedure answer
/// a batch of decisions with) read into decisions by `backend::sql::decisions`, the code both
/// stores call, for a batch of one to four decisions on one or two policies.
///
/// Input: two policies' quotas, the number of decisions, each decision's policy, cost, mode and
/// key, then the reply's integers.
///
/// Checked: one answer per decision; once one fails the rest fail; each decision as in every
/// store (see `check_decision`); the call's arguments have one row key per quota of each
/// decision, no row key is longer than `sql::MAX_KEY`, and different keys have different rows.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub fn sql_reply(data: &[u8]) {
    use crate::backend::remote::{Job, Options, Remote, redact::Secrets};
    use crate::backend::sql;

    let mut b = Bytes::new(data);
    let remote = Remote::new(
        FuzzSql,
        "fuzz".to_owned(),
        Secrets::of([]),
        Options::default(),
    );
    let mut policies = Vec::new();
    for name in ["a", "b"] {
        let params = fuzz_params(&mut b);
        if params.is_empty() {
            return;
        }
        let q = Quota::per_second(1);
        let policy = Policy::new(name, q);
        let prepared = remote.prepare(&policy, &params).expect("valid parameters");
        policies.push(prepared);
    }
    let n = 1 + usize::from(b.u8() % 4);
    let now = tokio::time::Instant::now();
    let mut jobs = Vec::new();
    let mut of = Vec::new();
    for _ in 0..n {
        let which = usize::from(b.u8() & 1);
        of.push(which);
        let policy = &policies[which];
        let cost = fuzz_cost(&mut b);
        let mode = fuzz_mode(&mut b);
        let len = usize::from(b.u8());
        let key = match len {
            0 => Key::global(),
            1..=4 => Key::ip(IpAddr::from(b.u32().to_be_bytes())),
            _ => {
                let byte = b.u8();
                let part = Key::from_bytes(vec![byte; len]).expect("at most 255 bytes");
                // Up to four parts: keys longer than a row key holds are digested.
                let parts = 1 + usize::from(byte % 4);
                Key::composite(std::iter::repeat_n(&part, parts)).expect("at most four parts")
            }
        };
        jobs.push(Job {
            policy: policy.inner.clone(),
            key,
            cost,
            mode,
            sent_ns: 0,
            deadline: now,
        });
    }
    let reply = fuzz_reply(&mut b);

    let out = sql::decisions(&reply, &jobs);
    assert_eq!(out.len(), jobs.len());
    if let Some(first) = out.iter().position(Result::is_err) {
        assert!(out[first..].iter().all(Result::is_err), "{out:?}");
    }
    for (d, job) in out.iter().zip(&jobs) {
        match d {
            Ok(d) => check_decision(d, job.params(), job.cost, job.mode),
            Err(e) => assert_eq!(e.kind(), crate::BackendErrorKind::Protocol, "{e}"),
        }
    }

    let args = sql::Args::of(&jobs, Some(0));
    let rows: usize = jobs.iter().map(|j| j.params().len()).sum();
    assert_eq!(args.keys.len(), rows);
    assert_eq!(args.quotas.len(), 4 * rows);
    assert_eq!(args.decisions.len(), 4 * jobs.len());
    assert!(args.keys.iter().all(|k| k.len() <= sql::MAX_KEY));
    let mut at = 0;
    let mut owners: std::collections::HashMap<&[u8], (usize, usize, &Key)> = Default::default();
    for (job, &which) in jobs.iter().zip(&of) {
        let rows = &args.keys[at..at + job.params().len()];
        assert_eq!(rows, sql::row_keys(job.prepared(), &job.key).as_slice());
        for (q, row) in rows.iter().enumerate() {
            let me = (which, q, &job.key);
            if let Some(other) = owners.insert(row, me) {
                assert_eq!(other, me, "two buckets share the row {row:?}");
            }
        }
        at += job.params().len();
    }
}

#[cfg(test)]
mod tests {
    //! Every input kept for a target (its corpus and the regressions found) runs through it.

    use std::path::{Path, PathBuf};

    #[cfg(feature = "serde")]
    crate::fuzz_formats!(Serde);

    fn inputs(target: &str) -> Vec<PathBuf> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
        let mut files = Vec::new();
        for dir in ["corpus", "regressions"] {
            if let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) {
                files.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_file()));
            }
        }
        files.sort();
        files
    }

    /// Runs every kept input of `target` through `f`, naming the input that fails.
    fn replay(target: &str, f: impl Fn(&[u8])) {
        let files = inputs(target);
        for file in &files {
            let data = std::fs::read(file).unwrap();
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&data))).is_err() {
                panic!("fuzz input {} fails", file.display());
            }
        }
        assert!(!files.is_empty(), "no corpus for {target}");
    }

    #[test]
    fn key_extract() {
        replay("key_extract", super::key_extract);
    }

    #[test]
    fn quota_str() {
        replay("quota_str", super::quota_str);
    }

    #[test]
    fn quota_params() {
        replay("quota_params", super::quota_params);
    }

    /// Calendar quotas from any bytes and from strings of the calendar syntax's words in any
    /// order: never a panic, and whatever is valid round-trips (beyond the kept inputs).
    #[cfg(feature = "calendar")]
    mod calendar {
        use proptest::prelude::*;

        const WORDS: [&str; 16] = [
            "on",
            "at",
            "tz",
            "calendar",
            "fixed",
            "15",
            "31",
            "02-29",
            "sunday",
            "09:00",
            "25:61",
            "Europe/Berlin",
            "Asia/Kolkata",
            "Nowhere/Atlantis",
            "bytes",
            "block 1h",
        ];

        proptest! {
            #[test]
            fn any_settings(data in proptest::collection::vec(any::<u8>(), 0..48)) {
                let mut data = data;
                // The calendar flag set.
                data.insert(0, 1);
                super::super::quota_params(&data);
            }

            #[test]
            fn any_words(
                count in 0u32..5000,
                period in proptest::sample::select(vec!["day", "week", "month", "year"]),
                words in proptest::collection::vec(proptest::sample::select(WORDS.to_vec()), 0..6),
            ) {
                let text = format!("{count}/{period} {}", words.join(" "));
                super::super::quota_str(text.as_bytes());
            }
        }
    }

    #[test]
    fn upstream_wait() {
        replay("upstream_wait", super::upstream_wait);
    }

    #[cfg(feature = "serde")]
    #[test]
    fn quota_serde() {
        replay("quota_serde", |d| super::quota_serde(d, &Serde));
    }

    #[cfg(feature = "serde")]
    #[test]
    fn rules() {
        replay("rules", |d| super::rules(d, &Serde));
    }

    #[cfg(feature = "redis")]
    #[test]
    fn redis_reply() {
        replay("redis_reply", super::redis_reply);
    }

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[test]
    fn sql_reply() {
        replay("sql_reply", super::sql_reply);
    }
}
