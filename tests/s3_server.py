"""A real S3 HTTP API on 127.0.0.1 for tests: moto's ThreadedMotoServer.

Server mode, not moto's in-process `mock_aws`, which does not work with
s3fs/aiobotocore. The credentials are moto's documented test credentials.

One change to moto: requests are handled one at a time. moto checks a PUT's
If-Match / If-None-Match and then stores the object in two separate steps,
without a lock, so two concurrent conditional PUTs could both pass. Real S3
decides them atomically, and the tests of racing writers rely on that.
"""

from __future__ import annotations

import threading
import uuid

TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # never wait on an instance-metadata lookup
}


def _serialized_moto_server():
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from moto.server import ThreadedMotoServer
    from werkzeug.serving import make_server

    class SerializedMotoServer(ThreadedMotoServer):
        """ThreadedMotoServer whose request handling is serialized (see the module docstring)."""

        def _server_entry(self) -> None:
            app = DomainDispatcherApplication(create_backend_app)
            lock = threading.Lock()

            def serialized(environ, start_response):
                with lock:
                    return list(app(environ, start_response))

            self._server = make_server(
                self._ip_address, self._port, serialized, True, request_handler=MotoRequestHandler
            )
            self._server_ready_event.set()
            self._server.serve_forever()

    return SerializedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)


class MotoS3:
    """One moto S3 server on an ephemeral port of 127.0.0.1."""

    def __init__(self) -> None:
        self.server = _serialized_moto_server()
        self.endpoint = ""

    def start(self) -> MotoS3:
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self.server.stop()

    def client(self):
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=TEST_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=TEST_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=TEST_ENV["AWS_DEFAULT_REGION"],
        )

    def create_bucket(self, prefix: str = "tl") -> str:
        """A new, empty bucket with a unique name (moto keeps buckets for the whole process)."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name
