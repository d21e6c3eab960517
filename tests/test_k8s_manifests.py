"""``orch k8s render``: the manifests validate offline (Kubernetes' own schemas through kubernetes-validate, the
operators' CRD schemas through jsonschema), match the checked-in deploy/k8s files, carry what the config asks
for, and bad input exits 2 with one line naming the key, the value and the fix. No cluster, no processes."""

from __future__ import annotations

import copy
import shlex
from functools import lru_cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from k8s_validation import (CORE_API_VERSIONS, CRD_FILES, SCHEMAS, assert_render_refused, crd_errors, load_yaml,
                            pod_templates, validate_all, validate_core)
from orchestrator.cli import main as orch_main
from orchestrator.config.compose import compose_config
from orchestrator.k8s import FORMATS, render

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "k8s"
PRESETS = {"cpu_gloo": ["checkpoint.url=s3://bucket/cpu_gloo", "run.id=t1"],
           "bert8gpu": ["checkpoint.url=s3://bucket/bert8gpu", "run.id=t1"]}
SPOT = ["++k8s.spot_node_selector={cloud.google.com/gke-spot:true}",
        "k8s.spot_tolerations=[{key:cloud.google.com/gke-spot,operator:Equal,value:true,effect:NoSchedule}]"]
CASES = [(preset, fmt) for preset in PRESETS for fmt in FORMATS]
CUSTOM_KINDS = {"job": [], "jobset": ["JobSet"], "trainjob": ["ClusterTrainingRuntime", "TrainJob"],
                "pytorchjob": ["PyTorchJob"], "rayjob": ["RayJob"]}


@lru_cache(maxsize=None)
def rendered(preset: str, fmt: str, extra: tuple[str, ...] = ()):
    return render(preset, [*PRESETS.get(preset, ["checkpoint.url=s3://bucket/x", "run.id=t1"]), *extra], fmt)


def objects(preset: str, fmt: str, extra: tuple[str, ...] = ()) -> list[dict]:
    return copy.deepcopy(rendered(preset, fmt, extra).objects)


def one(objs: list[dict], kind: str, component: str = "") -> dict:
    found = [o for o in objs if o["kind"] == kind and component in o["metadata"]["labels"]["app.kubernetes.io/component"]]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def test_schemas_are_read_from_the_repository_only():
    """A clone with no ../shared beside it must validate too: the schemas live inside the checkout."""
    assert SCHEMAS.is_relative_to(REPO) and (SCHEMAS / "README.md").exists()
    assert set(CRD_FILES) == {"JobSet", "TrainJob", "ClusterTrainingRuntime", "PyTorchJob", "RayJob", "RayCluster"}
    for name in CRD_FILES.values():
        assert "\nkind: CustomResourceDefinition\n" in (SCHEMAS / name).read_text()[:2000], name


@pytest.mark.parametrize("preset, fmt", CASES)
def test_every_format_validates_offline(preset, fmt):
    """Core kinds (and the Jobs and pod templates inside custom resources) against Kubernetes' schemas; JobSet,
    TrainJob, ClusterTrainingRuntime, PyTorchJob, RayJob (and its inline RayCluster) against their CRDs."""
    objs = objects(preset, fmt)
    assert [o["kind"] for o in objs if o["apiVersion"] not in CORE_API_VERSIONS] == CUSTOM_KINDS[fmt]
    validate_all(objs)


def test_the_upstream_example_runtime_validates_against_the_vendored_crd():
    """The CRD schema accepts what upstream ships: the validator itself is set up right."""
    example = load_yaml(SCHEMAS / "example-clustertrainingruntime-torch-distributed.yaml")
    assert crd_errors("ClusterTrainingRuntime", example) == []


def test_bert8gpu_pytorchjob_from_the_cli_validates(capsys):
    assert orch_main(["k8s", "render", "conf=bert8gpu", "--format", "pytorchjob"]) == 0
    out, err = capsys.readouterr()
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert one(docs, "PyTorchJob")
    validate_all(docs)
    assert "orch: warning: checkpoint.url=None is on the pod's own disk" in err  # one pod: allowed, but said


def test_the_validators_reject_what_a_cluster_would():
    """Guards the tests above against passing vacuously."""
    job = one(objects("cpu_gloo", "job"), "Job")
    job["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(job)
    pytorchjob = one(objects("bert8gpu", "pytorchjob"), "PyTorchJob")
    pytorchjob["spec"]["elasticPolicy"]["rdzvBackend"] = 3
    pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resurces"] = {}
    errors = crd_errors("PyTorchJob", pytorchjob)
    assert any("rdzvBackend" in e for e in errors) and any("resurces" in e for e in errors)
    rayjob = one(objects("cpu_gloo", "rayjob"), "RayJob")
    del rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"]
    assert any("groupName" in e for e in crd_errors("RayJob", rayjob))
    jobset = one(objects("cpu_gloo", "jobset"), "JobSet")
    jobset["spec"]["failurePolicy"]["rules"][0]["action"] = "Retry"
    jobset["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["containers"][0]["imag"] = "x"
    errors = crd_errors("JobSet", jobset)
    assert any("action" in e for e in errors) and any("imag" in e for e in errors), errors
    trainjob = one(objects("cpu_gloo", "trainjob"), "TrainJob")
    del trainjob["spec"]["runtimeRef"]["name"]
    assert any("name" in e for e in crd_errors("TrainJob", trainjob))
    runtime = one(objects("cpu_gloo", "trainjob"), "ClusterTrainingRuntime")
    runtime["spec"]["template"]["spec"]["replicatedJobs"][1]["template"]["spec"]["completionMode"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):  # a Job inside a custom resource is a core Job too
        validate_all([runtime])


def render_script_commands() -> list[list[str]]:
    """The `orch k8s render` commands of deploy/k8s/render.sh, one a line, as argv after `orch`."""
    lines = (DEPLOY / "render.sh").read_text().splitlines()
    return [shlex.split(line)[1:] for line in lines if line.startswith("$ORCH k8s render ")]


def test_checked_in_manifests_match_a_fresh_render():
    commands = render_script_commands()
    produced = set()
    for argv in commands:
        out_dir = argv[argv.index("-o") + 1]
        fmt = argv[argv.index("--format") + 1]
        tokens = [t for i, t in enumerate(argv[2:], 2) if t not in ("-o", "--format") and argv[i - 1] not in ("-o", "--format")]
        preset = next(t for t in tokens if t.startswith("conf="))[len("conf="):]
        fresh = render(preset, [t for t in tokens if not t.startswith("conf=")], fmt).text()
        path = REPO / out_dir / f"{fmt}.yaml"
        produced.add(path)
        regenerate = f"sh deploy/k8s/render.sh (or: .venv/bin/orch {shlex.join(argv)})"
        assert path.exists(), f"{path.relative_to(REPO)} is missing. Regenerate: {regenerate}"
        assert path.read_text() == fresh, f"{path.relative_to(REPO)} differs from what `orch k8s render` produces now. " \
                                          f"Regenerate: {regenerate}"
    assert produced == set(DEPLOY.glob("*/*.yaml")), "deploy/k8s holds a manifest render.sh does not produce"
    assert {(p.parent.name, p.stem) for p in produced} >= {(preset, fmt) for preset, fmt in CASES}


def test_kustomization_lists_rendered_manifests_only():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization" and kustomization["resources"]
    for resource in kustomization["resources"]:
        assert (DEPLOY / resource).exists(), resource


def test_rendering_is_deterministic():
    first = render("cpu_gloo", ["checkpoint.url=s3://b/x", "run.id=r1", *SPOT], "job").text()
    assert render("cpu_gloo", ["checkpoint.url=s3://b/x", "run.id=r1", *SPOT], "job").text() == first
    assert first.startswith("# Rendered by `orch k8s render conf=cpu_gloo checkpoint.url=s3://b/x run.id=r1 ")


def test_job_runs_one_pod_per_node_against_the_store_and_ignores_preemption_exits():
    objs = objects("cpu_elastic", "job", ("rendezvous.port=31234", "trainer.max_steps=7", "k8s.cpu=3"))
    store, job = one(objs, "Deployment", "rendezvous-store"), one(objs, "Job")
    store_service = one(objs, "Service", "rendezvous-store")
    headless = one(objs, "Service", "trainer")
    assert store["spec"]["template"]["spec"]["containers"][0]["args"] == ["rendezvous-store", "--port", "31234"]
    assert store_service["spec"]["ports"][0]["port"] == 31234 and headless["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"] == 3
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [75]}}
    assert {"type": "DisruptionTarget", "status": "True"} in rules[1]["onPodConditions"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == headless["metadata"]["name"]
    args = pod["containers"][0]["args"]
    assert args[:2] == ["launch", "conf=cpu_elastic"] and "trainer.max_steps=7" in args
    assert {"launcher=local", "cluster.node_index=$(JOB_COMPLETION_INDEX)", "rendezvous.external=true",
            f"rendezvous.host={store_service['metadata']['name']}", "rendezvous.port=31234",
            "run.id=t1"} <= set(args)
    keys = [a.split("=", 1)[0] for a in args]
    assert not any(k.startswith("k8s.") for k in keys) and keys.count("rendezvous.port") == 1


def test_the_rendered_pod_command_is_a_valid_launch():
    """What a pod runs composes (with its index filled in) to one node of the job dialing the store."""
    job = one(objects("cpu_gloo", "job"), "Job")
    args = [a.replace("$(JOB_COMPLETION_INDEX)", "1") for a in job["spec"]["template"]["spec"]["containers"][0]["args"]]
    cfg = compose_config(args[1][len("conf="):], args[2:])
    assert cfg.cluster.node_index == 1 and cfg.rendezvous.external and cfg.launcher == "local"
    assert (cfg.rendezvous.host, cfg.rendezvous.port, cfg.run.id) == ("orch-t1-rdzv", 29400, "t1")
    assert cfg.checkpoint.url == "s3://bucket/cpu_gloo"


def test_every_training_pod_gets_image_resources_secret_shm_grace_and_spot_placement():
    extra = ("k8s.image=registry.example/orch:1", "preemption.grace_period_s=100", "k8s.termination_grace_margin_s=20",
             *SPOT)
    for fmt in FORMATS:
        objs = objects("bert8gpu", fmt, extra)
        training = [t for o in objs for t in pod_templates(o)]
        assert training, fmt
        for template in training:
            component = template["metadata"]["labels"]["app.kubernetes.io/component"]
            spec, container = template["spec"], template["spec"]["containers"][0]
            assert container["image"] == "registry.example/orch:1", (fmt, component)
            assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "orch-t1"
            if component == "rendezvous-store":  # never on spot nodes: losing it would end the job
                assert "nodeSelector" not in spec and "tolerations" not in spec
                continue
            assert container["envFrom"] == [{"secretRef": {"name": "orch-checkpoint-credentials"}}]
            assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
            assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in spec["volumes"]
            assert spec["terminationGracePeriodSeconds"] == 120
            if component == "ray-head":
                assert "nodeSelector" not in spec and "nvidia.com/gpu" not in container["resources"]["limits"]
                continue
            assert spec["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
            assert spec["tolerations"] == [{"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                                            "effect": "NoSchedule"}]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
            assert container["resources"]["requests"]["nvidia.com/gpu"] == "8"
    amd = one(objects("bert8gpu", "job", ("k8s.gpu_resource_name=amd.com/gpu",)), "Job")
    assert amd["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["amd.com/gpu"] == "8"


def test_pytorchjob_elastic_policy_comes_from_cluster_settings():
    objs = objects("cpu_elastic", "pytorchjob", ("rendezvous.join_timeout_s=77",))
    job = one(objs, "PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"], policy["maxRestarts"]) == (1, 3, 10)
    assert (policy["rdzvBackend"], policy["rdzvHost"], policy["rdzvPort"]) == ("c10d", "orch-t1-rdzv", 29400)
    assert {"key": "is_host", "value": "false"} in policy["rdzvConf"]
    assert {"key": "join_timeout", "value": "77"} in policy["rdzvConf"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 3 and worker["restartPolicy"] == "OnFailure"
    container = worker["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and "cluster.node_index=$(ORCH_NODE_INDEX)" in container["args"]
    assert one(objs, "Deployment", "rendezvous-store")


def test_rayjob_runs_orch_launch_on_the_head_with_workers_sized_from_the_config():
    job = one(objects("cpu_elastic", "rayjob", ("trainer.max_steps=9",)), "RayJob")
    entry = shlex.split(job["spec"]["entrypoint"])
    assert entry[:3] == ["orch", "launch", "conf=cpu_elastic"] and "cluster.address=auto" in entry
    assert {"launcher=ray", "trainer.max_steps=9", "run.dir=/runs/orch-t1"} <= set(entry)
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    group = cluster["workerGroupSpecs"][0]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (3, 1, 3)
    gpu = one(objects("bert8gpu", "rayjob"), "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert gpu["rayStartParams"] == {"num-cpus": "24", "num-gpus": "8"}


def test_output_dir_gets_one_file_per_format(tmp_path, capsys):
    # Options may stand among the overrides, as --dry-run may for launch.
    argv = ["k8s", "render", "conf=cpu_gloo", "-o", str(tmp_path), "checkpoint.url=s3://b/c", "--format=rayjob"]
    assert orch_main(argv) == 0
    written = (tmp_path / "rayjob.yaml").read_text()
    run_id = written.split("run.id=", 1)[1].split()[0]  # drawn fresh, and named in the header's command
    assert f"wrote {tmp_path}/rayjob.yaml: NetworkPolicy/orch-{run_id}, RayJob/orch-{run_id}\n" == capsys.readouterr().out
    assert run_id.startswith("cpu-gloo-") and len(run_id) == len("cpu-gloo-") + 6
    assert written == render("cpu_gloo", ["checkpoint.url=s3://b/c", f"run.id={run_id}"], "rayjob").text()


@pytest.mark.parametrize("args, words", [
    (["conf=cpu_gloo", "checkpoint.url=s3://b/c", "--format", "helm"],
     ["--format='helm' is not a known format", "Fix: use one of job, jobset, trainjob, pytorchjob, rayjob"]),
    (["conf=bert8gpu", "checkpoint.url=s3://b/c", "k8s.gpu_resource_name=null", "--format", "pytorchjob"],
     ["k8s.gpu_resource_name=None", "8 GPU(s) per pod", "Fix: set k8s.gpu_resource_name=nvidia.com/gpu"]),
    (["conf=cpu_gloo", "--format", "job"],
     ["checkpoint.url is not set, so checkpoints would go to each pod's own run dir", "2 pods",
      "Fix: put checkpoints on storage every pod reaches"]),
    (["conf=cpu_elastic", "checkpoint.url=/mnt/ckpt", "--format", "pytorchjob"],
     ["checkpoint.url='/mnt/ckpt' is on local disk", "3 pods", "Fix: put checkpoints on storage every pod reaches"]),
    (["conf=cpu_gloo", "checkpoint.url=file:///tmp/x", "--format", "rayjob"],
     ["checkpoint.url='file:///tmp/x' is on local disk", "Fix:"]),
    (["conf=cpu_gloo", "k8s.run_dir_claim=null", "--format", "rayjob"],
     ["k8s.run_dir_claim=None", "Fix: name a ReadWriteMany PersistentVolumeClaim"]),
    (["conf=cpu_gloo", "checkpoint.url=s3://b/c", "k8s.memory=lots"], ["k8s.memory='lots' is invalid", "Fix:"]),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, words):
    assert_render_refused(tmp_path, capsys, args, words)
