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
