"""Notice sources: each answers "is this node about to be taken away?" from one place.

- ``aws``: EC2 spot ``instance-action`` through IMDSv2 (PUT a session token, then GET with it; 404 = none).
- ``gcp``: GCE metadata ``instance/preempted`` (``wait_for_change`` long-poll; body ``TRUE`` = preempted).
- ``azure``: Scheduled Events with an event of type ``Preempt``.
- ``chaos``: the agent's notice file ``<run dir>/notices/node<N>-<agent pid>.json``, written by
  ``orch chaos preempt`` (see notices.py).
``sigterm`` is a signal handler, not a poller: see watcher.py.

Endpoints come from config so tests serve them from small HTTP servers on 127.0.0.1.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Optional

from orchestrator.preemption.notices import AgentNotices, Notice

__all__ = ["Notice", "NoticeSource", "AWSSpotSource", "GCPPreemptedSource", "AzureScheduledEventsSource",
           "ChaosFileSource", "build_sources"]

HTTP_TIMEOUT_S = 2.0


class NoticeSource:
    """Polled from a background thread; ``poll()`` returns a Notice once the node is being preempted."""

    name = "base"

    def poll(self) -> Optional[Notice]:
        raise NotImplementedError


def _http(method: str, url: str, headers: dict[str, str], timeout: float = HTTP_TIMEOUT_S) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""


class AWSSpotSource(NoticeSource):
    """EC2 spot interruption notice (about 2 minutes ahead) through IMDSv2."""

    name = "aws"

    def __init__(self, endpoint: str):
        self.endpoint, self._token = endpoint.rstrip("/"), None

    def poll(self) -> Optional[Notice]:
        if self._token is None:
            status, body = _http("PUT", f"{self.endpoint}/latest/api/token",
                                 {"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
            if status != 200:
                return None
            self._token = body
        status, body = _http("GET", f"{self.endpoint}/latest/meta-data/spot/instance-action",
                             {"X-aws-ec2-metadata-token": self._token})
        if status == 401:  # the token expired: get a new one next time
            self._token = None
        if status == 200 and body:
            action = json.loads(body)
            return Notice(self.name, f"spot instance-action {action.get('action')} at {action.get('time')}")
        return None


class GCPPreemptedSource(NoticeSource):
    """GCE preemption (about 30 seconds ahead): ``instance/preempted`` turns ``TRUE``."""

    name = "gcp"

    def __init__(self, endpoint: str, wait_s: float):
        self.endpoint, self.wait_s = endpoint.rstrip("/"), wait_s

    def poll(self) -> Optional[Notice]:
        wait = max(1, int(self.wait_s))
        status, body = _http("GET", f"{self.endpoint}/computeMetadata/v1/instance/preempted"
                                    f"?wait_for_change=true&timeout_sec={wait}",
                             {"Metadata-Flavor": "Google"}, timeout=wait + HTTP_TIMEOUT_S)
        if status == 200 and body.strip().upper() == "TRUE":
            return Notice(self.name, "instance/preempted is TRUE")
        return None


class AzureScheduledEventsSource(NoticeSource):
    """Azure spot eviction (at least 30 seconds ahead): a Scheduled Event of type Preempt."""

    name = "azure"

    def __init__(self, endpoint: str):
        self.endpoint = endpoint.rstrip("/")

    def poll(self) -> Optional[Notice]:
        status, body = _http("GET", f"{self.endpoint}/metadata/scheduledevents?api-version=2020-07-01",
                             {"Metadata": "true"})
        if status != 200 or not body:
            return None
        for event in json.loads(body).get("Events", []):
            if event.get("EventType") == "Preempt":
                return Notice(self.name, f"Scheduled Event {event.get('EventId')} Preempt, "
                                         f"not before {event.get('NotBefore')}")
        return None


class ChaosFileSource(NoticeSource):
    """The drill source: the notice file ``orch chaos preempt`` writes for this worker's agent (its parent
    process; a replacement agent of the same node index has another PID and never sees it). Only ``chaos``
    notices: a ``sigterm`` notice comes with its SIGTERM, which the watcher handles."""

    name = "chaos"

    def __init__(self, run_dir: str, node: int):
        self.notices = AgentNotices.of_parent(run_dir, node, {self.name})
        self.path = self.notices.path

    def poll(self) -> Optional[Notice]:
        return self.notices.read()


def build_sources(names: list[str], cfg, run_dir: str, node: int) -> list[NoticeSource]:
    """The pollable sources among ``names`` (``sigterm`` is installed by the watcher as a handler).

    An endpoint may contain ``{node}``: simulated nodes sharing one machine then each get their own
    metadata service (drills, tests); real nodes each have their own at the fixed address.
    """
    def endpoint(url: str) -> str:
        return url.replace("{node}", str(node))

    makers = {
        "aws": lambda: AWSSpotSource(endpoint(cfg.aws_endpoint)),
        "gcp": lambda: GCPPreemptedSource(endpoint(cfg.gcp_endpoint), cfg.poll_interval_s),
        "azure": lambda: AzureScheduledEventsSource(endpoint(cfg.azure_endpoint)),
        "chaos": lambda: ChaosFileSource(run_dir, node),
    }
    return [makers[name]() for name in names if name in makers]
