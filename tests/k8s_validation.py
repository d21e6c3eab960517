"""Offline validation of rendered Kubernetes objects, for the k8s tests: core kinds against Kubernetes' own
schemas (kubernetes-validate, strict), custom resources against the operators' CRDs vendored in
tests/k8s_schemas/ (jsonschema, unknown fields are errors). Nothing outside the repository is read."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import yaml

SCHEMAS = Path(__file__).resolve().parent / "k8s_schemas"
CRD_FILES = {"PyTorchJob": "kubeflow.org_pytorchjobs.yaml", "RayJob": "ray.io_rayjobs.yaml",
             "RayCluster": "ray.io_rayclusters.yaml", "JobSet": "jobset.x-k8s.io_jobsets.yaml",
             "TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
             "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml"}
# podFailurePolicy with a DisruptionTarget rule is GA from 1.31; kubernetes-validate ships schemas up to 1.37.
K8S_VERSIONS = ("1.31", "1.37")
CORE_API_VERSIONS = ("v1", "apps/v1", "batch/v1", "networking.k8s.io/v1")

# kubernetes-validate parses its schema files (MBs of JSON: the definitions file of each version) on every call,
# most of a validation's time; the same files parsed once serve every call unchanged (nothing writes to them).
if not hasattr(kubernetes_validate.utils.schema_contents, "cache_info"):
    kubernetes_validate.utils.schema_contents = lru_cache(maxsize=None)(kubernetes_validate.utils.schema_contents)


def strict(schema):
    """The CRD schema as the API server applies it with field validation Strict: unknown fields are errors
    (a CRD schema only lists the known ones; pruning would drop a misspelt field silently)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {k: strict(v) for k, v in schema.items()}
    if (schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        schema["additionalProperties"] = False
    return schema


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # MBs: libyaml


@lru_cache(maxsize=None)
def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    path = SCHEMAS / CRD_FILES[kind]
    assert path.exists(), f"{path} is missing: the CRD schemas are vendored in tests/k8s_schemas (see its README)"
    (version,) = [v for v in load_yaml(path)["spec"]["versions"] if v.get("storage")]  # the version orch renders
    return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


def crd_errors(kind: str, obj: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in crd_validator(kind).iter_errors(obj)]


def jobset_jobs(obj: dict) -> list[dict]:
    """The Job templates of a JobSet, or of a ClusterTrainingRuntime's JobSet template."""
    spec = obj["spec"]["template"]["spec"] if obj["kind"] == "ClusterTrainingRuntime" else obj["spec"]
    return [rj["template"] for rj in spec["replicatedJobs"]] if obj["kind"] in ("JobSet", "ClusterTrainingRuntime") else []


def pod_templates(obj: dict) -> list[dict]:
    """Every pod template inside an object, core or custom."""
    if obj["kind"] == "PyTorchJob":
        return [r["template"] for r in obj["spec"]["pytorchReplicaSpecs"].values()]
    if obj["kind"] == "RayJob":
        cluster = obj["spec"]["rayClusterSpec"]
        return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    if obj["kind"] in ("Job", "Deployment"):
        return [obj["spec"]["template"]]
    return [job["spec"]["template"] for job in jobset_jobs(obj)]


def validate_core(obj: dict) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def core_views(obj: dict) -> Iterator[dict]:
    """``obj`` if it is a core kind, and the core objects a custom resource embeds (Jobs, pod templates)."""
    if obj["apiVersion"] in CORE_API_VERSIONS:
        yield obj
        return
    for job in jobset_jobs(obj):
        yield {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", **job.get("metadata", {})},
               "spec": job["spec"]}
    for template in pod_templates(obj):
        yield {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}


def validate_all(objects: list[dict]) -> None:
    """Every object, core or custom, valid offline; raises on the first problem."""
    for obj in objects:
        for view in core_views(obj):
            validate_core(view)
        if obj["apiVersion"] not in CORE_API_VERSIONS:
            assert crd_errors(obj["kind"], obj) == [], (obj["kind"], crd_errors(obj["kind"], obj)[:5])
        if obj["kind"] == "RayJob":  # the inline cluster must also be a valid RayCluster
            cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "c"},
                       "spec": obj["spec"]["rayClusterSpec"]}
            assert crd_errors("RayCluster", cluster) == []


def assert_render_refused(tmp_path: Path, capsys: Any, argv: list[str], words: list[str]) -> None:
    """``orch k8s render ARGV -o DIR`` exits 2 with one line holding ``words`` and writes nothing."""
    from orchestrator.cli import main as orch_main

    assert orch_main(["k8s", "render", *argv, "-o", str(tmp_path / "o")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("orch: error: "), err
    for word in words:
        assert word in err, err
    assert not (tmp_path / "o").exists()
