# checkpointq worker and beat. Build: docker build -t checkpointq .
# The image runs `checkpointq <command>`; docker-compose.yml starts `worker` and `beat`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# Dependencies first, so that a code change does not reinstall them.
COPY pyproject.toml README.md ./
COPY store ./store
COPY tasks ./tasks
COPY worker ./worker
RUN pip install .

# Never run as root: the worker executes nothing but our tasks, and needs no privilege.
RUN useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin checkpointq
USER checkpointq

# Celery's warm shutdown on SIGTERM finishes running tasks; unacknowledged messages are
# redelivered by Redis after the visibility timeout.
STOPSIGNAL SIGTERM
ENTRYPOINT ["checkpointq"]
CMD ["worker"]
