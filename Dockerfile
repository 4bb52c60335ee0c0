# NovaInfer, CPU image: the `novainfer` package (CLI, Python API and the Rust server run in-process).
#
#   docker build -t novainfer:cpu .
#   docker run --rm -p 8000:8000 -v novainfer-models:/models novainfer:cpu
#
# The build uses the repository's .cargo/config.toml (x86-64-v3: AVX2/FMA/F16C), so the image runs on
# x86-64 CPUs from 2015 on (Haswell, Zen 1). The CUDA variant is described in deploy/README.md.

FROM rust:1-bookworm AS build
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 python3-venv python3-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The virtual environment is copied whole into the runtime image, at the same path.
RUN python3 -m venv /opt/novainfer \
 && /opt/novainfer/bin/pip install -q --no-cache-dir . \
 && rm -rf target

FROM debian:bookworm-slim
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 novainfer \
 && mkdir /models && chown novainfer /models
COPY --from=build /opt/novainfer /opt/novainfer
ENV PATH=/opt/novainfer/bin:$PATH \
    NOVAINFER_HOME=/models
USER novainfer
# 8000: HTTP (OpenAI API, Web UI, /health, /ready, /metrics); 5557/5558: KV-cache events and replay
# (only with --kv-events-config).
EXPOSE 8000 5557 5558
ENTRYPOINT ["novainfer"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--model", "qwen2.5-coder-0.5b"]
