"""``fault_tolerance.mode=per_step`` in Kubernetes: ``orch k8s render`` adds the quorum service (orch's
Lighthouse: ``orch quorum-service``) beside the store as a NetworkPolicy, a Service and a Deployment, gated by the
run's Secret (a reference only), with the security defaults of the store's pod; every node pod dials it
(``fault_tolerance.quorum_endpoint``). A pod's launch waits for it, drops its own exited agent's group there, and
the standalone service takes a group whose heartbeat connection closed out of the next quorum at once. Fast:
renders, threads and a gate in this process (the pods themselves: tests/test_k8s_pods.py)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from k8s_validation import assert_render_refused, pod_templates, validate_all
from orchestrator.cli import main as orch_main
from orchestrator.config.compose import compose_config
from orchestrator.errors import ConfigError, RunFailed
from orchestrator.ft.quorum import ROUTE, QuorumService
from orchestrator.k8s import render
from orchestrator.k8s.security import container_security_context, pod_security_context
from orchestrator.rundir import read_jsonl
from orchestrator.trust.secret import RUN_SECRET_ENV
from orchproc import ORCH, orch_env, wait_for

pytestmark = pytest.mark.timeout(120)

PER_STEP = ["job", "jobset", "trainjob", "pytorchjob"]  # formats whose pods run orch's store and quorum service
SENTINEL = "d0-not-render-me-" + "5e" * 16  # the render's own environment's secret: never in a manifest
BASE = ["fault_tolerance.mode=per_step", "checkpoint.url=s3://bucket/run", "run.id=q1"]
SPOT = ["++k8s.spot_node_selector={cloud.google.com/gke-spot:true}",
        "k8s.spot_tolerations=[{key:cloud.google.com/gke-spot,operator:Equal,value:true,effect:NoSchedule}]",
        "++k8s.node_selector={pool:regular}"]


def rendered(fmt: str, *extra: str):
    return render("cpu_elastic", [*BASE, *extra], fmt)


def component(objs: list[dict], kind: str, name: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and o["metadata"]["labels"]["app.kubernetes.io/component"] == name]


def containers(objs: list[dict]) -> dict[str, dict]:
    """Every container of every pod template, by name (store, quorum, trainer/node/pytorch)."""
    return {c["name"]: c for o in objs for t in pod_templates(o) for c in t["spec"]["containers"]}


@pytest.mark.parametrize("fmt", PER_STEP)
def test_per_step_renders_a_gated_quorum_service_beside_the_store_and_it_validates(monkeypatch, fmt):
    monkeypatch.setenv(RUN_SECRET_ENV, SENTINEL)
    result = rendered(fmt, *SPOT)
    objs = result.objects
    validate_all(objs)
    (policy,) = component(objs, "NetworkPolicy", "quorum-service")
    (service,) = component(objs, "Service", "quorum-service")
    (deployment,) = component(objs, "Deployment", "quorum-service")
    assert policy["metadata"]["name"] == service["metadata"]["name"] == deployment["metadata"]["name"] == "orch-q1-quorum"
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert service["spec"]["ports"] == [{"name": "quorum", "port": 29401, "targetPort": 29401, "protocol": "TCP"}]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"] == policy["spec"]["podSelector"]["matchLabels"]

    # Admitted: the run's own pods, on the quorum port only.
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "orch-q1"}}}],
                                          "ports": [{"protocol": "TCP", "port": 29401}]}]

    # Gated by the store's own Secret, as a reference; the quorum rules are the config's.
    by_name = containers(objs)
    quorum, store = by_name["quorum"], by_name["store"]
    secret_ref = {"name": RUN_SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": "orch-q1-run-secret", "key": "secret"}}}
    assert quorum["env"] == [secret_ref] and secret_ref in store["env"]
    assert quorum["command"] == ["orch"] and quorum["args"] == [
        "quorum-service", "--port", "29401", "--min-replicas", "1", "--join-timeout-ms", "1000",
        "--quorum-tick-ms", "50", "--heartbeat-timeout-ms", "1000"]
    assert quorum["readinessProbe"] == {"tcpSocket": {"port": 29401}, "periodSeconds": 2}
    text = result.text()
    assert SENTINEL not in text and "The rendezvous store and the quorum service admit only holders" in text
    assert result.secret_command.startswith("kubectl create secret generic orch-q1-run-secret ")

    # The store's security defaults; never placed on spot capacity (its state is in memory).
    spec = deployment["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"] == pod_security_context()
    assert quorum["securityContext"] == container_security_context()
    assert spec["nodeSelector"] == {"pool": "regular"} and "tolerations" not in spec

    # Every node pod dials it, under the same run id, and gets the same Secret.
    (node,) = [c for name, c in by_name.items() if name not in ("store", "quorum")]
    assert "fault_tolerance.quorum_endpoint=orch-q1-quorum:29401" in node["args"]
    assert "fault_tolerance.mode=per_step" in node["args"] and secret_ref in node["env"]


@pytest.mark.parametrize("fmt", [*PER_STEP, "rayjob"])
def test_restart_mode_and_rayjob_render_no_quorum_service(fmt):
    """restart mode needs none; rayjob's driver on the Ray head hosts its own, as ``orch launch`` does."""
    restart = render("cpu_elastic", ["checkpoint.url=s3://bucket/run", "run.id=q1"], fmt).text()
    assert "quorum" not in restart
    if fmt == "rayjob":
        result = rendered(fmt)
        assert not [o for o in result.objects if "quorum" in o["metadata"]["name"]]
        assert "quorum_endpoint" not in result.text() and "quorum-service" not in result.text()


def test_the_quorum_port_is_a_setting_of_its_own():
    objs = rendered("jobset", "k8s.quorum_port=31000", "rendezvous.port=31000").objects
    validate_all(objs)
    (service,) = component(objs, "Service", "quorum-service")
    assert service["spec"]["ports"][0]["port"] == 31000  # its own Service: the store's port number may be the same
    assert "fault_tolerance.quorum_endpoint=orch-q1-quorum:31000" in containers(objs)["trainer"]["args"]


def test_the_issues_command_renders_a_gated_lighthouse_that_validates(capsys):
    assert orch_main(["k8s", "render", "conf=cpu_elastic", "fault_tolerance.mode=per_step",
                      "checkpoint.url=s3://bucket/run"]) == 0
    out, err = capsys.readouterr()
    docs = [d for d in yaml.safe_load_all(out) if d]
    validate_all(docs)
    (deployment,) = component(docs, "Deployment", "quorum-service")
    (env,) = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env["valueFrom"]["secretKeyRef"]["key"] == "secret" and "value" not in env
    assert re.search(r"^#   kubectl create secret generic orch-cpu-elastic-[0-9a-f]{6}-run-secret ", out, re.M)
    assert err == ""


@pytest.mark.parametrize("args, words", [
    (["k8s.run_secret=''"], ["k8s.run_secret='' leaves the run without a secret",
                             "Fix: drop k8s.run_secret=''"]),
    (["k8s.quorum_port=0"], ["k8s.quorum_port=0 is invalid", "Fix: use a TCP port"]),
    (["fault_tolerance.quorum_endpoint=nowhere"], ["fault_tolerance.quorum_endpoint='nowhere' has no port", "Fix:"]),
])
def test_bad_per_step_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, args, words):
    assert_render_refused(tmp_path, capsys, ["conf=cpu_elastic", *BASE, *args], words)


# -- a pod's launch ---------------------------------------------------------------------------------------

POD = ["launcher=local", "cluster.node_index=1", "rendezvous.external=true", "rendezvous.host=orch-q1-rdzv",
       "rendezvous.port=29400", "run.id=q1", "fault_tolerance.mode=per_step", "checkpoint.url=s3://b/c"]


def test_a_per_step_pod_needs_a_quorum_endpoint_and_the_plan_points_its_agent_there(capsys, monkeypatch):
    with pytest.raises(ConfigError, match=re.escape("fault_tolerance.quorum_endpoint=None is unset, but under "
                                                    "fault_tolerance.mode=per_step a pod")):
        compose_config("cpu_elastic", POD)
    monkeypatch.setenv("PET_LOCAL_ADDR", "10.4.0.17")  # the pod IP, as the manifests give it
    assert orch_main(["launch", "conf=cpu_elastic", *POD, "fault_tolerance.quorum_endpoint=orch-q1-quorum:29401",
                      "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "ORCH_FT_QUORUM=orch-q1-quorum:29401" in plan and "ORCH_FT_ADDR=10.4.0.17" in plan
    assert "quorum_endpoint=orch-q1-quorum:29401" in plan


def gated_service(tmp_path: Path, secret: str, **kwargs) -> tuple[QuorumService, object]:
    from orchestrator.trust.acceptor import listening_socket
    from orchestrator.trust.gate import Gate

    svc = QuorumService(1, 60_000, quorum_tick_ms=10, heartbeat_timeout_ms=1000, clock=lambda: 1000.0, **kwargs)
    return svc, Gate(listening_socket("127.0.0.1"), secret, {ROUTE: svc.handler}.get)


def test_a_pods_launch_waits_for_the_quorum_service_and_drops_its_exited_agents_group_there(tmp_path, monkeypatch):
    from orchestrator.ft.driver import RemoteQuorum
    from orchestrator.rundir import EventLog

    events = EventLog(str(tmp_path))
    monkeypatch.delenv(RUN_SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"{RUN_SECRET_ENV} is not set"):
        RemoteQuorum("127.0.0.1:1", events, 0.1)
    monkeypatch.setenv(RUN_SECRET_ENV, "s3cret")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with pytest.raises(RunFailed, match=rf"quorum service at 127.0.0.1:{free} did not answer within 1 s"):
        RemoteQuorum(f"127.0.0.1:{free}", events, 1.0)

    told: list[tuple[str, str]] = []
    svc, gate = gated_service(tmp_path, "s3cret", on_drop=lambda rid, cause: told.append((rid, cause)))
    try:
        endpoint = f"127.0.0.1:{gate.port}"
        remote = RemoteQuorum(endpoint, events, 5.0)
        svc.call({"op": "register", "replica_id": "node1-a0:u", "world_size": 1})
        remote.drop("node1-a0")
        dropped = wait_for(lambda: [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "replica_dropped"],
                           10, "the replica_dropped event")
        assert [(e["replica_id"], e["cause"]) for e in dropped] == told == [("node1-a0:u", "agent_exited")]
        remote.close()
        monkeypatch.setenv(RUN_SECRET_ENV, "another run's")
        with pytest.raises(ConfigError, match="did not admit this launch"):
            RemoteQuorum(endpoint, events, 5.0)
    finally:
        gate.close()
        svc.close()


@pytest.mark.parametrize("silence", [True, False])
def test_the_standalone_service_drops_a_group_whose_heartbeat_connection_closed(tmp_path, silence):
    """The clock stands still, so no heartbeat ages out: only the closed connection (a pod killed whole) can form
    the survivor's quorum, and only in the standalone service (``disconnect_is_silence``; the launch's own service
    hears of an agent's exit from the controller). A group that still beats is back at its next beat."""
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.ft.coordination import QuorumClient

    told: list[tuple[str, str]] = []
    svc, gate = gated_service(tmp_path, "s3cret", disconnect_is_silence=silence,
                              on_drop=lambda rid, cause: told.append((rid, cause)))
    ask = {"op": "quorum", "group_rank": 0, "timeout_s": 3.0, "checkpoint_metadata": "m", "shrink_only": False,
           "init_sync": True, "commit_failures": 0, "reconfigure_handle": "h"}
    try:
        gone = QuorumClient(f"127.0.0.1:{gate.port}", "s3cret")
        for rid in ("node0-a0:u", "node1-a0:v"):
            svc.call({"op": "register", "replica_id": rid, "world_size": 1})
        gone.call("heartbeat", replica_id="node1-a0:v")
        with ThreadPoolExecutor(2) as pool:
            first = [pool.submit(svc.call, {**ask, "replica_id": rid, "step": 3}) for rid in ("node0-a0:u", "node1-a0:v")]
            assert {f.result(timeout=5)["replica_world_size"] for f in first} == {2}
            survivor = pool.submit(svc.call, {**ask, "replica_id": "node0-a0:u", "step": 4,
                                               "timeout_s": 3.0 if silence else 1.0})
            time.sleep(0.2)
            assert not survivor.done(), "the other group is healthy: the quorum waits for it"
            gone.close()  # its process died: the kernel closed its connection
            answer = survivor.result(timeout=5)
        if silence:
            assert answer["replica_world_size"] == 1 and told == [("node1-a0:v", "disconnected")]
            back = QuorumClient(f"127.0.0.1:{gate.port}", "s3cret")
            back.call("heartbeat", replica_id="node1-a0:v")  # not dropped for good: it beats, it is healthy
            assert "node1-a0:v" in svc._healthy(1000.0)
            back.close()
        else:
            assert "error" in answer and told == []
    finally:
        gate.close()
        svc.close()


def test_the_quorum_service_refuses_to_start_without_the_runs_secret(capsys, monkeypatch):
    monkeypatch.delenv(RUN_SECRET_ENV, raising=False)
    assert orch_main(["quorum-service", "--port", "0", "--host", "127.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{RUN_SECRET_ENV}=None is not set" in err and "Fix:" in err


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_quorum_service_subcommand_admits_only_the_runs_secret_and_stops_on_sigterm(tmp_path):
    from orchestrator.ft.coordination import QuorumClient
    from orchestrator.trust.handshake import HandshakeError

    secret, log = "q-" + "ab" * 16, tmp_path / "quorum.log"
    proc = subprocess.Popen([*ORCH, "quorum-service", "--port", "0", "--host", "127.0.0.1", "--min-replicas", "2"],
                            env=orch_env({RUN_SECRET_ENV: secret}), stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        found = wait_for(lambda: re.search(r"quorum service listening on 127.0.0.1 port (\d+)", log.read_text())
                         or proc.poll() is not None, 45, "the quorum service to listen")
        assert isinstance(found, re.Match), log.read_text()
        endpoint = f"127.0.0.1:{found.group(1)}"
        assert QuorumClient(endpoint, secret).call("ping") == {}
        with pytest.raises(HandshakeError):
            QuorumClient(endpoint, "a guess").call("ping")
        client = QuorumClient(endpoint, secret)
        client.call("register", replica_id="node0-a0:u", world_size=1)
        client.call("heartbeat", replica_id="node0-a0:u")
        client.close()  # its heartbeat connection closed: the service says so
        wait_for(lambda: "replica node0-a0:u dropped (disconnected)" in log.read_text(), 10, "the drop's log line")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "min_replicas=2" in log.read_text() and "quorum service stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert secret not in log.read_text()
