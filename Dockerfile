# The image helm/kvgate runs (image.repository:image.tag, ghcr.io/kvgate/kvgate): the kvgate package
# installed from this checkout; `kvgate` is the entrypoint, so the chart's args are a subcommand:
# `proxy ...` (gateway), `agent ...` (worker sidecar), `drain ...` (the sidecar's preStop).
#   docker build -t ghcr.io/kvgate/kvgate:0.1.0 .
# tests/unit/helm/test_dockerfile.py checks this file statically (no container engine in CI).
FROM python:3.12-slim

# the whole checkout less what .dockerignore drops (venvs, tests, git): every package pyproject.toml
# lists is installed, whatever it is called
COPY . /src
RUN pip install --no-cache-dir /src && rm -rf /src

# a numeric, non-root user: the chart's pods set runAsNonRoot and a read-only root filesystem
# (mitmproxy's confdir and /tmp are emptyDir volumes there)
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin kvgate
USER 10001
WORKDIR /
EXPOSE 8080
ENTRYPOINT ["kvgate"]
CMD ["proxy", "--listen-host=0.0.0.0", "--listen-port=8080"]
