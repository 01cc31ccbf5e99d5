"""A real S3-compatible server for the storage tests: moto's server mode on a free loopback port.

The driver and the workers reach it through the same variables a user sets for a real bucket
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...): the driver forwards them to the workers.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass
class Bucket:
    """A bucket of the server: ``url`` is ``s3://<name>``; ``fs`` an s3fs filesystem to look inside it."""

    name: str
    fs: Any

    @property
    def url(self) -> str:
        return f"s3://{self.name}"

    def files(self, prefix: str = "") -> list[str]:
        """Every object under ``prefix``, relative to the bucket."""
        self.fs.invalidate_cache()
        root = f"{self.name}/{prefix}".rstrip("/")
        if not self.fs.exists(root):
            return []
        return sorted(p[len(self.name) + 1 :] for p in self.fs.find(root))


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(s3_endpoint, monkeypatch) -> Bucket:
    """A new, empty bucket; the variables that reach it set in this process (and so forwarded to the workers)."""
    import s3fs

    from benchmarks.storage import s3_environment  # the benchmark's drivers reach its server the same way

    for name, value in s3_environment(s3_endpoint).items():
        monkeypatch.setenv(name, value)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=s3_endpoint)
    name = f"runs-{uuid.uuid4().hex[:10]}"
    fs.mkdir(name)
    return Bucket(name, fs)
