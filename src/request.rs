//! A borrowed view of a request's head, given to key extractors, cost functions and rules.

use http::{Extensions, HeaderMap, Method, Request, Uri};

/// The head of a request (method, URI, headers, extensions), borrowed.
///
/// Key extractors, cost functions and rule predicates receive this instead of
/// `&Request<B>`, so they are not generic over the body type and a closure can be written once
/// for axum and tonic alike. Building one is free: it holds four references.
///
/// ```
/// use tollgate::RequestInfo;
///
/// let req = http::Request::get("/api/items?page=2").body(()).unwrap();
/// let info = RequestInfo::new(&req);
/// assert_eq!(info.uri().path(), "/api/items");
/// ```
#[derive(Debug, Clone, Copy)]
pub struct RequestInfo<'a> {
    method: &'a Method,
    uri: &'a Uri,
    headers: &'a HeaderMap,
    extensions: &'a Extensions,
}

impl<'a> RequestInfo<'a> {
    /// Borrows the head of `req`.
    pub fn new<B>(req: &'a Request<B>) -> Self {
        RequestInfo {
            method: req.method(),
            uri: req.uri(),
            headers: req.headers(),
            extensions: req.extensions(),
        }
    }

    /// Builds a view from its parts (useful in tests and custom services).
    pub fn from_parts(parts: &'a http::request::Parts) -> Self {
        RequestInfo {
            method: &parts.method,
            uri: &parts.uri,
            headers: &parts.headers,
            extensions: &parts.extensions,
        }
    }

    /// The request method.
    pub fn method(&self) -> &'a Method {
        self.method
    }

    /// The request URI.
    pub fn uri(&self) -> &'a Uri {
        self.uri
    }

    /// The request headers.
    pub fn headers(&self) -> &'a HeaderMap {
        self.headers
    }

    /// The request extensions (connect info, values set by earlier layers).
    pub fn extensions(&self) -> &'a Extensions {
        self.extensions
    }

    /// The request's `Content-Length`: its body's size in bytes, when it states one (a chunked
    /// HTTP/1.1 body, or an HTTP/2 request without the header, does not). A value that is not a
    /// decimal number, or several values, are `None`.
    pub fn content_length(&self) -> Option<u64> {
        let mut values = self.headers.get_all(http::header::CONTENT_LENGTH).iter();
        let value = values.next()?;
        if values.next().is_some() {
            return None;
        }
        let text = value.to_str().ok()?.trim();
        // `u64::from_str` takes a leading `+`, which the field's grammar does not.
        if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        text.parse().ok()
    }

    /// Whether this is a gRPC request (`content-type: application/grpc*`, gRPC-web
    /// included).
    pub fn is_grpc(&self) -> bool {
        grpc_content_type(self.headers).is_some()
    }
}

/// The request's `content-type` when it is a gRPC flavour (`application/grpc`,
/// `application/grpc+proto`, `application/grpc-web+proto`, ...): rejections answer in it.
pub(crate) fn grpc_content_type(headers: &HeaderMap) -> Option<&http::HeaderValue> {
    headers
        .get(http::header::CONTENT_TYPE)
        .filter(|v| v.as_bytes().starts_with(b"application/grpc"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn length(values: &[&str]) -> Option<u64> {
        let mut req = Request::new(());
        for v in values {
            req.headers_mut()
                .append(http::header::CONTENT_LENGTH, v.parse().unwrap());
        }
        RequestInfo::new(&req).content_length()
    }

    #[test]
    fn content_length_is_one_decimal_number() {
        assert_eq!(length(&["2048"]), Some(2048));
        assert_eq!(length(&[" 7 "]), Some(7));
        assert_eq!(length(&["0"]), Some(0));
        assert_eq!(length(&["18446744073709551615"]), Some(u64::MAX));
        for bad in [
            &[][..],
            &["+5"],
            &["-1"],
            &[""],
            &["1e3"],
            &["18446744073709551616"],
            &["5", "5"],
        ] {
            assert_eq!(length(bad), None, "{bad:?}");
        }
    }
}
