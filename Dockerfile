# upsycle-router in a container: slim Python, non-root user, state in a volume.
#   docker build -t upsycle-router .
#   docker run -v upsycle-data:/data -p 7733:7733 upsycle-router
FROM python:3.11-slim

RUN useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin upsycle \
 && mkdir -p /data /run/upsycle-router \
 && chown upsycle:upsycle /data /run/upsycle-router

WORKDIR /src
COPY pyproject.toml README.md ./
COPY upsycle_router ./upsycle_router
RUN pip install --no-cache-dir . && rm -rf /src

USER upsycle
VOLUME ["/data"]
EXPOSE 7733
ENV XDG_STATE_HOME=/data XDG_RUNTIME_DIR=/run/upsycle-router
ENTRYPOINT ["upsycle-router"]
CMD ["run", "--data-dir", "/data", "--unix", "/run/upsycle-router/router.sock", "--listen", "0.0.0.0:7733"]
