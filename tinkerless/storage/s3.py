"""S3 specifics of ObjectStore.

s3fs does the ordinary object I/O, but it cannot send ``If-Match``, so the
conditional writes behind checkpoint commits go through a boto3 client built
from the same settings as the s3fs filesystem (keys, profile, endpoint, client
and config options). Endpoints from ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``
are honoured by botocore itself, for both clients. This module also turns
botocore and s3fs failures into typed errors that say what to fix.

Imported only when an s3:// store is used, so `import tinkerless` stays free of boto3.
"""

from __future__ import annotations

import threading
from typing import Any

from tinkerless.errors import StorageError, StorageNotFound, TinkerlessError
from tinkerless.storage.errors import PreconditionFailed, StorageConfigError

_CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with a profile in ~/.aws/credentials, "
    "or pass key=/secret= storage options"
)
_ENDPOINT_HINT = "for R2, MinIO, SeaweedFS and other S3-compatible stores set AWS_ENDPOINT_URL or pass client_kwargs={'endpoint_url': ...}"
_DENIED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "403"}


class S3Access:
    """Conditional reads/writes and error translation for one s3fs filesystem."""

    def __init__(self, fs: Any):
        self.fs = fs
        self._client: Any = None
        self._lock = threading.Lock()
        self._buckets_ok: set[str] = set()

    # -- clients -----------------------------------------------------------------

    def client(self) -> Any:
        """A boto3 S3 client with the s3fs filesystem's credentials and endpoint (created once)."""
        with self._lock:
            if self._client is None:
                self._client = _boto3_client_like(self.fs)
            return self._client

    def split(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    def ensure_bucket(self, path: str) -> None:
        """Fail early and clearly if the bucket is missing or the credentials are unusable.

        Checked once per bucket: without it a missing bucket reads as an empty
        listing and a write fails with a bare "not found"."""
        bucket, _ = self.split(path)
        if bucket in self._buckets_ok:
            return
        from botocore.exceptions import ClientError

        url = f"s3://{bucket}"
        try:
            self.client().head_bucket(Bucket=bucket)
        except ClientError as e:
            # HEAD responses carry no error body, so a missing bucket is a bare 404.
            if _code(e) in ("404", "NoSuchBucket"):
                raise self._no_bucket(bucket, url) from e
            # 403 on HeadBucket alone is not fatal: a key may be scoped to a prefix
            # and still read and write objects there.
            if _code(e) not in ("403", "AccessDenied"):
                raise self.translate(e, url) or _generic(e, "check", url) from e
        except Exception as e:
            raise self.translate(e, url) or _generic(e, "check", url) from e
        self._buckets_ok.add(bucket)

    # -- conditional I/O -----------------------------------------------------------

    def get_with_version(self, path: str, url: str) -> tuple[bytes, str]:
        """The object's bytes and its ETag, from one GET (so they belong together)."""
        bucket, key = self.split(path)
        try:
            response = self.client().get_object(Bucket=bucket, Key=key)
            return response["Body"].read(), response["ETag"]
        except Exception as e:
            if _code(e) in ("NoSuchKey", "404"):
                raise StorageNotFound(
                    f"no object at {url}",
                    hint="check the key and the storage URL; list what exists with ObjectStore.list(prefix)",
                ) from e
            raise self.translate(e, url) or _generic(e, "read", url) from e

    def put_if(self, path: str, data: bytes, match: str | None, url: str) -> str:
        """PUT only if the object's ETag is `match` (None: only if it does not exist); return the new ETag."""
        bucket, key = self.split(path)
        condition = {"IfNoneMatch": "*"} if match is None else {"IfMatch": match}
        try:
            response = self.client().put_object(Bucket=bucket, Key=key, Body=data, **condition)
            return response["ETag"]
        except Exception as e:
            # 412: the condition did not hold. 409: a concurrent conditional write
            # to the same key won. NoSuchKey: If-Match on an object that is gone.
            if _code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey"):
                expected = "not to exist" if match is None else f"to have version {match}"
                raise PreconditionFailed(
                    f"conditional write to {url} refused: the object was expected {expected}, "
                    "but another writer changed it",
                    hint="read it again (get_with_version) and retry, or stop the other writer",
                ) from e
            raise self.translate(e, url) or _generic(e, "write", url) from e

    # -- errors ----------------------------------------------------------------------

    def translate(self, e: BaseException, url: str) -> TinkerlessError | None:
        """A typed error for a known S3 failure anywhere in `e`'s cause chain, else None."""
        for err in _chain(e):
            name = type(err).__name__
            if name in ("NoCredentialsError", "PartialCredentialsError", "ProfileNotFound"):
                return StorageConfigError(f"no usable AWS credentials for {url}: {err}", hint=_CREDENTIALS_HINT)
            if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
                return StorageError(
                    f"cannot reach the S3 endpoint for {url}: {err}",
                    hint="check the network and the endpoint URL; " + _ENDPOINT_HINT,
                )
            code = _code(err)
            if code == "NoSuchBucket":
                return self._no_bucket(self.split(url.removeprefix("s3://"))[0], url)
            if code in _DENIED_CODES:
                return StorageConfigError(
                    f"S3 refused access to {url} ({code}): {err}",
                    hint="check that the credentials are valid and allowed to read and write this bucket/prefix; "
                    + _CREDENTIALS_HINT,
                )
        return None

    def _no_bucket(self, bucket: str, url: str) -> StorageConfigError:
        return StorageConfigError(
            f"bucket {bucket!r} does not exist at {self.endpoint()} (needed for {url})",
            hint=f"create the bucket with `aws s3 mb s3://{bucket}` (add --endpoint-url for S3-compatible "
            "stores), or check the URL, AWS_PROFILE and AWS_ENDPOINT_URL",
        )

    def endpoint(self) -> str:
        try:
            return str(self.client().meta.endpoint_url)
        except Exception:  # noqa: BLE001 - the endpoint only decorates a message that reports another error
            return "the default AWS endpoint"


def _boto3_client_like(fs: Any) -> Any:
    """A boto3 client configured like s3fs configures its aiobotocore client."""
    import boto3
    from botocore.config import Config

    client_kwargs = dict(fs.client_kwargs)
    # s3fs: the explicit endpoint_url takes precedence over the one in client_kwargs.
    if fs.endpoint_url:
        client_kwargs["endpoint_url"] = fs.endpoint_url
    client_kwargs.setdefault("use_ssl", fs.use_ssl)
    config_kwargs = dict(fs.config_kwargs)
    if fs.anon:
        from botocore import UNSIGNED

        config_kwargs["signature_version"] = UNSIGNED
    else:
        for name, value in (
            ("aws_access_key_id", fs.key),
            ("aws_secret_access_key", fs.secret),
            ("aws_session_token", fs.token),
        ):
            if value is not None:
                client_kwargs.setdefault(name, value)
    # s3fs hands its extra keyword arguments to the botocore session (e.g. profile=...).
    session = boto3.session.Session(profile_name=fs.kwargs.get("profile"))
    return session.client("s3", config=Config(**config_kwargs), **client_kwargs)


def _chain(e: BaseException):
    seen: set[int] = set()
    current: BaseException | None = e
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _code(e: BaseException) -> str | None:
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return None
    code = response.get("Error", {}).get("Code")
    return str(code) if code is not None else None


def _generic(e: BaseException, action: str, url: str) -> StorageError:
    return StorageError(f"could not {action} {url}: {e}", hint="check that the storage location is reachable")
