"""Shape checks of the ``k8s`` group's maps and lists (labels, secrets, volumes, ...), run where the config is
composed. Kubernetes' schemas type these as plain strings, so an API server would accept or mangle what
these rules refuse: better one clear line here than a pod that never starts. ``check_env`` and
``check_rendered_values`` are the exception, run by ``orch k8s render`` only: a credential in ``k8s.env`` or in
an override's URL is harmless until it is written into a manifest (its args, env or header comment)."""

from __future__ import annotations

import re
from typing import Any

from orchestrator.errors import ConfigError

QUANTITY = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[mkMGTPE])?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_NAME = r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# Names and values that are credentials: they belong in a Secret, never in a manifest someone commits.
SECRET_NAME = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIALS?)(_|$)", re.I)
SECRET_VALUE = re.compile(r"^(hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_|glpat-|(AKIA|ASIA)[0-9A-Z]{16}"
                          r"|sk-[A-Za-z0-9_-]{20,}|xox[abpr]-|-----BEGIN )")
# A credential inside a URL: ``scheme://user:password@`` (the user may be empty, the password may hold '/', but
# ``host:8080/path@x`` is a port, not a password) or ``scheme://token@``.
URL_CREDENTIAL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?:[^/\s@:'\"]*:(?!\d*(?:/|$))[^\s@'\"]*"
                            r"|[^/\s@:'\"\[\]{},]+)@")
VOLUME_KEYS = {"name", "mount_path", "claim", "size", "read_only"}
RESERVED_MOUNTS = ("/dev/shm", "/tmp", "/workspace", "/runs")


def _require(key: str, value: Any, ok: bool, fix: str, problem: str = "is invalid") -> None:
    if not ok:
        raise ConfigError(key, value, fix, problem)


def _match(pattern: str, value: Any) -> bool:
    # fullmatch: ``$`` alone would let a trailing newline through (``re.match("^a$", "a\\n")`` matches)
    return isinstance(value, str) and re.fullmatch(pattern, value) is not None


def check_dns_name(key: str, value: Any) -> None:
    _require(key, value, _match(DNS_SUBDOMAIN, value) and len(value) <= 253,
             "use lower-case letters, digits, '-' and '.', starting and ending alphanumeric")


def check_labels(key: str, labels: dict, values_are_labels: bool = True) -> None:
    """Label (and annotation) keys are ``[prefix/]name``; label values at most 63 characters of [-_.A-Za-z0-9]."""
    for name, value in labels.items():
        prefix, _, short = str(name).rpartition("/")
        _require(f"{key}.{name}", value, (not prefix or _match(DNS_SUBDOMAIN, prefix)) and _match(LABEL_NAME, short)
                 and len(short) <= 63, "use a key of the form [dns.prefix/]name (name: at most 63 of A-Z a-z 0-9 - _ .)",
                 "has an invalid key")
        if values_are_labels:
            _require(f"{key}.{name}", value, _match(LABEL_VALUE, str(value)) and len(str(value)) <= 63,
                     "use at most 63 of A-Z a-z 0-9 - _ ., starting and ending alphanumeric")


def check_env(env: dict) -> None:
    """Plain variables only: a credential in ``k8s.env`` (by its name, its shape, or inside a URL) would be
    written into the manifest in clear text."""
    for name, value in env.items():
        _require(f"k8s.env.{name}", value, _match(ENV_NAME, str(name)), "use letters, digits, '_', '-' and '.'",
                 "has an invalid variable name")
        text = "" if value is None else str(value)
        if text and (SECRET_NAME.search(str(name)) or SECRET_VALUE.match(text)):
            raise ConfigError(f"k8s.env.{name}", f"<redacted, {len(text)} chars>", _env_secret_fix(str(name)),
                              "looks like a credential, which would be written into the manifest in plain text")
        check_url_credentials(f"k8s.env.{name}", text)


def _env_secret_fix(name: str) -> str:
    return (f"put it in a Secret (kubectl create secret generic NAME --from-literal={name}=...) and refer to it: "
            f"+k8s.secrets.{name}=NAME (or NAME/KEY); drop k8s.env.{name}")


def check_url_credentials(key: str, text: str) -> None:
    """No ``scheme://user:password@`` or ``scheme://token@`` inside ``text`` (the value of ``key``); the error
    shows the value with the credential cut out, never the credential."""
    if not URL_CREDENTIAL.search(text):
        return
    env = key.removeprefix("k8s.env.") if key.startswith("k8s.env.") else None
    fix = _env_secret_fix(env) if env else (
        "take the credential out of the URL and give it to the pods from a Secret: k8s.checkpoint_secret (its keys "
        "become environment variables, e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for s3://) or "
        "+k8s.secrets.VAR=SECRET (or SECRET/KEY)")
    raise ConfigError(key, redact_url_credentials(text), fix, "holds a credential inside a URL, which would be "
                      "written into the manifest in plain text")


def redact_url_credentials(text: str) -> str:
    return URL_CREDENTIAL.sub(lambda m: f"{m.group('scheme')}://<redacted>@", text)


def check_rendered_values(overrides: list, k8s: Any) -> None:
    """What ``orch k8s render`` writes as text besides the k8s objects' own fields: every override (the pods'
    args and the header's command) and the free-text ``k8s`` values (env, annotations, image, tolerations)."""
    check_env(k8s.env)
    for override in overrides:
        key, _, value = str(override).lstrip("+~").partition("=")
        check_url_credentials(key, value)
    values = [("k8s.image", k8s.image), *((f"k8s.annotations.{k}", v) for k, v in k8s.annotations.items()),
              *((f"k8s.tolerations[{i}]", t) for i, t in enumerate(k8s.tolerations)),
              *((f"k8s.spot_tolerations[{i}]", t) for i, t in enumerate(k8s.spot_tolerations))]
    for key, value in values:
        check_url_credentials(key, str(value))


def check_secrets(secrets: dict) -> None:
    """``{ENV_NAME: "secret"}`` (key = ENV_NAME) or ``{ENV_NAME: "secret/key"}``: env from a Secret reference."""
    for name, ref in secrets.items():
        key = f"k8s.secrets.{name}"
        _require(key, ref, _match(ENV_NAME, str(name)), "use letters, digits, '_', '-' and '.'",
                 "has an invalid variable name")
        _require(key, ref, _secret_ref_ok(str(ref)),
                 "name a Secret, and optionally its key: SECRET or SECRET/KEY (default key: the variable's name)")


def check_run_secret(ref: Any) -> None:
    """``k8s.run_secret``: ``None`` (a Secret named after the job), ``''`` (off), or the Secret holding the run's
    secret, ``NAME`` or ``NAME/KEY``."""
    _require("k8s.run_secret", ref, ref is None or ref == "" or (
        isinstance(ref, str) and _secret_ref_ok(ref) and len(ref.partition("/")[0]) <= 253),
             "name a Secret you created, NAME (key 'secret') or NAME/KEY, e.g. k8s.run_secret=orch-run-secret "
             "(lower-case letters, digits, '-' and '.'), or null for <job name>-run-secret")


def check_resource_name(key: str, value: Any) -> None:
    """An extended resource name, ``[prefix/]name`` like ``nvidia.com/gpu``."""
    prefix, _, short = str(value).rpartition("/")
    _require(key, value, isinstance(value, str) and (not prefix or _match(DNS_SUBDOMAIN, prefix))
             and _match(LABEL_NAME, short) and len(short) <= 63,
             "use a resource name of the form [dns.prefix/]name, e.g. nvidia.com/gpu or amd.com/gpu")


def _secret_ref_ok(ref: str) -> bool:
    """``SECRET`` or ``SECRET/KEY``: a Secret's name, and optionally a key in it."""
    secret, slash, item = ref.partition("/")
    return _match(DNS_SUBDOMAIN, secret) and (not slash or _match(r"^[-._a-zA-Z0-9]+$", item))


def check_volumes(volumes: list) -> None:
    """``[{name, mount_path, claim: PVC | null (emptyDir), size, read_only}]``."""
    names = set()
    for i, v in enumerate(volumes):
        key = f"k8s.volumes[{i}]"
        fix = "give each volume as {name: data, mount_path: /data, claim: PVC-NAME} (no claim: an emptyDir; size, read_only optional)"
        _require(key, v, isinstance(v, dict) and {"name", "mount_path"} <= set(v) and set(v) <= VOLUME_KEYS, fix)
        _require(f"{key}.name", v["name"], _match(DNS_LABEL, v["name"]) and len(v["name"]) <= 63 and v["name"] not in names,
                 "use a unique DNS label (lower-case letters, digits, '-')")
        names.add(v["name"])
        path = str(v["mount_path"])
        _require(f"{key}.mount_path", path, path.startswith("/") and not any(
            path == r or path.startswith(r + "/") or r.startswith(path.rstrip("/") + "/") for r in RESERVED_MOUNTS),
            f"use an absolute path outside {', '.join(RESERVED_MOUNTS)} (orch mounts those itself)")
        if v.get("claim") is not None:
            check_dns_name(f"{key}.claim", v["claim"])
        if v.get("size") is not None:
            _require(f"{key}.size", v["size"], _match(QUANTITY, str(v["size"])), "use a Kubernetes quantity, e.g. 10Gi")

