//! Clients that do not make overload worse: adaptive throttling ([`Throttle`]) and retry
//! budgets ([`RetryBudget`]), with tower layers for any `http` client ([`ThrottleLayer`],
//! [`RetryLayer`]).
//!
//! A service protected by an adaptive limit or a quota refuses what it cannot take. Its
//! clients can still multiply its load: each refused call retried three times turns 2× the
//! capacity into up to 8×, refused again, and the storm outlives the spike. Two answers, per
//! upstream, shared by every call to it:
//!
//! - a [`Throttle`] refuses calls in the client when the upstream has lately accepted too few
//!   (Google's SRE book: the upstream then receives about K = 2 times what it accepts);
//! - a [`RetryBudget`] lets retries be at most a share of the calls (10 % over 10 s, at least
//!   one a second), so retries cannot multiply the load however many calls fail.
//!
//! Retry outside the throttle, so that retries are throttled too:
//!
//! ```
//! use tollgate::client::{RetryBudget, RetryLayer, Throttle, ThrottleLayer};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! // An upstream that is overloaded: it refuses every call with 503.
//! let upstream = tower::service_fn(|_req: http::Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(http::Response::builder().status(503).body(()).unwrap())
//! });
//! let budget = RetryBudget::new();
//! let mut client = ServiceBuilder::new()
//!     .layer(RetryLayer::new(budget.clone()))
//!     .layer(ThrottleLayer::new(Throttle::new()))
//!     .service(upstream);
//! for _ in 0..1000 {
//!     let call = client.ready().await.unwrap().call(http::Request::new(String::new()));
//!     // Each call gets the upstream's 503, or a refusal of the throttle: never a storm.
//!     let _ = call.await;
//! }
//! let (calls, retries) = budget.counts();
//! assert_eq!(calls, 1000);
//! assert!(retries <= 100, "10 % of the calls: {retries}");
//! # }
//! ```

mod budget;
mod buffer;
#[cfg(feature = "serde")]
mod config;
mod layer;
mod throttle;
mod window;

pub use budget::{RetryBudget, RetryBudgetBuilder};
pub use buffer::{BufferLayer, Buffered};
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub use config::{RetryConfig, ThrottleConfig};
pub use layer::{
    BoxError, Retry, RetryLayer, RetrySafe, ThrottleFuture, ThrottleLayer, ThrottleService,
};
#[cfg(feature = "reqwest")]
pub(crate) use layer::{Judged, again_of, drive};
pub use throttle::{
    DEFAULT_WINDOW, Throttle, ThrottleBuilder, ThrottleTicket, Throttled, accepted,
};
