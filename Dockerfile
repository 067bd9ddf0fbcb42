# kvram with TensorFlow's CUDA wheels. Run with GPU passthrough:
#   docker build -t kvram . && docker run --gpus all --rm kvram            # kvram info
#   docker run --gpus all --rm kvram kvram demo
# tests/test_docker.py lints this file (hadolint) and replays its steps without Docker.
FROM python:3.11.13-slim-bookworm
ENV PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2 KERAS_BACKEND=tensorflow \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid 1000 kvram
WORKDIR /opt/kvram
COPY docker/constraints.txt pyproject.toml README.md ./
COPY kvram ./kvram
RUN pip install --no-cache-dir --constraint constraints.txt ".[gpu,images]"
USER 1000
WORKDIR /home/kvram
CMD ["kvram", "info"]
