# kvram with TensorFlow's CUDA wheels. Run with GPU passthrough:
#   docker build -t kvram . && docker run --gpus all --rm kvram            # kvram info
#   docker run --gpus all --rm kvram kvram demo
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2 KERAS_BACKEND=tensorflow
WORKDIR /opt/kvram
COPY pyproject.toml README.md ./
COPY kvram ./kvram
RUN pip install --no-cache-dir ".[gpu]"
CMD ["kvram", "info"]
