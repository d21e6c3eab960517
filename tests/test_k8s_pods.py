"""The rendered ``job`` and ``jobset`` manifests, run as a kubelet would run their pods, with local processes
standing in for pods: the store's pod (the Deployment's, or the JobSet's ``rdzv`` job's), then one pod per index
of the node Job. Each pod's container command and args run with
that pod's environment (env, envFrom Secrets, downward-API fields, ``$(VAR)`` expansion), in a directory of its
own (its filesystem). Checkpoints go to S3 (moto's server), which every pod reaches, as in a cluster.

Service DNS: /etc/hosts is not ours to edit, so the emulated kubelet resolves a Service's DNS name (or a JobSet
pod's hostname) where it stands as a value (``rendezvous.host=<service>`` or ``...=<service>:<port>`` in args, or
an env value) to 127.0.0.1,
the address every emulated pod has. An emptyDir's mount path standing as an env value (``HOME=/tmp``) becomes
a directory of the pod's own. Ports are picked free at run time and rendered into the manifests.
"""

from __future__ import annotations

import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import psutil
import pytest

from orchestrator.cli import main as orch_main
from orchestrator.config.compose import compose_config
from orchestrator.errors import ConfigError
from orchestrator.k8s import render
from orchestrator.processes import kill_tree
from orchproc import orch_env, read_jsonl, stop_tree, wait_for

POD_IP = "127.0.0.1"
NAMESPACE = "default"
CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                   "AWS_DEFAULT_REGION")
FIELD_REF = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    try:
        socket.create_connection((POD_IP, port), timeout=1).close()
        return True
    except OSError:
        return False


class Pod:
    """One emulated pod: its container's process, its log and its own directory."""

    def __init__(self, name: str, proc: subprocess.Popen, workdir: Path, grace_s: int):
        self.name, self.proc, self.workdir, self.grace_s = name, proc, workdir, grace_s

    @property
    def pid(self) -> int:
        return self.proc.pid

    def terminate(self) -> None:
        """What the kubelet does first when a pod is deleted or its node drains: SIGTERM to PID 1."""
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> Optional[int]:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, chars: int = 3000) -> str:
        return f"--- {self.name} ---\n" + (self.workdir / "pod.log").read_text()[-chars:]


class Kubelet:
    """Runs pod templates of a set of rendered objects as local processes (see the module docstring)."""

    def __init__(self, objects: list[dict[str, Any]], secrets: dict[str, dict[str, str]], root: Path):
        self.secrets, self.root, self.pods = secrets, root, []
        hosts = [o["metadata"]["name"] for o in objects if o["kind"] == "Service"]
        for js in (o for o in objects if o["kind"] == "JobSet"):  # <jobset>-<job>-<job index>-<pod index>.<jobset>
            name = js["metadata"]["name"]
            hosts += [f"{name}-{rj['name']}-{j}-{p}.{name}" for rj in js["spec"]["replicatedJobs"]
                      for j in range(rj["replicas"]) for p in range(rj["template"]["spec"]["parallelism"])]
        self.dns = {f"{h}{suffix}" for h in hosts for suffix in ("", f".{NAMESPACE}", f".{NAMESPACE}.svc",
                                                                  f".{NAMESPACE}.svc.cluster.local")}

    def run(self, template: dict[str, Any], name: str, index: Optional[int] = None) -> Pod:
        labels = dict(template["metadata"].get("labels", {}))
        annotations = {}
        if index is not None:  # what the Job controller adds to the pods of an Indexed Job
            labels["batch.kubernetes.io/job-completion-index"] = annotations[
                "batch.kubernetes.io/job-completion-index"] = str(index)
        meta = {"name": name, "labels": labels, "annotations": annotations}
        (container,) = template["spec"]["containers"]
        workdir = self.root / name
        workdir.mkdir(parents=True)
        empty_dirs = {v["name"] for v in template["spec"].get("volumes", []) if "emptyDir" in v}
        mounts = {m["mountPath"]: workdir / m["name"] for m in container.get("volumeMounts", []) if m["name"] in empty_dirs}
        for path in mounts.values():
            path.mkdir(exist_ok=True)
        env = {k: str(mounts.get(v, v)) for k, v in self.container_env(container, meta).items()}
        if index is not None:
            env.setdefault("JOB_COMPLETION_INDEX", str(index))
        argv = [self.resolve(expand(a, env)) for a in [*container.get("command", []), *container.get("args", [])]]
        assert argv[0] == "orch", argv  # the image's orch, here this checkout's
        base = {k: v for k, v in orch_env().items() if k not in CREDENTIAL_VARS}  # credentials come from the Secret
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *argv[1:]], cwd=workdir,
                                env={**base, **env}, stdout=(workdir / "pod.log").open("w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        pod = Pod(name, proc, workdir, template["spec"].get("terminationGracePeriodSeconds", 30))
        self.pods.append(pod)
        return pod

    def container_env(self, container: dict[str, Any], meta: dict[str, Any]) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(self.secrets[source["secretRef"]["name"]])
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = self.resolve(expand(var["value"], env))
                continue
            ref = var["valueFrom"]
            if "secretKeyRef" in ref:
                env[var["name"]] = self.secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
            else:
                env[var["name"]] = field_value(ref["fieldRef"]["fieldPath"], meta)
        return env

    def resolve(self, value: str) -> str:
        """A Service's DNS name standing as a value (``key=<name>``, ``key=<name>:<port>`` or the whole value) ->
        the pods' address."""
        key, eq, rest = value.rpartition("=")
        host, colon, port = rest.rpartition(":") if rest.rpartition(":")[2].isdigit() else (rest, "", "")
        if host in self.dns:
            return f"{key}{eq}{POD_IP}{colon}{port}"
        return value

    def events(self, name: str) -> list[dict[str, Any]]:
        """``name`` events from every pod's run dir, in time order (rank 0 may live in any pod)."""
        found = [e for path in self.root.glob("*/runs/*/*/events.jsonl") for e in read_jsonl(path)
                 if e["event"] == name]
        return sorted(found, key=lambda e: e["t"])

    def stop_all(self) -> None:
        for pod in self.pods:
            stop_tree(pod.pid)


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables are replaced, others left as written."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def field_value(path: str, meta: dict[str, Any]) -> str:
    if path == "status.podIP":
        return POD_IP
    if path in ("metadata.name", "metadata.namespace"):
        return meta["name"] if path == "metadata.name" else NAMESPACE
    match = FIELD_REF.fullmatch(path)
    assert match, f"the emulated kubelet does not know fieldRef {path}"
    return meta[match.group(1)][match.group(2)]


def of_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


def deployment_template(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    """The pod template of the Deployment of ``component`` (``rendezvous-store``, ``quorum-service``)."""
    (obj,) = [o for o in objects if o["kind"] == "Deployment"
              and o["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return obj["spec"]["template"]


def store_and_node_job(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The store's pod template and the node Job's spec, in either layout."""
    if any(o["kind"] == "JobSet" for o in objects):
        store, node = of_kind(objects, "JobSet")["spec"]["replicatedJobs"]
        return store["template"]["spec"]["template"], node["template"]["spec"]
    return deployment_template(objects, "rendezvous-store"), of_kind(objects, "Job")["spec"]


def run_secret_of(template: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The Secret the header says to create (``<job name>-run-secret``, key ``secret``), with a fresh value, as
    ``kubectl create secret`` would make it: the store (and quorum service) are gated by default."""
    (gate,) = [e["valueFrom"]["secretKeyRef"] for e in template["spec"]["containers"][0]["env"]
               if e["name"] == "ORCH_RUN_SECRET"]
    return {gate["name"]: {gate["key"]: secrets.token_hex(32)}}


def s3_secret(endpoint: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_ENDPOINT_URL": endpoint,
            "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("fmt", ["job", "jobset"])
def test_job_pods_train_checkpoint_on_sigterm_and_the_recreated_pod_resumes(tmp_path, s3_env, s3_bucket, fmt):
    port, steps = free_port(), 200
    objects = render("cpu_gloo", [f"checkpoint.url=s3://{s3_bucket}/cpu_gloo", f"rendezvous.port={port}",
                                  f"trainer.max_steps={steps}", "trainer.log_every=20", "checkpoint.every_n_steps=0"],
                     fmt).objects
    store_template, job = store_and_node_job(objects)
    kubelet = Kubelet(objects, {"orch-checkpoint-credentials": s3_secret(s3_env), **run_secret_of(store_template)},
                      tmp_path / "pods")
    template, nodes = job["template"], job["parallelism"]
    grace = template["spec"]["terminationGracePeriodSeconds"]
    try:
        store = kubelet.run(store_template, "orch-cpu-gloo-rdzv-x1")
        wait_for(lambda: port_open(port) or store.proc.poll() is not None, 60, "the store pod's readiness (tcp)")
        assert store.proc.poll() is None, store.log_tail()
        trainers = {i: kubelet.run(template, f"orch-cpu-gloo-{i}-a0", index=i) for i in range(nodes)}
        wait_for(lambda: kubelet.events("first_step") or any(p.proc.poll() is not None for p in trainers.values()),
                 240, "the first training step")
        assert kubelet.events("first_step"), "\n".join(p.log_tail() for p in trainers.values())
        listeners = {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert listeners == {store.pid}, "only the store pod hosts rendezvous"

        sigterm_t = time.time()
        trainers[1].terminate()
        assert trainers[1].wait(grace) == 75, trainers[1].log_tail()  # within terminationGracePeriodSeconds
        (saved,) = kubelet.events("emergency_checkpoint")
        assert saved["t"] - sigterm_t < grace and 0 < saved["step"] < steps
        assert any(e["node"] == 1 and e["source"] == "sigterm" for e in kubelet.events("preemption_notice"))

        # Exit 75 is ignored by the podFailurePolicy: the Job recreates the pod of that index, which resumes.
        trainers[1] = kubelet.run(template, "orch-cpu-gloo-1-a1", index=1)
        for pod in trainers.values():
            assert pod.wait(240) == 0, "\n".join(p.log_tail() for p in trainers.values())
        resumed = [e for e in kubelet.events("checkpoint_loaded") if e["t"] > sigterm_t]
        assert resumed and resumed[0]["step"] == saved["step"]
        assert kubelet.events("training_finished")[-1]["steps_completed"] == steps

        store.terminate()  # the store leaves cleanly when its Deployment is deleted
        assert store.wait(30) == 0, store.log_tail()
    finally:
        kubelet.stop_all()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_per_step_pods_survive_a_pod_kill_and_the_recreated_pod_heals_from_its_peer(tmp_path, s3_env, s3_bucket):
    """fault_tolerance.mode=per_step in the job format: the store's and the quorum service's Deployments, two node
    pods, each a replica group. SIGKILL one pod whole (a node lost with it: nothing is told, its heartbeats stop):
    the other keeps training with no restart; the recreated pod heals from its peer, not from storage."""
    port, qport = free_port(), free_port()
    objects = render("cpu_elastic", ["fault_tolerance.mode=per_step", f"checkpoint.url=s3://{s3_bucket}/per_step",
                                     f"rendezvous.port={port}", f"k8s.quorum_port={qport}", "cluster.nnodes=1:2",
                                     "trainer.max_steps=100000", "checkpoint.every_n_steps=0"], "job").objects
    store_template, job = store_and_node_job(objects)
    quorum_template = deployment_template(objects, "quorum-service")
    kubelet = Kubelet(objects, {"orch-checkpoint-credentials": s3_secret(s3_env), **run_secret_of(store_template)},
                      tmp_path / "pods")
    template = job["template"]
    try:
        services = [kubelet.run(store_template, "orch-rdzv-x1"), kubelet.run(quorum_template, "orch-quorum-x1")]
        for pod, p in zip(services, (port, qport)):
            wait_for(lambda: port_open(p) or pod.proc.poll() is not None, 60, f"{pod.name}'s readiness (tcp)")
            assert pod.proc.poll() is None, pod.log_tail()
        trainers = {i: kubelet.run(template, f"orch-{i}-a0", index=i) for i in range(2)}
        logs = lambda: "\n".join(p.log_tail() for p in [*services, *trainers.values()])  # noqa: E731
        wait_for(lambda: [e for e in kubelet.events("quorum_changed") if e["replicas"] == 2]
                 or any(p.proc.poll() is not None for p in trainers.values()), 240, "both groups in one quorum")
        assert all(p.proc.poll() is None for p in trainers.values()), logs()
        listeners = {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == qport}
        assert listeners == {services[1].pid}, "only the quorum service's pod hosts the quorum"

        before = max_step(kubelet)
        killed = time.time()
        kill_tree(trainers[1].pid)  # the pod's every process, at once: nothing of it says goodbye
        trainers[1].wait(30)
        shrunk = wait_for(lambda: [e for e in kubelet.events("quorum_changed") if e["t"] > killed and e["replicas"] == 1],
                          120, "the survivor's quorum without the killed pod")[0]
        wait_for(lambda: max_step(kubelet) >= shrunk["step"] + 5, 120, "the survivor training on alone")
        assert trainers[0].proc.poll() is None and shrunk["step"] > before, logs()

        trainers[1] = kubelet.run(template, "orch-1-a1", index=1)  # the Job recreates the pod of that index
        healed = wait_for(lambda: [e for e in kubelet.events("replica_healed") if e["t"] > killed], 240,
                          "the recreated pod healing from its peer")[0]
        assert healed["node"] == 1 and healed["source_node"] == 0 and healed["checkpoint_read"] is False, healed
        assert healed["params_sha256"] == healed["source_params_sha256"] and healed["step"] > shrunk["step"]
        wait_for(lambda: [e for e in kubelet.events("quorum_changed") if e["t"] > healed["t"] and e["replicas"] == 2],
                 120, "both groups in one quorum again")
        assert all(p.proc.poll() is None for p in [*services, *trainers.values()]), logs()
        assert not kubelet.events("restart"), "no pod's workers restarted"
        assert not kubelet.events("checkpoint_loaded"), "nothing was read from storage"
        # Nobody saw the killed pod's agent exit; the quorum service saw its heartbeat connection close.
        assert re.search(r"replica node1-a0:\S+ dropped \(disconnected\)", services[1].log_tail()), services[1].log_tail()
        assert shrunk["t"] - killed < 15, shrunk
        print(f"pod kill -> the survivor's first step in a quorum without it: {shrunk['t'] - killed:.2f} s")
    finally:
        kubelet.stop_all()
    text = "".join((p.workdir / "pod.log").read_text() for p in kubelet.pods)
    for secret in (v for values in kubelet.secrets.values() for k, v in values.items() if k == "secret"):
        assert secret not in text, "the run's secret reached a pod's log"


def max_step(kubelet: Kubelet) -> int:
    """The newest step any pod's metrics hold."""
    return max((m["step"] for path in kubelet.root.glob("*/runs/*/*/metrics.jsonl") for m in read_jsonl(path)),
               default=0)


def launch_dry_run(capsys, args: list[str]) -> str:
    assert orch_main(["launch", *args, "--dry-run"]) == 0
    return capsys.readouterr().out


@pytest.mark.timeout(60)
def test_a_pods_launch_dials_the_external_store_under_the_shared_run_id(capsys):
    job = of_kind(render("cpu_gloo", ["checkpoint.url=s3://b/c", "run.id=r7"], "job").objects, "Job")
    args = [a.replace("$(JOB_COMPLETION_INDEX)", "1") for a in job["spec"]["template"]["spec"]["containers"][0]["args"]]
    plan = launch_dry_run(capsys, args[1:])
    assert "run id r7)" in plan and "c10d at orch-r7-rdzv:29400" in plan
    assert "--rdzv-id=r7" in plan and "--rdzv-endpoint=orch-r7-rdzv:29400" in plan


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides, words", [
    (["rendezvous.external=true"], "rendezvous.port=0 cannot be 0 (auto)"),
    (["cluster.node_index=2"], "cluster.node_index=2 is invalid. Fix: use 0..1"),
])
def test_pod_settings_are_checked_where_the_config_is_composed(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        compose_config("cpu_gloo", overrides)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_rendezvous_store_subcommand_serves_until_sigterm(tmp_path):
    port = free_port()
    log = tmp_path / "store.log"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "rendezvous-store", "--port", str(port)],
                            env=orch_env(), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: port_open(port) or proc.poll() is not None, 45, "the store to listen")
        from datetime import timedelta

        from torch.distributed import TCPStore

        client = TCPStore(POD_IP, port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
        import psutil

        # In a pod, every IPv4 interface on purpose: the Service routes to the pod's own address.
        listening = {c.laddr for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert {(a.ip, a.port) for a in listening} == {("0.0.0.0", port)}, listening
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert f"rendezvous store listening on 0.0.0.0 port {port}" in log.read_text()
    finally:
        stop_tree(proc.pid)
