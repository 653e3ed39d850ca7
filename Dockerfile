# tollgate-server: docker build -t tollgate-server .
# Built with the same command as the docs (cargo build --release --features server --bin
# tollgate-server), run on distroless (glibc, CA roots, no shell) as a non-root user.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --features server --bin tollgate-server

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/tollgate-server /usr/local/bin/tollgate-server
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/tollgate-server"]
