# upsycle-router in a container: slim Python, non-root user, state in a volume.
#   docker build -t upsycle-router .
#   docker run -d --name upsycle -v upsycle-data:/data -p 7733:7733 upsycle-router
#   docker exec upsycle upsycle-router status     # the commands see the daemon's data and socket (ENV below)
#   docker exec upsycle upsycle-router id         # the router's id, from /data
# A config file, if any, goes to /etc/upsycle-router/router.yaml (-v ./router.yaml:/etc/upsycle-router/
# router.yaml:ro); none is needed. The environment overrides its data_dir, listen.unix and listen.tls
# (docs/config.md, "Where the config comes from"); -e UPSYCLE_LOG_LEVEL=debug and the like work too.
# Other routers dial the address in this router's advert: set it with -e UPSYCLE_ADVERTISE=IP:7733 (0.0.0.0,
# which it listens on, is none they can dial; the router warns at start while it is not set).
#
# The build stage has a C compiler, so the wheel carries the C accelerators (upsycle_router/wire/_codec.c: frame
# decoding, message ids with the vendored BLAKE3 C code in vendor/; runtime/_verify.c: batch signature
# verification; store/_records.c and store/_idindex.c: the store's records and id index); the runtime image has
# no compiler.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY upsycle_router ./upsycle_router
COPY vendor ./vendor
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin upsycle \
 && mkdir -p /data /run/upsycle-router \
 && chown upsycle:upsycle /data /run/upsycle-router
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
 && python -c "from upsycle_router import accel; assert accel.IMPLEMENTATION == 'c', 'no C accelerator'"

USER upsycle
VOLUME ["/data"]
EXPOSE 7733
# Read by the daemon and by every command run in the container (docker exec), so they agree on the data
# directory (the router key, the store) and the socket.
ENV UPSYCLE_DATA_DIR=/data UPSYCLE_SOCKET=/run/upsycle-router/router.sock UPSYCLE_LISTEN=0.0.0.0:7733
ENTRYPOINT ["upsycle-router"]
CMD ["run"]
# `wait` exits 1 when no router answers and 2 on a config error; Docker reserves 2, so both are reported as 1.
HEALTHCHECK --interval=30s --timeout=10s CMD ["sh", "-c", "upsycle-router wait --timeout 5 >/dev/null || exit 1"]
