//! Messages, server and client for `helloworld.proto` (package `helloworld`).
//!
//! Written by hand in the shape `tonic-prost-build` emits for this file, so that building the
//! examples and tests needs no `protoc` and the library no build script. The service is small:
//! one unary method. If `helloworld.proto` changes, change this file with it; `tests/grpc.rs`
//! calls it with a real tonic client over TCP, so a mismatch fails there.
//!
//! Shared by `examples/tonic_greeter.rs` and `tests/grpc.rs` through `#[path]`; each uses only
//! a part of it.
#![allow(dead_code, unreachable_pub, missing_docs)]

/// The request message containing the user's name.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct HelloRequest {
    #[prost(string, tag = "1")]
    pub name: ::prost::alloc::string::String,
}

/// The response message containing the greetings.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct HelloReply {
    #[prost(string, tag = "1")]
    pub message: ::prost::alloc::string::String,
}

/// The fully qualified service name and the method's path.
pub const SERVICE_NAME: &str = "helloworld.Greeter";
pub const SAY_HELLO_PATH: &str = "/helloworld.Greeter/SayHello";

pub mod greeter_server {
    use tonic::codegen::*;

    /// The greeting service definition.
    #[async_trait]
    pub trait Greeter: Send + Sync + 'static {
        /// Sends a greeting.
        async fn say_hello(
            &self,
            request: tonic::Request<super::HelloRequest>,
        ) -> Result<tonic::Response<super::HelloReply>, tonic::Status>;
    }

    /// A tower service routing `helloworld.Greeter` calls to a [`Greeter`].
    #[derive(Debug)]
    pub struct GreeterServer<T> {
        inner: Arc<T>,
    }

    impl<T> GreeterServer<T> {
        pub fn new(inner: T) -> Self {
            GreeterServer {
                inner: Arc::new(inner),
            }
        }
    }

    impl<T> Clone for GreeterServer<T> {
        fn clone(&self) -> Self {
            GreeterServer {
                inner: self.inner.clone(),
            }
        }
    }

    impl<T: Greeter> tonic::server::NamedService for GreeterServer<T> {
        const NAME: &'static str = super::SERVICE_NAME;
    }

    /// Adapts [`Greeter::say_hello`] to tonic's unary-call machinery.
    struct SayHelloSvc<T>(Arc<T>);

    impl<T: Greeter> tonic::server::UnaryService<super::HelloRequest> for SayHelloSvc<T> {
        type Response = super::HelloReply;
        type Future = BoxFuture<tonic::Response<Self::Response>, tonic::Status>;

        fn call(&mut self, request: tonic::Request<super::HelloRequest>) -> Self::Future {
            let inner = Arc::clone(&self.0);
            Box::pin(async move { inner.say_hello(request).await })
        }
    }

    impl<T, B> Service<http::Request<B>> for GreeterServer<T>
    where
        T: Greeter,
        B: Body + Send + 'static,
        B::Error: Into<StdError> + Send + 'static,
    {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;

        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, req: http::Request<B>) -> Self::Future {
            match req.uri().path() {
                super::SAY_HELLO_PATH => {
                    let method = SayHelloSvc(self.inner.clone());
                    Box::pin(async move {
                        let codec = tonic_prost::ProstCodec::default();
                        let mut grpc = tonic::server::Grpc::new(codec);
                        Ok(grpc.unary(method, req).await)
                    })
                }
                _ => Box::pin(async move {
                    Ok(tonic::Status::unimplemented("no such method").into_http())
                }),
            }
        }
    }
}

pub mod greeter_client {
    use tonic::codegen::*;

    /// A client for `helloworld.Greeter`.
    #[derive(Debug, Clone)]
    pub struct GreeterClient<T> {
        inner: tonic::client::Grpc<T>,
    }

    impl GreeterClient<tonic::transport::Channel> {
        /// Connects to `dst`, e.g. `"http://127.0.0.1:50051"`.
        pub async fn connect<D>(dst: D) -> Result<Self, tonic::transport::Error>
        where
            D: TryInto<tonic::transport::Endpoint>,
            D::Error: Into<StdError>,
        {
            let conn = tonic::transport::Endpoint::new(dst)?.connect().await?;
            Ok(Self::new(conn))
        }
    }

    impl<T> GreeterClient<T>
    where
        T: tonic::client::GrpcService<tonic::body::Body>,
        T::Error: Into<StdError>,
        T::ResponseBody: Body<Data = Bytes> + Send + 'static,
        <T::ResponseBody as Body>::Error: Into<StdError> + Send,
    {
        pub fn new(inner: T) -> Self {
            GreeterClient {
                inner: tonic::client::Grpc::new(inner),
            }
        }

        /// Sends a greeting.
        pub async fn say_hello(
            &mut self,
            request: impl tonic::IntoRequest<super::HelloRequest>,
        ) -> Result<tonic::Response<super::HelloReply>, tonic::Status> {
            self.inner.ready().await.map_err(|e| {
                tonic::Status::unknown(format!("Service was not ready: {}", e.into()))
            })?;
            let codec = tonic_prost::ProstCodec::default();
            let path = http::uri::PathAndQuery::from_static(super::SAY_HELLO_PATH);
            let mut req = request.into_request();
            req.extensions_mut()
                .insert(GrpcMethod::new(super::SERVICE_NAME, "SayHello"));
            self.inner.unary(req, path, codec).await
        }
    }
}
