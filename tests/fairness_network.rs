//! Fairness and criticality over real sockets: an axum server behind the adaptive layer, called
//! by reqwest; a tonic server called by a tonic client with metadata; and the criticality
//! passed on to the calls a handler makes (reqwest middleware, a tower client, an upstream
//! limit).

mod support;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use http::HeaderName;
use support::wait_for;
use tokio::sync::Semaphore;
use tollgate::adaptive::{AdaptiveLayer, AdaptiveLimit, Upstreams};
use tollgate::criticality::{Criticality, PropagateCriticalityLayer};
use tollgate::middleware::CriticalityMiddleware;

const LEVEL: HeaderName = HeaderName::from_static("x-criticality");
const TENANT: HeaderName = HeaderName::from_static("x-tenant");

fn fixed(n: u32) -> AdaptiveLimit {
    AdaptiveLimit::builder()
        .initial(n)
        .range(n, n)
        .build()
        .unwrap()
}

/// `/hold` waits for `release`; `/` answers at once with the current criticality.
fn app(release: Arc<Semaphore>) -> Router {
    Router::new()
        .route(
            "/hold",
            get(move || {
                let release = release.clone();
                async move {
                    support::held_until(&release).await;
                    "held"
                }
            }),
        )
        .route(
            "/",
            get(|| async { Criticality::current().map_or("none", Criticality::as_str) }),
        )
}

/// A noisy tenant holding the slots of a full limit is refused; a quiet tenant is served.
#[tokio::test]
async fn over_http_a_noisy_tenant_is_refused_and_a_quiet_one_served() {
    let release = Arc::new(Semaphore::new(0));
    let limit = fixed(8);
    let layer = AdaptiveLayer::new(limit.clone()).flow_by_header(TENANT);
    let base = support::serve_app(app(release.clone()).layer(layer)).await;
    let client = reqwest::Client::new();
    let get = |tenant: &'static str, path: &str| {
        client
            .get(format!("{base}{path}"))
            .header("x-tenant", tenant)
            .send()
    };
    // Another tenant holds a slot; the noisy one takes what it can.
    let quiet_held = tokio::spawn(get("quiet", "/hold"));
    wait_for(|| limit.in_flight() == 1).await;
    let mut noisy = Vec::new();
    for _ in 0..6 {
        noisy.push(tokio::spawn(get("noisy", "/hold")));
    }
    wait_for(|| limit.in_flight() == 7).await;
    // Near the limit, noisy (holding 6) is refused...
    let refused = get("noisy", "/").await.unwrap();
    assert_eq!(refused.status(), 503);
    assert!(refused.headers().contains_key("retry-after"));
    // ... and quiet, holding 1, is served.
    assert_eq!(get("quiet", "/").await.unwrap().status(), 200);
    let default = &limit.levels()[Criticality::Default as usize];
    assert_eq!(default.over_share, 1);
    release.add_permits(7);
    assert_eq!(quiet_held.await.unwrap().unwrap().status(), 200);
    for n in noisy {
        assert_eq!(n.await.unwrap().unwrap().status(), 200);
    }
    wait_for(|| limit.in_flight() == 0).await;
}

/// The level is read from the trusted header (anything else is default) and is the
/// handler's current criticality; a sheddable request is refused where a critical one is
/// served.
#[tokio::test]
async fn over_http_the_level_comes_from_the_header_and_sheddable_is_refused_first() {
    let release = Arc::new(Semaphore::new(0));
    let limit = fixed(4);
    let layer = AdaptiveLayer::new(limit.clone()).criticality_from_header(LEVEL);
    let base = support::serve_app(app(release.clone()).layer(layer)).await;
    let client = reqwest::Client::new();
    let get = |level: Option<&'static str>, path: &str| {
        let mut req = client.get(format!("{base}{path}"));
        if let Some(level) = level {
            req = req.header("x-criticality", level);
        }
        req.send()
    };
    for (sent, seen) in [
        (Some("critical"), "critical"),
        (Some("SHEDDABLE"), "sheddable"),
        (Some("urgent!"), "default"),
        (None, "default"),
    ] {
        let res = get(sent, "/").await.unwrap();
        assert_eq!(res.text().await.unwrap(), seen, "{sent:?}");
    }
    // Two critical requests in flight of 4, and a default one seen lately: sheddable ones leave
    // the default one's slot and the headroom (1) to the levels above; critical ones take any.
    let held: Vec<_> = (0..2)
        .map(|_| tokio::spawn(get(Some("critical"), "/hold")))
        .collect();
    wait_for(|| limit.in_flight() == 2).await;
    assert_eq!(get(Some("sheddable"), "/").await.unwrap().status(), 503);
    assert_eq!(get(Some("critical"), "/").await.unwrap().status(), 200);
    release.add_permits(2);
    for h in held {
        assert_eq!(h.await.unwrap().unwrap().status(), 200);
    }
    let levels = limit.levels();
    assert_eq!(levels[Criticality::Sheddable as usize].rejected, 1);
    assert_eq!(levels[Criticality::Critical as usize].rejected, 0);
}

/// A handler's outbound calls carry its criticality: through the reqwest middleware, a tower
/// client with `PropagateCriticalityLayer`, and into an upstream limit's admission.
#[tokio::test]
async fn a_handlers_calls_carry_its_criticality_to_the_next_service() {
    // The next service: says what level it was sent.
    let next = Router::new().route(
        "/",
        get(|headers: http::HeaderMap| async move {
            (headers.get("x-criticality").cloned())
                .map_or_else(|| "none".to_owned(), |v| v.to_str().unwrap().to_owned())
        }),
    );
    let next_base = support::serve_app(next).await;
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(CriticalityMiddleware::new(LEVEL))
        .build();
    let upstreams = Upstreams::new(|_| AdaptiveLimit::builder().initial(4).range(4, 4)).unwrap();
    let tower_next = next_base.clone();
    let front = Router::new()
        .route(
            "/",
            get(move || {
                let (client, next_base, upstreams) =
                    (client.clone(), next_base.clone(), upstreams.clone());
                async move {
                    let by_reqwest = client.get(&next_base).send().await.unwrap();
                    let by_reqwest = by_reqwest.text().await.unwrap();
                    // An upstream limit admits the call at the request's level.
                    let permit = upstreams.try_acquire("next").unwrap();
                    let limit = upstreams.limit("next").unwrap();
                    let level = (limit.levels().into_iter())
                        .find(|l| l.in_flight == 1)
                        .map(|l| l.criticality.as_str());
                    drop(permit);
                    format!("{by_reqwest} {}", level.unwrap_or("?"))
                }
            }),
        )
        .route(
            "/tower",
            get(move || {
                let uri = tower_next.clone();
                async move {
                    use tower::{ServiceBuilder, ServiceExt};
                    let hyper = hyper_util::client::legacy::Client::builder(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .build_http::<http_body_util::Empty<bytes::Bytes>>();
                    let svc = ServiceBuilder::new()
                        .layer(PropagateCriticalityLayer::new(LEVEL))
                        .service(hyper);
                    let req = http::Request::get(uri).body(Default::default()).unwrap();
                    let res = svc.oneshot(req).await.unwrap();
                    let body = http_body_util::BodyExt::collect(res.into_body()).await;
                    String::from_utf8(body.unwrap().to_bytes().to_vec()).unwrap()
                }
            }),
        )
        .layer(AdaptiveLayer::new(fixed(8)).criticality_from_header(LEVEL));
    let base = support::serve_app(front).await;
    let plain = reqwest::Client::new();
    let ask = |path: &'static str, level: &'static str| {
        plain
            .get(format!("{base}{path}"))
            .header("x-criticality", level)
            .send()
    };
    let text = ask("/", "sheddable").await.unwrap().text().await.unwrap();
    assert_eq!(text, "sheddable sheddable");
    let text = ask("/", "critical").await.unwrap().text().await.unwrap();
    assert_eq!(text, "critical critical");
    let text = ask("/tower", "sheddable")
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(text, "sheddable");
    // No header: the layer's level is default, and that is what travels.
    let text = plain.get(&base).send().await.unwrap().text().await.unwrap();
    assert_eq!(text, "default default");
}

#[path = "../examples/proto/helloworld.rs"]
mod helloworld;

mod over_grpc {
    use super::helloworld::greeter_client::GreeterClient;
    use super::helloworld::greeter_server::{Greeter, GreeterServer};
    use super::helloworld::{HelloReply, HelloRequest};
    use super::*;
    use tokio::net::TcpListener;
    use tokio_stream::wrappers::TcpListenerStream;
    use tonic::{Code, Request, Response, Status};

    /// Says the current criticality; `hold` waits for the release first.
    struct Levels(Arc<Semaphore>);

    #[tonic::async_trait]
    impl Greeter for Levels {
        async fn say_hello(
            &self,
            request: Request<HelloRequest>,
        ) -> Result<Response<HelloReply>, Status> {
            if request.get_ref().name == "hold" {
                support::held_until(&self.0).await;
            }
            let level = Criticality::current().map_or("none", Criticality::as_str);
            Ok(Response::new(HelloReply {
                message: level.to_owned(),
            }))
        }
    }

    async fn serve(limit: AdaptiveLimit, release: Arc<Semaphore>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tonic::transport::Server::builder()
            .layer(
                AdaptiveLayer::new(limit)
                    .criticality_from_header(LEVEL)
                    .flow_by_header(TENANT),
            )
            .add_service(GreeterServer::new(Levels(release)));
        tokio::spawn(server.serve_with_incoming(TcpListenerStream::new(listener)));
        addr
    }

    fn hello(name: &str, level: &'static str) -> Request<HelloRequest> {
        let mut req = Request::new(HelloRequest { name: name.into() });
        req.metadata_mut()
            .insert("x-criticality", level.parse().unwrap());
        req.metadata_mut().insert("x-tenant", "t1".parse().unwrap());
        req
    }

    /// The level travels in metadata; under load a sheddable call is refused with
    /// `UNAVAILABLE` where a critical one is served.
    #[tokio::test]
    async fn over_grpc_the_level_comes_from_metadata_and_sheddable_is_refused_first() {
        let release = Arc::new(Semaphore::new(0));
        let limit = fixed(4);
        let addr = serve(limit.clone(), release.clone()).await;
        let client = GreeterClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let reply = client
            .clone()
            .say_hello(hello("x", "sheddable"))
            .await
            .unwrap();
        assert_eq!(reply.into_inner().message, "sheddable");
        // Three critical calls in flight of 4: sheddable ones leave the headroom (1) to them.
        let held: Vec<_> = (0..3)
            .map(|_| {
                let mut c = client.clone();
                tokio::spawn(async move { c.say_hello(hello("hold", "critical")).await })
            })
            .collect();
        wait_for(|| limit.in_flight() == 3).await;
        let refused = client.clone().say_hello(hello("x", "sheddable")).await;
        let status = refused.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable);
        let served = client
            .clone()
            .say_hello(hello("x", "critical"))
            .await
            .unwrap();
        assert_eq!(served.into_inner().message, "critical");
        release.add_permits(3);
        for h in held {
            assert_eq!(h.await.unwrap().unwrap().into_inner().message, "critical");
        }
        wait_for(|| limit.in_flight() == 0).await;
    }
}

/// Outbound too: calls made for a heavy tenant cannot take all of an upstream's slots.
#[tokio::test]
async fn outbound_calls_of_a_heavy_tenant_are_refused_first() {
    use tollgate::adaptive::Refused;
    use tollgate::middleware::AdaptiveMiddleware;
    let release = Arc::new(Semaphore::new(0));
    let base = support::serve_app(app(release.clone())).await;
    let upstreams = Upstreams::new(|_| AdaptiveLimit::builder().initial(8).range(8, 8)).unwrap();
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(
            AdaptiveMiddleware::new(upstreams.clone())
                .flow_by(|req| req.headers().get("x-tenant").and_then(|v| v.to_str().ok())),
        )
        .build();
    let call = |tenant: &'static str, path: &str| {
        client
            .get(format!("{base}{path}"))
            .header("x-tenant", tenant)
            .send()
    };
    let light_held = tokio::spawn(call("light", "/hold"));
    let host = base.trim_start_matches("http://").to_owned();
    wait_for(|| upstreams.limit(&host).is_some_and(|l| l.in_flight() == 1)).await;
    let heavy: Vec<_> = (0..6)
        .map(|_| tokio::spawn(call("heavy", "/hold")))
        .collect();
    let limit = upstreams.limit(&host).unwrap();
    wait_for(|| limit.in_flight() == 7).await;
    // Near the limit: heavy is refused before it is sent, light goes.
    match call("heavy", "/").await.unwrap_err() {
        reqwest_middleware::Error::Middleware(e) => {
            assert!(matches!(
                e.downcast_ref::<Refused>(),
                Some(Refused::OverLimit)
            ));
        }
        other => panic!("{other}"),
    }
    assert_eq!(call("light", "/").await.unwrap().status(), 200);
    release.add_permits(7);
    assert_eq!(light_held.await.unwrap().unwrap().status(), 200);
    for h in heavy {
        assert_eq!(h.await.unwrap().unwrap().status(), 200);
    }
}
