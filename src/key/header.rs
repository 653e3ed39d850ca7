use std::marker::PhantomData;
use std::net::IpAddr;

use http::HeaderName;
use siphasher::sip128::SipHasher24;

use super::{Key, KeyError, KeyExtractor};
use crate::RequestInfo;

/// Keys requests by the value of a header, such as an API key.
///
/// A request without the header (or with an empty value) has no key
/// ([`KeyError::Missing`]); combine with [`or`](super::KeyExtractorExt::or) to fall back. A
/// value longer than [`Key::MAX_LEN`] is refused ([`KeyError::TooLong`], no fallback): for
/// long values, such as bearer tokens, key by their [`hashed`](Header::hashed) value. The
/// value is used as it is: validate API keys in an earlier layer if unknown keys must not get a
/// bucket of their own.
///
/// ```
/// use tollgate::key::{Header, KeyExtractor};
/// use tollgate::{Key, RequestInfo};
///
/// let key = Header::new("x-api-key");
/// let req = http::Request::get("/").header("x-api-key", "abc").body(()).unwrap();
/// assert_eq!(key.extract(&RequestInfo::new(&req)), Key::from_bytes("abc"));
/// ```
#[derive(Clone)]
pub struct Header {
    name: Result<HeaderName, String>,
    hash: Option<SipHasher24>,
}

impl std::fmt::Debug for Header {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The hash secret is never shown.
        f.debug_struct("Header")
            .field("name", &self.name)
            .field("hashed", &self.hash.is_some())
            .finish()
    }
}

impl Header {
    /// Keys by header `name` (case-insensitive). An invalid name is reported by `build()`.
    pub fn new(name: &str) -> Self {
        Header {
            name: HeaderName::try_from(name)
                .map_err(|e| format!("{name:?} is not a valid header name: {e}")),
            hash: None,
        }
    }

    /// Keys by a keyed hash of the value instead of the value itself: a 16-byte key, whatever
    /// the value's length, for long client-supplied values (an `Authorization` bearer token, a
    /// signed session cookie) that would be refused as longer than [`Key::MAX_LEN`].
    ///
    /// The hash is SipHash-2-4 with a 128-bit output, keyed with `secret`. Every value is
    /// hashed (short ones too), so one value always gets one key; without the secret nobody
    /// can choose values that collide, and the keys stored (in Redis, in logs) do not reveal
    /// the values. Two different values share a bucket only by a 128-bit hash collision.
    ///
    /// Replicas that share a store (Redis) must use the same secret, or each would count a
    /// client in a bucket of its own; with the local backend a secret made at start-up will
    /// do. Changing the secret starts every client with a fresh bucket.
    ///
    /// ```
    /// use tollgate::key::{Header, KeyExtractor};
    /// use tollgate::{Key, RequestInfo};
    ///
    /// let secret = *b"sixteen byte key"; // from your configuration, the same on every replica
    /// let key = Header::new("authorization").hashed(secret);
    /// let token = format!("Bearer {}", "x".repeat(840));
    /// let req = http::Request::get("/").header("authorization", &token).body(()).unwrap();
    /// let got = key.extract(&RequestInfo::new(&req)).unwrap();
    /// assert_eq!(got, key.extract(&RequestInfo::new(&req)).unwrap());
    /// assert!(Header::new("authorization").extract(&RequestInfo::new(&req)).is_err());
    /// ```
    pub fn hashed(mut self, secret: [u8; 16]) -> Self {
        self.hash = Some(SipHasher24::new_with_key(&secret));
        self
    }
}

impl KeyExtractor for Header {
    fn extract(&self, req: &RequestInfo<'_>) -> Result<Key, KeyError> {
        let Ok(name) = &self.name else {
            return Err(KeyError::Missing("header (invalid header name)"));
        };
        match req.headers().get(name) {
            Some(v) if !v.is_empty() => match &self.hash {
                None => Key::from_bytes(v.as_bytes()),
                Some(hasher) => {
                    Key::from_bytes(u128::from(hasher.hash(v.as_bytes())).to_be_bytes())
                }
            },
            _ => Err(KeyError::Missing("header")),
        }
    }

    fn validate(&self) -> Result<(), crate::ConfigError> {
        match &self.name {
            Ok(_) => Ok(()),
            Err(reason) => Err(crate::ConfigError::Invalid {
                option: "key::Header",
                reason: reason.clone(),
            }),
        }
    }
}

/// Values that can be turned into a [`Key`], for [`Extension`].
///
/// Implement it for your own user-id type.
pub trait ToKey {
    /// The key for this value.
    fn to_key(&self) -> Result<Key, KeyError>;
}

impl ToKey for Key {
    fn to_key(&self) -> Result<Key, KeyError> {
        Ok(self.clone())
    }
}

impl ToKey for String {
    fn to_key(&self) -> Result<Key, KeyError> {
        Key::from_bytes(self)
    }
}

impl ToKey for &'static str {
    fn to_key(&self) -> Result<Key, KeyError> {
        Key::from_bytes(self)
    }
}

impl ToKey for IpAddr {
    fn to_key(&self) -> Result<Key, KeyError> {
        Ok(Key::ip(*self))
    }
}

macro_rules! int_to_key {
    ($($t:ty),*) => {$(
        impl ToKey for $t {
            fn to_key(&self) -> Result<Key, KeyError> {
                Key::from_bytes(self.to_be_bytes())
            }
        }
    )*};
}
int_to_key!(u32, u64, u128, i32, i64);

/// Keys requests by a value of type `T` that an earlier layer (typically authentication) put in
/// the request extensions, such as a user id.
///
/// ```
/// use tollgate::key::{Extension, KeyExtractor, ToKey};
/// use tollgate::{Key, KeyError, RequestInfo};
///
/// #[derive(Clone)]
/// struct UserId(u64);
/// impl ToKey for UserId {
///     fn to_key(&self) -> Result<Key, KeyError> {
///         self.0.to_key()
///     }
/// }
///
/// let mut req = http::Request::get("/").body(()).unwrap();
/// req.extensions_mut().insert(UserId(42));
/// let key = Extension::<UserId>::new();
/// assert_eq!(key.extract(&RequestInfo::new(&req)), 42u64.to_key());
/// ```
pub struct Extension<T> {
    _t: PhantomData<fn() -> T>,
}

impl<T> Extension<T> {
    /// Keys by the extension of type `T`.
    pub fn new() -> Self {
        Extension { _t: PhantomData }
    }
}

impl<T> Default for Extension<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for Extension<T> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<T> std::fmt::Debug for Extension<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Extension<{}>", std::any::type_name::<T>())
    }
}

impl<T: ToKey + Send + Sync + 'static> KeyExtractor for Extension<T> {
    fn extract(&self, req: &RequestInfo<'_>) -> Result<Key, KeyError> {
        req.extensions()
            .get::<T>()
            .ok_or(KeyError::Missing("request extension"))?
            .to_key()
    }
}
