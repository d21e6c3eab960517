"""Preflight of a checkpoint URL: prove, before training starts, that checkpoints can be written there.

Every problem becomes one :class:`~orchestrator.errors.CheckpointSetupError` line (a ``UserError``, exit
code 2) naming the URL, the problem and the fix, because finding out at the first save (hours in) wastes the
run. ``setting`` names where the URL came from when the caller knows (``orch launch`` checks
``checkpoint.url``); without it the message names the URL alone.
"""

from __future__ import annotations

import uuid

from orchestrator.errors import CheckpointSetupError

from .storage import CheckpointStorage, UnusableURL, missing_package_for, normalize_url, url_scheme

LAUNCH_SETTING = "checkpoint.url"
_SCHEMES_HINT = "use a local path or a file://, s3://, gs:// or memory:// URL"
_CREDENTIAL_HINTS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or attach an instance role)",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`",
    "gcs": "set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`",
}
# Words object-store clients put in credential errors (botocore NoCredentialsError, S3 error codes, ...).
_CREDENTIAL_MARKERS = ("credential", "invalidaccesskeyid", "signaturedoesnotmatch", "expiredtoken",
                       "invalidtoken", "unauthorized", "unable to locate")


def _subject(url: object, setting: str | None) -> str:
    return f"{setting}={url!r}" if setting else f"checkpoint URL {url!r}"


def open_storage(url: str, setting: str | None = None) -> CheckpointStorage:
    """Resolve ``url`` to a :class:`CheckpointStorage` without touching the network.

    Raises CheckpointSetupError for an empty URL, a URL with no bucket or path (``s3://``, ``file:///``, see
    :func:`~.storage.normalize_url`), an unknown scheme, or a scheme whose fsspec package (e.g. s3fs) is not
    installed; the message names the pip package.
    """
    subject = _subject(url, setting)
    try:
        normalize_url(url)
    except UnusableURL as e:
        raise CheckpointSetupError(subject, e.problem, e.fix) from None
    scheme = url_scheme(url)
    try:
        return CheckpointStorage(url)
    except ImportError as e:
        pkg = missing_package_for(scheme) or scheme
        raise CheckpointSetupError(subject, f"needs the package '{pkg}', which is not installed",
                                   f"pip install {pkg}") from e
    except ValueError as e:
        if "protocol not known" in str(e).lower():
            raise CheckpointSetupError(subject, f"has an unknown filesystem scheme '{scheme}://'", _SCHEMES_HINT) from e
        raise CheckpointSetupError(subject, f"cannot be parsed ({e})", _SCHEMES_HINT) from e


def preflight_storage(url: str, setting: str | None = LAUNCH_SETTING) -> CheckpointStorage:
    """Resolve ``url``, create its directory where directories exist, write and delete a probe file.

    Returns the storage on success. Raises CheckpointSetupError (exit 2) for: unknown scheme, missing
    package, missing bucket, missing or invalid credentials, not writable. Never creates a bucket. The
    message names ``setting`` (by default ``checkpoint.url``: this is ``orch launch``'s preflight), or with
    None the URL alone.
    """
    storage = open_storage(url, setting)
    scheme = url_scheme(url)
    probe = f".orch_probe_{uuid.uuid4().hex}"
    try:
        storage.makedirs()
        storage.write_bytes(probe, b"orch preflight probe\n")
        storage.remove_file(probe)
    except Exception as e:  # noqa: BLE001 - every failure here is turned into one user-facing line
        raise _classify(url, setting, scheme, storage, e) from e
    return storage


def _classify(url: str, setting: str | None, scheme: str, storage: CheckpointStorage,
              err: Exception) -> CheckpointSetupError:
    # s3fs turns S3 error codes into OSError subclasses with only the server's message; the code itself
    # (InvalidAccessKeyId, NoSuchBucket, ...) survives in the chained botocore ClientError.
    chain, cause = [], err
    while cause is not None and len(chain) < 5:
        chain.append(f"{type(cause).__name__} {cause}")
        cause = cause.__cause__ or cause.__context__
    text = " ".join(chain).lower()
    detail = f"{type(err).__name__}: {err}".replace("\n", " ")
    subject = _subject(url, setting)
    if not storage.is_local and any(m in text for m in _CREDENTIAL_MARKERS):
        fix = _CREDENTIAL_HINTS.get(scheme, "configure credentials for this storage")
        return CheckpointSetupError(subject, f"cannot be reached: missing or invalid credentials ({detail})", fix)
    if (not storage.is_local and isinstance(err, FileNotFoundError)) or "nosuchbucket" in text:
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        where = f"point {setting} at an existing one" if setting else "use a URL in an existing one"
        return CheckpointSetupError(subject, f"names a bucket that does not exist ({bucket})",
                                    f"create the bucket '{bucket}' or {where}")
    return CheckpointSetupError(subject, f"is not writable ({detail})",
                                "choose a location this process can write to, or fix its permissions")
