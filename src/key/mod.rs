//! Keys: which bucket a request counts against.
//!
//! A [`KeyExtractor`] turns a request into a [`Key`]. tollgate ships extractors for the common
//! cases, and any closure `Fn(&RequestInfo<'_>) -> Option<Key>` is one too:
//!
//! | extractor | key |
//! |---|---|
//! | [`Global`] | one bucket for every request |
//! | [`PeerIp`] | the TCP peer's address (axum `ConnectInfo`, tonic `TcpConnectInfo`) |
//! | [`ClientIp`] | the client's address behind trusted proxies (the one header they set: `X-Forwarded-For`, `Forwarded` or `X-Real-IP`) |
//! | [`Header`] | a request header, e.g. an API key |
//! | [`Extension`] | a value an earlier layer put in the request extensions, e.g. a user id |
//! | `(A, B)` | both keys together (a composite) |
//! | [`a.or(b)`](KeyExtractorExt::or) | `a`'s key, or `b`'s when `a` has none |
//!
//! IPv6 addresses are grouped by prefix (a /64 by default) so that one host cannot rotate through
//! its addresses to get a fresh bucket for each.
//!
//! ```
//! use tollgate::key::{ClientIp, Header, KeyExtractor, KeyExtractorExt};
//! use tollgate::{Key, RequestInfo};
//!
//! // API key when present, else the client's IP.
//! let key = Header::new("x-api-key").or(ClientIp::new());
//!
//! let req = http::Request::get("/").header("x-api-key", "k-123").body(()).unwrap();
//! let got = key.extract(&RequestInfo::new(&req)).unwrap();
//! assert_eq!(got, Key::from_bytes("k-123").unwrap());
//!
//! // A closure is an extractor too.
//! let by_tenant = |req: &RequestInfo<'_>| {
//!     let tenant = req.uri().path().split('/').nth(1)?;
//!     Key::from_bytes(tenant).ok()
//! };
//! let req = http::Request::get("/acme/orders").body(()).unwrap();
//! assert_eq!(by_tenant.extract(&RequestInfo::new(&req)).unwrap(), Key::from_bytes("acme").unwrap());
//! ```

mod header;
pub(crate) mod ip;

use std::fmt;
use std::net::IpAddr;

pub use header::{Extension, Header, ToKey};
pub use ip::{ClientIp, ForwardedHeader, PeerIp};
pub(crate) use ip::{DEFAULT_V6_PREFIX, group};

use crate::RequestInfo;
use http::StatusCode;

/// What happens to a request from which no key can be extracted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnMissingKey {
    /// Answer with this status (gRPC: the closest gRPC code) and a body naming what is
    /// missing. The default is `400 Bad Request`.
    ///
    /// A request without a peer address ([`KeyError::NoPeerAddr`](crate::KeyError)) is not
    /// the client's fault but the server's setup: it gets `500` (gRPC `INTERNAL`) with a
    /// generic body whatever this status, and the explanation is logged once.
    Reject(StatusCode),
    /// Let the request through, unlimited and without rate-limit headers. This also lets
    /// through requests without a peer address (a server on a Unix socket keyed by IP), with
    /// the explanation logged once.
    Allow,
}

impl Default for OnMissingKey {
    fn default() -> Self {
        OnMissingKey::Reject(StatusCode::BAD_REQUEST)
    }
}

/// The identity a request is limited by: an IP address, bytes (a header value, a user id), a
/// composite of several, or the one global key.
///
/// Keys are bounded: byte keys longer than [`Key::MAX_LEN`] are refused with
/// [`KeyError::TooLong`], so a client cannot make the limiter store arbitrarily long strings.
/// IP keys and byte keys of up to 29 bytes are stored inline, without allocating.
///
/// # Key spaces
///
/// A key also records which branch of an [`or`](KeyExtractorExt::or) chain made it, so that
/// keys from different extractors never collide: with
/// `Extension::<String>::new().or(Header::new("x-api-key"))`, an anonymous request sending
/// `x-api-key: alice` counts against a bucket of its own, never against the bucket of the
/// authenticated user `alice`. Keys built with the constructors below belong to the first
/// space; tuples keep each part's space inside the composite.
#[derive(Clone, PartialEq, Eq)]
pub struct Key(Repr);

/// Every variant carries the key space (`src`: the `or` branch the key came from, 0 for the
/// first) inside itself, so that a key stays 32 bytes: the tag, the space, a length and 29
/// bytes.
#[derive(Clone, PartialEq, Eq)]
enum Repr {
    Global {
        src: u8,
    },
    Ip {
        src: u8,
        ip: IpAddr,
    },
    /// Byte keys of up to [`INLINE`] bytes, without an allocation (most API keys and ids).
    Short {
        src: u8,
        inline: Inline,
    },
    /// Longer byte keys. A key is `Short` exactly when it fits, so equal keys are equal
    /// variants and `Eq` and `Hash` hold.
    Bytes {
        src: u8,
        bytes: Box<[u8]>,
    },
    Composite {
        src: u8,
        bytes: Box<[u8]>,
    },
}

/// The longest byte key stored inline.
const INLINE: usize = 29;

/// Hashed as few words as the key's variant needs: its kind and space in one, then its bytes in
/// one write, not field by field as a derived `Hash` would (each key is hashed on every
/// request). Equal keys are equal variants with equal fields, so they hash alike.
impl std::hash::Hash for Key {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let head = |kind: u32, src: u8, len: usize| kind | u32::from(src) << 8 | (len as u32) << 16;
        match &self.0 {
            Repr::Global { src } => state.write_u32(head(0, *src, 0)),
            Repr::Ip {
                src,
                ip: IpAddr::V4(ip),
            } => state.write_u64(u64::from(head(1, *src, 0)) << 32 | u64::from(ip.to_bits())),
            Repr::Ip {
                src,
                ip: IpAddr::V6(ip),
            } => {
                state.write_u32(head(2, *src, 0));
                state.write_u128(ip.to_bits());
            }
            Repr::Short { src, inline } => {
                let bytes = inline.as_slice();
                state.write_u32(head(3, *src, bytes.len()));
                state.write(bytes);
            }
            Repr::Bytes { src, bytes } => {
                state.write_u32(head(4, *src, bytes.len()));
                state.write(bytes);
            }
            Repr::Composite { src, bytes } => {
                state.write_u32(head(5, *src, bytes.len()));
                state.write(bytes);
            }
        }
    }
}

#[derive(Clone, PartialEq, Eq)]
struct Inline {
    len: u8,
    bytes: [u8; INLINE],
}

impl Inline {
    fn as_slice(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

/// The most bytes one part of a composite takes in its encoding: the part's length prefix
/// (2), its space (2), its kind (1) and a byte key of [`Key::MAX_LEN`].
const PART_MAX: usize = 2 + 2 + 1 + Key::MAX_LEN;

impl Key {
    /// The longest byte key accepted, in bytes.
    pub const MAX_LEN: usize = 256;

    /// The most parts a composite key holds (the tuple extractors make up to four).
    pub const MAX_PARTS: usize = 4;

    /// The single key shared by every request.
    pub const fn global() -> Key {
        Key(Repr::Global { src: 0 })
    }

    /// A key for an IP address (IPv4-mapped IPv6 addresses are stored as IPv4).
    pub fn ip(ip: IpAddr) -> Key {
        Key(Repr::Ip {
            src: 0,
            ip: ip.to_canonical(),
        })
    }

    /// A key made of bytes; `Err` when longer than [`Key::MAX_LEN`] (see
    /// [`Header::hashed`] for long client-supplied values).
    pub fn from_bytes(bytes: impl AsRef<[u8]>) -> Result<Key, KeyError> {
        let bytes = bytes.as_ref();
        if bytes.len() > Self::MAX_LEN {
            return Err(KeyError::TooLong {
                len: bytes.len(),
                max: Self::MAX_LEN,
            });
        }
        if bytes.len() <= INLINE {
            let mut inline = Inline {
                len: bytes.len() as u8,
                bytes: [0; INLINE],
            };
            inline.bytes[..bytes.len()].copy_from_slice(bytes);
            return Ok(Key(Repr::Short { src: 0, inline }));
        }
        Ok(Key(Repr::Bytes {
            src: 0,
            bytes: bytes.into(),
        }))
    }

    /// A composite of several keys, as the tuple extractors build it. Two composites are equal
    /// only when all their parts are, in order; no composite equals a non-composite key.
    ///
    /// Any [`Key::MAX_PARTS`] valid keys make a valid composite; `Err` for more parts.
    pub fn composite<'a>(parts: impl IntoIterator<Item = &'a Key>) -> Result<Key, KeyError> {
        let mut out = Vec::new();
        let mut count = 0;
        for part in parts {
            count += 1;
            let start = out.len();
            out.extend_from_slice(&[0, 0]);
            part.encode(&mut out);
            // Length-prefix each part so that ("ab", "c") and ("a", "bc") differ.
            let len = (out.len() - start - 2) as u16;
            out[start..start + 2].copy_from_slice(&len.to_be_bytes());
        }
        if count > Self::MAX_PARTS || out.len() > Self::MAX_PARTS * PART_MAX {
            return Err(KeyError::TooLong {
                len: out.len(),
                max: Self::MAX_PARTS * PART_MAX,
            });
        }
        Ok(Key(Repr::Composite {
            src: 0,
            bytes: out.into(),
        }))
    }

    /// The bytes of a byte key (made by [`from_bytes`](Self::from_bytes) and the like);
    /// `None` for an IP, global or composite key.
    #[cfg_attr(not(feature = "rls-client"), allow(dead_code))]
    pub(crate) fn value_bytes(&self) -> Option<&[u8]> {
        match &self.0 {
            Repr::Short { inline, .. } => Some(inline.as_slice()),
            Repr::Bytes { bytes, .. } => Some(bytes),
            _ => None,
        }
    }

    /// The IP address, when this is an IP key.
    pub fn as_ip(&self) -> Option<IpAddr> {
        match self.0 {
            Repr::Ip { ip, .. } => Some(ip),
            _ => None,
        }
    }

    /// The key space: which branch of an `or` chain made this key (0 for the first, and for
    /// every key made by the constructors).
    pub fn space(&self) -> u8 {
        match self.0 {
            Repr::Global { src }
            | Repr::Ip { src, .. }
            | Repr::Short { src, .. }
            | Repr::Bytes { src, .. }
            | Repr::Composite { src, .. } => src,
        }
    }

    fn space_mut(&mut self) -> &mut u8 {
        match &mut self.0 {
            Repr::Global { src }
            | Repr::Ip { src, .. }
            | Repr::Short { src, .. }
            | Repr::Bytes { src, .. }
            | Repr::Composite { src, .. } => src,
        }
    }

    /// This key moved `by` spaces on, for the second branch of an `or` (saturating; `build()`
    /// refuses chains of more than 255 branches, so it never saturates in a layer).
    pub(crate) fn in_space_after(mut self, by: u8) -> Key {
        let src = self.space_mut();
        *src = src.saturating_add(by);
        self
    }

    /// Whether both keys hold the same value, whatever their key spaces (rules match tenants
    /// this way).
    pub fn same_value(&self, other: &Key) -> bool {
        match (&self.0, &other.0) {
            (Repr::Global { .. }, Repr::Global { .. }) => true,
            (Repr::Ip { ip: a, .. }, Repr::Ip { ip: b, .. }) => a == b,
            (Repr::Short { inline: a, .. }, Repr::Short { inline: b, .. }) => a == b,
            (Repr::Bytes { bytes: a, .. }, Repr::Bytes { bytes: b, .. })
            | (Repr::Composite { bytes: a, .. }, Repr::Composite { bytes: b, .. }) => a == b,
            _ => false,
        }
    }

    /// Appends an unambiguous binary encoding of the key to `out`: different keys always give
    /// different encodings. Backends that store keys elsewhere (Redis) use this.
    ///
    /// Keys of the first space encode as a kind byte (`g`, `4`, `6`, `b`, `c`) and the value;
    /// keys of another space are prefixed with `s` and the space's number.
    pub fn encode(&self, out: &mut Vec<u8>) {
        self.encode_into(out);
    }

    /// [`encode`](Self::encode) into any byte buffer.
    pub(crate) fn encode_into(&self, out: &mut impl Extend<u8>) {
        let src = self.space();
        if src != 0 {
            out.extend([b's', src]);
        }
        match &self.0 {
            Repr::Global { .. } => out.extend([b'g']),
            Repr::Ip {
                ip: IpAddr::V4(v4), ..
            } => {
                out.extend([b'4']);
                out.extend(v4.octets());
            }
            Repr::Ip {
                ip: IpAddr::V6(v6), ..
            } => {
                out.extend([b'6']);
                out.extend(v6.octets());
            }
            Repr::Short { inline, .. } => {
                out.extend([b'b']);
                out.extend(inline.as_slice().iter().copied());
            }
            Repr::Bytes { bytes, .. } => {
                out.extend([b'b']);
                out.extend(bytes.iter().copied());
            }
            Repr::Composite { bytes, .. } => {
                out.extend([b'c']);
                out.extend(bytes.iter().copied());
            }
        }
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({self})")
    }
}

/// Prints the key readably: `*` for the global key, the address for IP keys, and bytes with
/// anything but `[A-Za-z0-9._~@+=/-]` percent-escaped; a key of another space than the first
/// starts with `#<space>:`.
impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn escaped(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
            for &b in bytes {
                if b.is_ascii_alphanumeric() || b"._~@+=/-".contains(&b) {
                    write!(f, "{}", b as char)?;
                } else {
                    write!(f, "%{b:02X}")?;
                }
            }
            Ok(())
        }
        let src = self.space();
        if src != 0 {
            write!(f, "#{src}:")?;
        }
        match &self.0 {
            Repr::Global { .. } => f.write_str("*"),
            Repr::Ip { ip, .. } => write!(f, "{ip}"),
            Repr::Short { inline, .. } => escaped(f, inline.as_slice()),
            Repr::Bytes { bytes, .. } => escaped(f, bytes),
            Repr::Composite { bytes, .. } => {
                f.write_str("composite:")?;
                escaped(f, bytes)
            }
        }
    }
}

/// Why no key could be extracted from a request.
///
/// What the layer does then is set by
/// [`RateLimitLayerBuilder::on_missing_key`](crate::RateLimitLayerBuilder::on_missing_key).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The request lacks what the extractor reads (a header, an extension, ...).
    Missing(&'static str),
    /// The key material is longer than allowed.
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// No peer address in the request extensions: the server was not set up to record it.
    ///
    /// With axum, serve with
    /// `app.into_make_service_with_connect_info::<SocketAddr>()`. tonic's `Server` records it
    /// by itself over plain TCP; over TLS it records `TlsConnectInfo<TcpConnectInfo>`, which
    /// tollgate does not read (it exists only with tonic's TLS features): key such services
    /// with a closure that reads it, `.remote_addr()` of its `.get_ref()`.
    NoPeerAddr,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Missing(what) => write!(f, "no rate-limit key: missing {what}"),
            KeyError::TooLong { len, max } => {
                write!(
                    f,
                    "rate-limit key is {len} bytes, more than the {max} allowed"
                )
            }
            KeyError::NoPeerAddr => f.write_str(
                "no peer address in the request: serve axum with \
                 `into_make_service_with_connect_info::<SocketAddr>()`",
            ),
        }
    }
}

impl std::error::Error for KeyError {}

/// Turns a request into the [`Key`] it is limited by.
///
/// Implement this for custom strategies, or pass a closure
/// `Fn(&RequestInfo<'_>) -> Option<Key>`. Extraction must be cheap and must not panic on any
/// input: it runs on every request.
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key for `req`, or why there is none.
    fn extract(&self, req: &RequestInfo<'_>) -> Result<Key, KeyError>;

    /// Checks the extractor's configuration; called once by `build()`.
    fn validate(&self) -> Result<(), crate::ConfigError> {
        Ok(())
    }

    /// How many key spaces this extractor's keys come from: 1, or for an
    /// [`or`](KeyExtractorExt::or) chain the sum over its branches. Keys from branch `i` carry
    /// [`Key::space`] `i`, so that they never equal a key of another branch.
    ///
    /// An extractor that returns keys of several spaces (one wrapping an `or` chain) must
    /// return their count here; the default, 1, is right for every other extractor.
    fn key_spaces(&self) -> usize {
        1
    }
}

impl<F> KeyExtractor for F
where
    F: Fn(&RequestInfo<'_>) -> Option<Key> + Send + Sync + 'static,
{
    fn extract(&self, req: &RequestInfo<'_>) -> Result<Key, KeyError> {
        self(req).ok_or(KeyError::Missing(
            "key (the custom extractor returned None)",
        ))
    }
}

/// Combinators for every [`KeyExtractor`].
pub trait KeyExtractorExt: KeyExtractor + Sized {
    /// This extractor's key, or `other`'s when the request lacks what this one reads
    /// ([`KeyError::Missing`]): a fallback chain.
    ///
    /// The two never share buckets: `other`'s keys are in key spaces of their own (see
    /// [`Key`]), so a client cannot send in `other`'s input the value this extractor gives
    /// someone else. Other errors do not fall back: a key that is too long, or a server that
    /// records no peer address, is reported as it is rather than hidden behind the fallback.
    ///
    /// ```
    /// use tollgate::key::{Extension, Header, KeyExtractor, KeyExtractorExt};
    /// use tollgate::RequestInfo;
    ///
    /// let key = Extension::<String>::new().or(Header::new("x-api-key"));
    /// let mut user = http::Request::get("/").body(()).unwrap();
    /// user.extensions_mut().insert("alice".to_owned());
    /// let anonymous = http::Request::get("/").header("x-api-key", "alice").body(()).unwrap();
    /// let a = key.extract(&RequestInfo::new(&user)).unwrap();
    /// let b = key.extract(&RequestInfo::new(&anonymous)).unwrap();
    /// assert_ne!(a, b, "separate buckets");
    /// assert!(a.same_value(&b));
    /// ```
    fn or<O: KeyExtractor>(self, other: O) -> Or<Self, O> {
        Or {
            offset: self.key_spaces(),
            first: self,
            second: other,
        }
    }
}

impl<K: KeyExtractor> KeyExtractorExt for K {}

/// A fallback chain: see [`KeyExtractorExt::or`].
#[derive(Debug, Clone)]
pub struct Or<A, B> {
    first: A,
    second: B,
    /// `first.key_spaces()`: where `second`'s key spaces start.
    offset: usize,
}

impl<A: KeyExtractor, B: KeyExtractor> KeyExtractor for Or<A, B> {
    fn extract(&self, req: &RequestInfo<'_>) -> Result<Key, KeyError> {
        match self.first.extract(req) {
            Err(KeyError::Missing(_)) => {
                let by = u8::try_from(self.offset).unwrap_or(u8::MAX);
                Ok(self.second.extract(req)?.in_space_after(by))
            }
            other => other,
        }
    }

    fn validate(&self) -> Result<(), crate::ConfigError> {
        self.first.validate()?;
        self.second.validate()?;
        if self.key_spaces() > usize::from(u8::MAX) + 1 {
            return Err(crate::ConfigError::Invalid {
                option: "key",
                reason: format!(
                    "an `or` chain of {} extractors; at most 256 are supported",
                    self.key_spaces()
                ),
            });
        }
        Ok(())
    }

    fn key_spaces(&self) -> usize {
        self.offset.saturating_add(self.second.key_spaces())
    }
}

/// One bucket for all requests.
#[derive(Debug, Clone, Copy, Default)]
pub struct Global;

impl KeyExtractor for Global {
    fn extract(&self, _req: &RequestInfo<'_>) -> Result<Key, KeyError> {
        Ok(Key::global())
    }
}

macro_rules! tuple_extractor {
    ($($name:ident),+) => {
        impl<$($name: KeyExtractor),+> KeyExtractor for ($($name,)+) {
            #[allow(non_snake_case)]
            fn extract(&self, req: &RequestInfo<'_>) -> Result<Key, KeyError> {
                let ($($name,)+) = self;
                $(let $name = $name.extract(req)?;)+
                Key::composite([$(&$name),+])
            }

            #[allow(non_snake_case)]
            fn validate(&self) -> Result<(), crate::ConfigError> {
                let ($($name,)+) = self;
                $($name.validate()?;)+
                Ok(())
            }
        }
    };
}

tuple_extractor!(A, B);
tuple_extractor!(A, B, C);
tuple_extractor!(A, B, C, D);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn composites_are_unambiguous() {
        let ab_c = Key::composite([
            &Key::from_bytes("ab").unwrap(),
            &Key::from_bytes("c").unwrap(),
        ]);
        let a_bc = Key::composite([
            &Key::from_bytes("a").unwrap(),
            &Key::from_bytes("bc").unwrap(),
        ]);
        assert_ne!(ab_c, a_bc);
        assert_ne!(ab_c.unwrap(), Key::from_bytes("abc").unwrap());
    }

    #[test]
    fn short_and_long_byte_keys_behave_alike() {
        let short = Key::from_bytes("k".repeat(INLINE)).unwrap();
        let long = Key::from_bytes("k".repeat(INLINE + 1)).unwrap();
        assert_ne!(short, long);
        assert_eq!(short, Key::from_bytes("k".repeat(INLINE)).unwrap());
        let (mut a, mut b) = (Vec::new(), Vec::new());
        short.encode(&mut a);
        long.encode(&mut b);
        assert_eq!(a.len() + 1, b.len());
        assert_eq!(&b[..a.len()], &a[..]);
        assert_eq!(short.to_string(), "k".repeat(INLINE));
    }

    #[test]
    fn long_keys_are_refused() {
        assert!(Key::from_bytes(vec![b'x'; Key::MAX_LEN]).is_ok());
        assert_eq!(
            Key::from_bytes(vec![b'x'; Key::MAX_LEN + 1]),
            Err(KeyError::TooLong {
                len: Key::MAX_LEN + 1,
                max: Key::MAX_LEN
            })
        );
    }

    #[test]
    fn keys_stay_small() {
        assert!(std::mem::size_of::<Key>() <= 32);
    }

    fn req_with(ext: Option<&str>, header: Option<&str>) -> http::Request<()> {
        let mut b = http::Request::get("/");
        if let Some(h) = header {
            b = b.header("x-api-key", h);
        }
        let mut req = b.body(()).unwrap();
        if let Some(e) = ext {
            req.extensions_mut().insert(e.to_owned());
        }
        req
    }

    #[test]
    fn or_branches_never_share_a_key_space() {
        use super::header::{Extension, Header};
        let chain = Extension::<String>::new().or(Header::new("x-api-key"));
        let user = chain.extract(&RequestInfo::new(&req_with(Some("alice"), None)));
        let anon = chain.extract(&RequestInfo::new(&req_with(None, Some("alice"))));
        let (user, anon) = (user.unwrap(), anon.unwrap());
        assert_ne!(user, anon);
        assert!(user.same_value(&anon));
        assert_eq!((user.space(), anon.space()), (0, 1));
        let (mut a, mut b) = (Vec::new(), Vec::new());
        user.encode(&mut a);
        anon.encode(&mut b);
        assert_ne!(a, b, "Redis keys differ too");
        assert_eq!(anon.to_string(), "#1:alice");
    }

    #[test]
    fn every_branch_of_a_chain_has_its_own_space() {
        use super::header::Header;
        let h = |n: &str| Header::new(n);
        // Left- and right-nested chains of three: spaces 0, 1, 2 in order.
        let left = h("a").or(h("b")).or(h("c"));
        let right = h("a").or(h("b").or(h("c")));
        assert_eq!(left.key_spaces(), 3);
        assert_eq!(right.key_spaces(), 3);
        for (name, space) in [("a", 0), ("b", 1), ("c", 2)] {
            let req = http::Request::get("/").header(name, "v").body(()).unwrap();
            let info = RequestInfo::new(&req);
            assert_eq!(left.extract(&info).unwrap().space(), space, "{name}");
            assert_eq!(right.extract(&info).unwrap().space(), space, "{name}");
        }
        // Tuples keep each part's space inside the composite.
        let pair = (h("a").or(h("b")), Global);
        let ra = http::Request::get("/").header("a", "v").body(()).unwrap();
        let rb = http::Request::get("/").header("b", "v").body(()).unwrap();
        assert_ne!(
            pair.extract(&RequestInfo::new(&ra)).unwrap(),
            pair.extract(&RequestInfo::new(&rb)).unwrap()
        );
    }

    #[test]
    fn or_falls_back_only_when_the_input_is_missing() {
        use super::header::Header;
        let chain = Header::new("authorization").or(Global);
        let long = "x".repeat(Key::MAX_LEN + 1);
        let req = http::Request::get("/")
            .header("authorization", &long)
            .body(())
            .unwrap();
        assert!(matches!(
            chain.extract(&RequestInfo::new(&req)),
            Err(KeyError::TooLong { .. })
        ));
        let none = http::Request::get("/").body(()).unwrap();
        assert_eq!(chain.extract(&RequestInfo::new(&none)).unwrap().space(), 1);
    }

    #[test]
    fn four_parts_of_the_longest_keys_make_a_composite() {
        let part = Key::from_bytes(vec![b'x'; Key::MAX_LEN]).unwrap();
        let ip = Key::ip("2001:db8::1".parse().unwrap());
        assert!(Key::composite([&part, &part, &part, &part]).is_ok());
        assert!(Key::composite([&ip, &part, &part, &part]).is_ok());
        let spaced = part.clone().in_space_after(200);
        assert!(Key::composite([&spaced, &spaced, &spaced, &spaced]).is_ok());
        assert!(Key::composite([&part, &part, &part, &part, &part]).is_err());
    }

    #[test]
    fn hashed_header_keys_are_fixed_size_and_keyed() {
        use super::header::Header;
        let token = format!("Bearer {}", "t".repeat(840));
        let req = http::Request::get("/")
            .header("authorization", &token)
            .body(())
            .unwrap();
        let info = RequestInfo::new(&req);
        let a = Header::new("authorization").hashed([1; 16]).extract(&info);
        let b = Header::new("authorization").hashed([2; 16]).extract(&info);
        let (a, b) = (a.unwrap(), b.unwrap());
        let mut enc = Vec::new();
        a.encode(&mut enc);
        assert_eq!(enc.len(), 1 + 16);
        assert_ne!(a, b, "another secret, another key");
        assert!(!a.to_string().contains("tttt"));
        let other = http::Request::get("/")
            .header("authorization", format!("Bearer {}", "u".repeat(840)))
            .body(())
            .unwrap();
        let c = Header::new("authorization").hashed([1; 16]);
        assert_ne!(c.extract(&RequestInfo::new(&other)).unwrap(), a);
        assert!(!format!("{c:?}").contains("[1"), "the secret is not shown");
    }

    #[test]
    fn display_escapes() {
        assert_eq!(
            Key::from_bytes("a b{c}").unwrap().to_string(),
            "a%20b%7Bc%7D"
        );
        assert_eq!(Key::global().to_string(), "*");
    }
}
