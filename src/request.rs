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
    version: http::Version,
    method: &'a Method,
    uri: &'a Uri,
    headers: &'a HeaderMap,
    extensions: &'a Extensions,
}

impl<'a> RequestInfo<'a> {
    /// Borrows the head of `req`.
    pub fn new<B>(req: &'a Request<B>) -> Self {
        RequestInfo {
            version: req.version(),
            method: req.method(),
            uri: req.uri(),
            headers: req.headers(),
            extensions: req.extensions(),
        }
    }

    /// Builds a view from its parts (useful in tests and custom services).
    pub fn from_parts(parts: &'a http::request::Parts) -> Self {
        RequestInfo {
            version: parts.version,
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

    /// The size of the request's body in bytes, when it is known before the body is read: its
    /// `Content-Length`, or 0 for an HTTP/1 request with neither `Content-Length` nor
    /// `Transfer-Encoding` (which has no body, RFC 9112 §6.3). `None` for a body of unstated
    /// size (chunked, or HTTP/2 and HTTP/3 without the header), or a `Content-Length` that is
    /// not one decimal number.
    pub fn content_length(&self) -> Option<u64> {
        let mut values = self.headers.get_all(http::header::CONTENT_LENGTH).iter();
        let Some(value) = values.next() else {
            let http1 = self.version <= http::Version::HTTP_11;
            let chunked = self.headers.contains_key(http::header::TRANSFER_ENCODING);
            return (http1 && !chunked).then_some(0);
        };
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
        *req.version_mut() = http::Version::HTTP_2;
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

    #[test]
    fn an_http1_request_without_length_or_chunks_has_no_body() {
        let get = Request::get("/").body(()).unwrap();
        assert_eq!(RequestInfo::new(&get).content_length(), Some(0));
        let chunked = Request::post("/")
            .header("transfer-encoding", "chunked")
            .body(())
            .unwrap();
        assert_eq!(RequestInfo::new(&chunked).content_length(), None);
        let h2 = Request::post("/")
            .version(http::Version::HTTP_2)
            .body(())
            .unwrap();
        assert_eq!(RequestInfo::new(&h2).content_length(), None);
    }
}
