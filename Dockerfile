# upsycle-router in a container: slim Python, non-root user, state in a volume.
#   docker build -t upsycle-router .
#   docker run -v upsycle-data:/data -p 7733:7733 upsycle-router
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
ENV XDG_STATE_HOME=/data XDG_RUNTIME_DIR=/run/upsycle-router
ENTRYPOINT ["upsycle-router"]
CMD ["run", "--data-dir", "/data", "--unix", "/run/upsycle-router/router.sock", "--listen", "0.0.0.0:7733"]
