# The otel-gpu collector image: the image of the Helm chart (helm/otel-gpu, values image.repository), also usable as a
# node sidecar (`docker run ... ghcr.io/otel-gpu/otel-gpu:0.1.0 collector --config /etc/otel-gpu/config.yaml`).
#
#   docker build -t ghcr.io/otel-gpu/otel-gpu:0.1.0 .
#
# Only what the collector needs: the otel-gpu package and its runtime dependencies (OpenTelemetry, grpcio, protobuf,
# prometheus-client, nvidia-ml-py, PyYAML, msgspec). No torch (an optional extra: training images install otel-gpu
# themselves) and nothing of the test extra. NVML's libnvidia-ml.so.1 comes from the NVIDIA container runtime at run time
# (NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES=utility, as the chart sets them), not from this image.
# Runs as uid/gid 65534 (nobody), with a read-only root filesystem in the chart: the store (/var/lib/otel-gpu) and
# /tmp are volumes there.
ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY otel_gpu ./otel_gpu
COPY receivers ./receivers
COPY processors ./processors
# Wheels for otel-gpu and its runtime dependencies only (no extras).
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="otel-gpu" \
      org.opencontainers.image.description="OpenTelemetry-native collector for GPU training jobs: why a job crashed, hung or slowed down" \
      org.opencontainers.image.source="https://github.com/otel-gpu/otel-gpu" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels otel-gpu \
    && rm -rf /wheels \
    && mkdir -p /var/lib/otel-gpu \
    && chown 65534:65534 /var/lib/otel-gpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 65534:65534
WORKDIR /var/lib/otel-gpu
# OTLP gRPC, OTLP HTTP, Prometheus /metrics and /health.
EXPOSE 4317 4318 9464
ENTRYPOINT ["otel-gpu"]
CMD ["collector"]
