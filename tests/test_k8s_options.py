"""``orch k8s render`` with the scheduling, placement, volume and secret keys of the k8s group: each reaches
every format that has a place for it and the result still validates offline; names carry the run id and are
checked; every pod gets the security defaults; the store admits only its run's pods. No cluster, no processes."""

from __future__ import annotations

import pytest

from k8s_validation import pod_templates, validate_all
from orchestrator.cli import main as orch_main
from orchestrator.k8s import FORMATS, render
from orchestrator.k8s.jobset import store_host

pytestmark = pytest.mark.timeout(120)

WORKLOAD = {"job": "Job", "jobset": "JobSet", "trainjob": "TrainJob", "pytorchjob": "PyTorchJob", "rayjob": "RayJob"}
SCHEDULING = ["k8s.queue=team-a", "k8s.priority_class=high", "k8s.scheduler_name=volcano",
              "'k8s.volumes=[{name:ckpt,claim:orch-ckpt,mount_path:/ckpt},{name:scratch,mount_path:/scratch,size:20Gi}]'",
              "++k8s.labels={team:ml}", "++k8s.annotations={example.com/owner:alice}", "++k8s.node_selector={pool:train}",
              "k8s.tolerations=[{key:dedicated,operator:Equal,value:ml,effect:NoSchedule}]",
              "k8s.image_pull_secrets=[regcred]", "checkpoint.url=/ckpt/cpu_gloo", "run.id=t2"]


def render_objects(fmt: str, *extra: str, preset: str = "cpu_gloo") -> list[dict]:
    return render(preset, [o.strip("'") for o in extra], fmt).objects


def containers_running_orch(template: dict) -> list[dict]:
    return [c for c in template["spec"]["containers"] if c["name"] != "store"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_scheduling_and_placement_keys_reach_every_format_and_validate(fmt):
    objs = render_objects(fmt, *SCHEDULING)
    validate_all(objs)
    (workload,) = [o for o in objs if o["kind"] == WORKLOAD[fmt]]
    assert workload["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    for obj in objs:
        assert obj["metadata"]["labels"]["team"] == "ml" and obj["metadata"]["annotations"] == {"example.com/owner": "alice"}
    templates = [t for o in objs for t in pod_templates(o)]
    assert templates
    for t in templates:
        spec = t["spec"]
        assert t["metadata"]["labels"]["team"] == "ml" and t["metadata"]["annotations"]["example.com/owner"] == "alice"
        assert (spec["priorityClassName"], spec["schedulerName"]) == ("high", "volcano")
        assert spec["imagePullSecrets"] == [{"name": "regcred"}] and spec["nodeSelector"]["pool"] == "train"
        assert {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"} in spec["tolerations"]
        if t["metadata"]["labels"]["app.kubernetes.io/component"] == "rendezvous-store":
            assert not any(v["name"] == "ckpt" for v in spec["volumes"])  # the store needs no data
            continue
        assert {"name": "ckpt", "persistentVolumeClaim": {"claimName": "orch-ckpt"}} in spec["volumes"]
        assert {"name": "scratch", "emptyDir": {"sizeLimit": "20Gi"}} in spec["volumes"]
        for container in containers_running_orch(t):
            assert {"name": "ckpt", "mountPath": "/ckpt"} in container["volumeMounts"]
    gang = {  # gang scheduling, where the format has a place for it
        "pytorchjob": ("PyTorchJob", lambda o: o["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 2,
                                                                                              "priorityClass": "high"}),
        "trainjob": ("ClusterTrainingRuntime", lambda o: o["spec"]["podGroupPolicy"] == {"volcano": {}}),
        "rayjob": ("RayJob", lambda o: o["metadata"]["labels"]["ray.io/scheduler-name"] == "volcano")}
    if fmt in gang:
        kind, check = gang[fmt]
        (obj,) = [o for o in objs if o["kind"] == kind]
        assert check(obj)


def test_checkpoints_on_a_shared_claim_are_allowed_and_on_a_read_only_one_refused(tmp_path, capsys):
    assert render_objects("jobset", "checkpoint.url=/ckpt/x", "k8s.volumes=[{name:c,claim:ck,mount_path:/ckpt}]")
    argv = ["k8s", "render", "conf=cpu_gloo", "checkpoint.url=/ckpt/x", "--format", "jobset", "-o", str(tmp_path / "o"),
            "k8s.volumes=[{name:c,claim:ck,mount_path:/ckpt,read_only:true}]"]
    assert orch_main(argv) == 2
    assert "checkpoint.url='/ckpt/x' is on local disk" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_secrets_render_as_secret_references_only():
    extra = ["checkpoint.url=s3://b/c", "+k8s.secrets.HF_TOKEN=hf-token", "+k8s.secrets.WANDB_API_KEY=wandb/api-key",
             "+k8s.env.TOKENIZERS_PARALLELISM=false"]  # a plain variable whose name only resembles a credential's
    for fmt in FORMATS:
        objs = render_objects(fmt, *extra)
        for t in (t for o in objs for t in pod_templates(o)):
            for container in containers_running_orch(t):
                env = {e["name"]: e for e in container["env"]}
                assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}}
                assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "api-key"}}
                assert env["TOKENIZERS_PARALLELISM"] == {"name": "TOKENIZERS_PARALLELISM", "value": "false"}


SECRET = "hf_" + "aB3" * 12


@pytest.mark.parametrize("args, words", [
    ([f"+k8s.env.HF_TOKEN={SECRET}"], ["k8s.env.HF_TOKEN='<redacted, 39 chars>' looks like a credential",
                                       "Fix: put it in a Secret", "+k8s.secrets.HF_TOKEN=NAME"]),
    ([f"+k8s.env.MODEL_ACCESS={SECRET}"], ["k8s.env.MODEL_ACCESS='<redacted", "k8s.secrets"]),
    (["+k8s.env.DB_PASSWORD=hunter2"], ["k8s.env.DB_PASSWORD='<redacted, 7 chars>'", "k8s.secrets"]),
    (["+k8s.secrets.HF_TOKEN=Bad_Secret"], ["k8s.secrets.HF_TOKEN='Bad_Secret' is invalid", "SECRET/KEY"]),
    (["run.id=Exp_1"], ["run.id='Exp_1' is invalid", "Fix: use at most 63 lower-case letters, digits and '-'"]),
    (["run.id=" + "x" * 60], ["makes the name 'orch-xxx", "Fix: shorten run.id or k8s.name"]),
    (["k8s.name=9lives"], ["k8s.name='9lives' is invalid", "starting with a letter"]),
    (["++k8s.labels={team:a b}"], ["k8s.labels.team='a b' is invalid", "Fix:"]),
    (["k8s.queue=Team_A"], ["k8s.queue='Team_A' is invalid", "Fix:"]),
    (["k8s.volumes=[{name:d,mount_path:/tmp/d}]"], ["k8s.volumes[0].mount_path='/tmp/d' is invalid",
                                                     "outside /dev/shm, /tmp, /workspace"]),
    (["k8s.volumes=[{name:d,path:/d}]"], ["k8s.volumes[0]=", "Fix: give each volume as"]),
])
def test_bad_k8s_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, args, words):
    argv = ["k8s", "render", "conf=cpu_gloo", "checkpoint.url=s3://b/c", *args, "--format", "trainjob",
            "-o", str(tmp_path / "o")]
    assert orch_main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("orch: error: "), err
    for word in words:
        assert word in err, err
    assert SECRET not in err and "hunter2" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_renders_of_one_preset_have_disjoint_names(fmt):
    first, second = (render_objects(fmt, "checkpoint.url=s3://b/c") for _ in range(2))
    names = [{o["metadata"]["name"] for o in objs} for objs in (first, second)]
    assert names[0] and not names[0] & names[1], names
    for objs in (first, second):  # one run id across the objects of one render
        assert len({o["metadata"]["labels"]["app.kubernetes.io/instance"] for o in objs}) == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_pod_runs_as_non_root_without_privileges(fmt):
    for t in (t for o in render_objects(fmt, "checkpoint.url=s3://b/c", preset="bert8gpu") for t in pod_templates(o)):
        spec = t["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        scratch = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for container in spec["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["readOnlyRootFilesystem"] is (fmt != "rayjob"), (fmt, container["name"])
            writable = {m["mountPath"] for m in container["volumeMounts"] if m["name"] in scratch}
            assert {"/tmp", "/workspace"} <= writable  # where orch, torch and caches write


@pytest.mark.parametrize("fmt", ["job", "jobset", "trainjob", "pytorchjob"])
def test_the_store_admits_only_its_runs_pods(fmt):
    objs = render_objects(fmt, "checkpoint.url=s3://b/c", "rendezvous.port=31000")
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-rdzv")]
    templates = [t for o in objs for t in pod_templates(o)]
    selects = lambda selector, t: selector.items() <= t["metadata"]["labels"].items()  # noqa: E731
    stores = [t for t in templates if selects(policy["spec"]["podSelector"]["matchLabels"], t)]
    assert [t["spec"]["containers"][0]["name"] for t in stores] == ["store"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 31000}] and policy["spec"]["policyTypes"] == ["Ingress"]
    (peer,) = rule["from"]
    assert all(selects(peer["podSelector"]["matchLabels"], t) for t in templates)  # every pod of this run
    other = render_objects(fmt, "checkpoint.url=s3://b/c")
    assert not any(selects(peer["podSelector"]["matchLabels"], t) for o in other for t in pod_templates(o))


def test_jobset_ties_the_store_to_the_job_and_restarts_only_what_it_should():
    (jobset,) = [o for o in render_objects("jobset", "checkpoint.url=s3://b/c", "run.id=t3") if o["kind"] == "JobSet"]
    spec = jobset["spec"]
    store, node = spec["replicatedJobs"]
    assert (store["name"], node["name"]) == ("rdzv", "node") and node["dependsOn"] == [{"name": "rdzv", "status": "Ready"}]
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["node"]}  # then the store's Job goes
    assert spec["failurePolicy"]["rules"] == [{"name": "user-error", "action": "FailJobSet",
                                               "onJobFailureReasons": ["PodFailurePolicy"], "targetReplicatedJobs": ["node"]}]
    rules = node["template"]["spec"]["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "Ignore" and rules[0]["onExitCodes"]["values"] == [75]  # preempted: that pod only
    assert rules[2]["action"] == "FailJob" and rules[2]["onExitCodes"]["values"] == [2]
    args = node["template"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"rendezvous.host={store_host('orch-t3')}" in args and store_host("orch-t3") == "orch-t3-rdzv-0-0.orch-t3"
    assert store["template"]["spec"]["template"]["spec"]["containers"][0]["args"][0] == "rendezvous-store"


def test_trainjob_refers_to_its_own_runtime():
    _, _, runtime, trainjob = render_objects("trainjob", "checkpoint.url=s3://b/c", "run.id=t4", preset="cpu_elastic")
    assert trainjob["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                              "name": runtime["metadata"]["name"]}
    assert trainjob["spec"]["trainer"]["numNodes"] == runtime["spec"]["mlPolicy"]["numNodes"] == 3
    assert "namespace" not in runtime["metadata"]  # cluster-scoped
    node = runtime["spec"]["template"]["spec"]["replicatedJobs"][1]
    assert node["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    assert node["template"]["spec"]["template"]["spec"]["containers"][0]["name"] == "node"  # where PET_* go
