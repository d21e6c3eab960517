"""``orch k8s render`` hardening (issue #23 item 6): no credential inside a URL is ever rendered (args, env,
header); the rendezvous store is gated by default (a Secret named after the job, which the header says how to
create); the RayJob's dashboard listens on the pod IP behind a NetworkPolicy; every pod of every format is
selected by a NetworkPolicy admitting only its run's pods (and, for rayjob, KubeRay's submitter and operator
on the dashboard port); no pod gets a Kubernetes API token unless asked. No cluster, no processes: every
rendered manifest is also validated offline (tests/k8s_validation.py)."""

from __future__ import annotations

import copy
from functools import lru_cache

import pytest
import yaml

from k8s_validation import pod_templates, validate_all
from orchestrator.cli import main as orch_main
from orchestrator.errors import ConfigError, UserError
from orchestrator.k8s import FORMATS, render
from orchestrator.k8s.render import _refuse_credentials

pytestmark = pytest.mark.timeout(120)

OWN_STORE = ["job", "jobset", "trainjob", "pytorchjob"]  # formats whose pods run and dial orch's own store
BASE = ["checkpoint.url=s3://b/c", "run.id=h1"]
SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


@lru_cache(maxsize=None)
def validated(fmt: str, extra: tuple[str, ...], preset: str):
    """One render of these inputs (rendering is deterministic: tests/test_k8s_manifests.py), validated once."""
    result = render(preset, [*BASE, *extra], fmt)
    validate_all(result.objects)
    return result


def objects(fmt: str, *extra: str, preset: str = "cpu_gloo") -> list[dict]:
    return copy.deepcopy(validated(fmt, extra, preset).objects)


def containers(objs: list[dict]) -> list[dict]:
    return [c for o in objs for t in pod_templates(o) for c in t["spec"]["containers"]]


def render_cli(tmp_path, capsys, *args: str) -> tuple[int, str, str]:
    code = orch_main(["k8s", "render", "conf=cpu_gloo", *args, "-o", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    return code, out, err


# --- credentials inside URLs -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("args, key, fix", [
    ([f"checkpoint.url=s3://AKIAEXAMPLE:{SECRET}@bucket/x"], "checkpoint.url='s3://<redacted>@bucket/x'",
     "k8s.checkpoint_secret"),
    (["checkpoint.url=s3://b/c", f"+k8s.env.DB_URL=postgres://user:{SECRET}@h/db"],
     "k8s.env.DB_URL='postgres://<redacted>@h/db'", "+k8s.secrets.DB_URL=NAME"),
    (["checkpoint.url=s3://b/c", f"entrypoint.args=[--db,postgres://user:{SECRET}@h/db]"], "entrypoint.args=",
     "+k8s.secrets.VAR=SECRET"),
    (["checkpoint.url=s3://b/c", "data=textfile", f"data.dataset.url=https://{SECRET}@data.example/corpus.txt"],
     "data.dataset.url='https://<redacted>@data.example/corpus.txt'", "+k8s.secrets.VAR=SECRET"),
    (["checkpoint.url=s3://b/c", f"+k8s.annotations.source=https://user:{SECRET}@git.example/r"],
     "k8s.annotations.source=", "k8s.secrets"),
])
def test_a_credential_inside_a_url_is_refused_in_one_line_and_never_written(tmp_path, capsys, fmt, args, key, fix):
    code, out, err = render_cli(tmp_path, capsys, "run.id=h1", *args, "--format", fmt)
    assert code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and err.startswith("orch: error: ") and "Traceback" not in err, err
    assert key in err and "holds a credential inside a URL" in err and fix in err, err
    assert SECRET not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["s3://bucket/path@v2", "http://mlflow:5000/a@b", "https://mlflow.example:443",
                                  "file:///data/x@y"])
def test_urls_without_credentials_still_render(text):
    result = render("cpu_gloo", [*BASE, f"+k8s.env.SOME_URL={text}"], "job")
    assert f"value: {text}" in result.text()


def test_a_credential_from_a_preset_is_refused_too(tmp_path, monkeypatch):
    """``k8s.env`` set in a preset of one's own never passes through the command line: checked all the same."""
    (tmp_path / "leaky.yaml").write_text("defaults: [cpu_gloo, _self_]\npreset: leaky\n"
                                         f"k8s:\n  env:\n    DB_URL: postgres://u:{SECRET}@h/db\n")
    monkeypatch.setenv("ORCH_CONF_PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="k8s.env.DB_URL='postgres://<redacted>@h/db' holds a credential") as err:
        render("leaky", BASE, "job")
    assert SECRET not in str(err.value)


def test_the_last_check_refuses_any_rendered_text_holding_a_credential():
    """Whatever way a credential reached the text, the render refuses it (and does not echo it)."""
    with pytest.raises(UserError, match="would hold a credential inside a URL") as err:
        _refuse_credentials(f"args:\n- --url=redis://:{SECRET}@cache:6379\n")
    assert SECRET not in str(err.value)
    _refuse_credentials("args:\n- --url=redis://cache:6379/0\n")


def test_a_toleration_value_holding_a_credential_is_refused():
    with pytest.raises(ConfigError, match=r"k8s.tolerations=.*https://<redacted>@x.* holds a credential"):
        render("cpu_gloo", [*BASE, f"k8s.tolerations=[{{key:k,operator:Equal,value:'https://t:{SECRET}@x',effect:NoSchedule}}]"],
               "job")


# --- the store gated by default ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", OWN_STORE)
def test_the_store_is_gated_by_default_with_a_secret_named_after_the_job(fmt):
    result = validated(fmt, (), "cpu_gloo")  # read only: shared with the other tests of these inputs
    found = containers(result.objects)
    assert any(c["name"] == "store" for c in found) and len(found) >= 2
    for c in found:
        (env,) = [e for e in c["env"] if e["name"] == "ORCH_RUN_SECRET"]
        assert env["valueFrom"] == {"secretKeyRef": {"name": "orch-h1-run-secret", "key": "secret"}}, c["name"]
    command = 'kubectl create secret generic orch-h1-run-secret --from-literal=secret="$(openssl rand -hex 32)"'
    assert result.secret_command == command and f"#   {command}\n" in result.text().split("---", 1)[0]
    assert result.warnings == ()


def test_the_header_names_the_secret_namespace_and_key_given():
    result = render("cpu_gloo", [*BASE, "k8s.namespace=ml", "k8s.run_secret=rdzv/token"], "jobset")
    assert result.secret_command == ('kubectl create secret generic rdzv -n ml --from-literal=token='
                                     '"$(openssl rand -hex 32)"')


def test_render_to_a_directory_says_which_secret_to_create(tmp_path, capsys):
    code, out, err = render_cli(tmp_path, capsys, *BASE, "--format", "job")
    assert code == 0 and err == ""
    assert out.splitlines()[-1] == ("before kubectl apply, create the run's Secret: kubectl create secret generic "
                                    'orch-h1-run-secret --from-literal=secret="$(openssl rand -hex 32)"')


def test_the_explicit_opt_out_renders_an_ungated_store_with_a_warning(tmp_path, capsys):
    code, out, err = render_cli(tmp_path, capsys, *BASE, "k8s.run_secret=''", "--format", "job")
    assert code == 0 and "ORCH_RUN_SECRET" not in (tmp_path / "out" / "job.yaml").read_text()
    assert err.startswith("orch: warning: k8s.run_secret='': the rendezvous store is not gated") and "Fix:" in err
    assert "create the run's Secret" not in out


def test_rayjob_takes_no_run_secret_the_ray_launcher_gates_its_own_store():
    result = validated("rayjob", (), "cpu_gloo")
    assert "ORCH_RUN_SECRET" not in result.text() and result.secret_command == "" and result.warnings == ()
    with pytest.raises(ConfigError, match="has no store to gate in --format rayjob"):
        render("cpu_gloo", [*BASE, "k8s.run_secret=rdzv"], "rayjob")


# --- the RayJob's dashboard and every pod's NetworkPolicy ----------------------------------------------------

def test_the_ray_dashboard_listens_on_the_pod_ip_and_is_probed_there():
    (job,) = [o for o in objects("rayjob") if o["kind"] == "RayJob"]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "$(POD_IP)"
    (container,) = head["template"]["spec"]["containers"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    for probe in (container["readinessProbe"], container["livenessProbe"]):
        # httpGet goes to the pod IP; KubeRay's own probe (written when there is none) asks localhost
        assert probe["httpGet"] == {"path": "/api/gcs_healthz", "port": 8265} and "host" not in probe["httpGet"]
    assert "0.0.0.0" not in yaml.safe_dump(job)


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_pod_is_behind_a_policy_that_admits_only_its_run(fmt):
    objs = objects(fmt)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    others = [t for o in objects(fmt, "run.id=other") for t in pod_templates(o)]
    for template in (t for o in objs for t in pod_templates(o)):
        labels = template["metadata"]["labels"]
        mine = [p for p in policies if selects(p["spec"]["podSelector"]["matchLabels"], labels)]
        assert mine, (fmt, labels)
        for policy in mine:
            assert policy["spec"]["policyTypes"] == ["Ingress"]
            for rule in policy["spec"]["ingress"]:
                for peer in rule["from"]:
                    run_peer = selects(peer["podSelector"]["matchLabels"], labels) and "namespaceSelector" not in peer
                    assert run_peer or (fmt == "rayjob" and rule["ports"] == [{"protocol": "TCP", "port": 8265}]), peer
                    assert not any(selects(peer["podSelector"]["matchLabels"], t["metadata"]["labels"])
                                   for t in others), "another run's pods are admitted"


def test_the_ray_policy_admits_kuberays_submitter_and_operator_to_the_dashboard_only():
    (policy,) = [o for o in objects("rayjob", "k8s.ray_operator_namespace=kuberay") if o["kind"] == "NetworkPolicy"]
    own, kuberay = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "orch-h1"}}}]}
    assert kuberay == {"ports": [{"protocol": "TCP", "port": 8265}], "from": [
        {"podSelector": {"matchLabels": {"batch.kubernetes.io/job-name": "orch-h1"}}},  # KubeRay's submitter Job
        {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "kuberay-operator"}},
         "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay"}}}]}
    (anywhere,) = [o for o in objects("rayjob") if o["kind"] == "NetworkPolicy"]
    assert anywhere["spec"]["ingress"][1]["from"][1]["namespaceSelector"] == {}


# --- no API token ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_no_pod_gets_an_api_token_unless_asked(fmt):
    for template in (t for o in objects(fmt) for t in pod_templates(o)):
        assert template["spec"]["automountServiceAccountToken"] is False
    for template in (t for o in objects(fmt, "k8s.automount_service_account_token=true") for t in pod_templates(o)):
        assert template["spec"]["automountServiceAccountToken"] is True
