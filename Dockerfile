# The detector's image, for helm/mcp-stream-exporter: `docker build -t mcp-stream-exporter:0.1.0 .`
# The package with its `detector` extra (FastAPI, uvicorn, gRPC, OTLP, prometheus-client, pydantic-settings).
# Non-root (uid 10001, as the chart's securityContext), read-only root filesystem friendly.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY exporter ./exporter
RUN pip install --no-cache-dir '.[detector]' && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin detector
USER 10001
ENV PYTHONDONTWRITEBYTECODE=1
EXPOSE 9464 4317 4318
ENTRYPOINT ["mcp-stream-exporter"]
CMD ["serve", "--host=0.0.0.0"]
