# checkpointq worker and beat: one image (docker-compose.yml builds it once, for `worker`;
# `beat` runs the same image). Build: docker build -t checkpointq .
# The base image is pinned to the Python the test suite runs on; to pin it by content too,
# append its digest (docker buildx imagetools inspect python:3.11.7-slim-bookworm).
FROM python:3.11.7-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# 1. The dependencies with the worker's and postgres extras, at the versions of constraints.txt
# (the ones the tests ran with), from pyproject.toml alone: a change to the code does not
# reinstall them.
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; project = tomllib.load(open('pyproject.toml', 'rb'))['project']; deps = project['dependencies'] + project['optional-dependencies']['worker'] + project['optional-dependencies']['postgres']; open('/tmp/requirements.txt', 'w').write('\n'.join(deps))" \
 && pip install -r /tmp/requirements.txt -c constraints.txt \
 && rm /tmp/requirements.txt

# 2. The code, installed without touching the dependencies.
COPY README.md ./
COPY store ./store
COPY tasks ./tasks
COPY worker ./worker
RUN pip install --no-deps .

# Never run as root: the worker executes nothing but our tasks, and needs no privilege.
RUN useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin checkpointq
USER checkpointq

# Celery's warm shutdown on SIGTERM finishes running tasks; unacknowledged messages are
# redelivered by Redis after the visibility timeout.
STOPSIGNAL SIGTERM
ENTRYPOINT ["checkpointq"]
CMD ["worker"]
