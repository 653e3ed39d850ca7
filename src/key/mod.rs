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
mod ip;

use std::fmt;
use std::net::IpAddr;

pub use header::{Extension, Header, ToKey};
pub use ip::{ClientIp, ForwardedHeader, PeerIp};
pub(crate) use ip::{DEFAULT_V6_PREFIX, group};

use crate::RequestInfo;

/// The identity a request is limited by: an IP address, bytes (a header value, a user id), a
/// composite of several, or the one global key.
///
/// Keys are bounded: byte keys longer than [`Key::MAX_LEN`] are refused with
/// [`KeyError::TooLong`], so a client cannot make the limiter store arbitrarily long strings.
/// IP keys and byte keys of up to 30 bytes are stored inline, without allocating.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Key(Repr);

#[derive(Clone, PartialEq, Eq, Hash)]
enum Repr {
    Global,
    Ip(IpAddr),
    /// Byte keys of up to [`INLINE`] bytes, without an allocation (most API keys and ids).
    Short(Inline),
    /// Longer byte keys. A key is `Short` exactly when it fits, so equal keys are equal
    /// variants and the derived `Eq` and `Hash` hold.
    Bytes(Box<[u8]>),
    Composite(Box<[u8]>),
}

/// The longest byte key stored inline.
const INLINE: usize = 30;

#[derive(Clone, PartialEq, Eq, Hash)]
struct Inline {
    len: u8,
    bytes: [u8; INLINE],
}

impl Inline {
    fn as_slice(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl Key {
    /// The longest byte key accepted, in bytes.
    pub const MAX_LEN: usize = 256;

    /// The single key shared by every request.
    pub const fn global() -> Key {
        Key(Repr::Global)
    }

    /// A key for an IP address (IPv4-mapped IPv6 addresses are stored as IPv4).
    pub fn ip(ip: IpAddr) -> Key {
        Key(Repr::Ip(ip.to_canonical()))
    }

    /// A key made of bytes; `Err` when longer than [`Key::MAX_LEN`].
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
            return Ok(Key(Repr::Short(inline)));
        }
        Ok(Key(Repr::Bytes(bytes.into())))
    }

    /// A composite of several keys, as the tuple extractors build it. Two composites are equal
    /// only when all their parts are, in order; no composite equals a non-composite key.
    pub fn composite<'a>(parts: impl IntoIterator<Item = &'a Key>) -> Result<Key, KeyError> {
        let mut out = Vec::new();
        for part in parts {
            let mut enc = Vec::new();
            part.encode(&mut enc);
            // Length-prefix each part so that ("ab", "c") and ("a", "bc") differ.
            out.extend_from_slice(&(enc.len() as u16).to_be_bytes());
            out.extend_from_slice(&enc);
        }
        if out.len() > 4 * Self::MAX_LEN {
            return Err(KeyError::TooLong {
                len: out.len(),
                max: 4 * Self::MAX_LEN,
            });
        }
        Ok(Key(Repr::Composite(out.into())))
    }

    /// The IP address, when this is an IP key.
    pub fn as_ip(&self) -> Option<IpAddr> {
        match self.0 {
            Repr::Ip(ip) => Some(ip),
            _ => None,
        }
    }

    /// Appends an unambiguous binary encoding of the key to `out`: different keys always give
    /// different encodings. Backends that store keys elsewhere (Redis) use this.
    pub fn encode(&self, out: &mut Vec<u8>) {
        self.encode_into(out);
    }

    /// [`encode`](Self::encode) into any byte buffer.
    pub(crate) fn encode_into(&self, out: &mut impl Extend<u8>) {
        match &self.0 {
            Repr::Global => out.extend([b'g']),
            Repr::Ip(IpAddr::V4(v4)) => {
                out.extend([b'4']);
                out.extend(v4.octets());
            }
            Repr::Ip(IpAddr::V6(v6)) => {
                out.extend([b'6']);
                out.extend(v6.octets());
            }
            Repr::Short(b) => {
                out.extend([b'b']);
                out.extend(b.as_slice().iter().copied());
            }
            Repr::Bytes(b) => {
                out.extend([b'b']);
                out.extend(b.iter().copied());
            }
            Repr::Composite(b) => {
                out.extend([b'c']);
                out.extend(b.iter().copied());
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
/// anything but `[A-Za-z0-9._~@+=/-]` percent-escaped.
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
        match &self.0 {
            Repr::Global => f.write_str("*"),
            Repr::Ip(ip) => write!(f, "{ip}"),
            Repr::Short(b) => escaped(f, b.as_slice()),
            Repr::Bytes(b) => escaped(f, b),
            Repr::Composite(b) => {
                f.write_str("composite:")?;
                escaped(f, b)
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
    /// This extractor's key, or `other`'s when this one has none (a fallback chain).
    fn or<O: KeyExtractor>(self, other: O) -> Or<Self, O> {
        Or {
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
}

impl<A: KeyExtractor, B: KeyExtractor> KeyExtractor for Or<A, B> {
    fn extract(&self, req: &RequestInfo<'_>) -> Result<Key, KeyError> {
        match self.first.extract(req) {
            Ok(key) => Ok(key),
            Err(_) => self.second.extract(req),
        }
    }

    fn validate(&self) -> Result<(), crate::ConfigError> {
        self.first.validate()?;
        self.second.validate()
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
    fn display_escapes() {
        assert_eq!(
            Key::from_bytes("a b{c}").unwrap().to_string(),
            "a%20b%7Bc%7D"
        );
        assert_eq!(Key::global().to_string(), "*");
    }
}
