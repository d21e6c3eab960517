#!/bin/sh
# Regenerate every manifest under deploy/k8s from the presets in conf/. Run from the repository root:
#
#     sh deploy/k8s/render.sh
#
# tests/test_k8s_manifests.py renders these same commands and fails when a checked-in file differs, so
# change a preset (or orchestrator/k8s/), run this, and commit the diff with it. One command a line. Each
# gives run.id, so that the names (and bytes) stay the same; a render without it draws a fresh run id.
set -eu
ORCH="${ORCH:-.venv/bin/orch}"
$ORCH k8s render conf=cpu_gloo checkpoint.url=s3://orch-checkpoints/cpu_gloo run.id=cpu-gloo-example --format job -o deploy/k8s/cpu_gloo
$ORCH k8s render conf=cpu_gloo checkpoint.url=s3://orch-checkpoints/cpu_gloo run.id=cpu-gloo-example --format jobset -o deploy/k8s/cpu_gloo
$ORCH k8s render conf=cpu_gloo checkpoint.url=s3://orch-checkpoints/cpu_gloo run.id=cpu-gloo-example --format trainjob -o deploy/k8s/cpu_gloo
$ORCH k8s render conf=cpu_gloo checkpoint.url=s3://orch-checkpoints/cpu_gloo run.id=cpu-gloo-example --format pytorchjob -o deploy/k8s/cpu_gloo
$ORCH k8s render conf=cpu_gloo checkpoint.url=s3://orch-checkpoints/cpu_gloo run.id=cpu-gloo-example --format rayjob -o deploy/k8s/cpu_gloo
$ORCH k8s render conf=bert8gpu checkpoint.url=s3://orch-checkpoints/bert8gpu run.id=bert8gpu-example '++k8s.spot_node_selector={cloud.google.com/gke-spot:true}' 'k8s.spot_tolerations=[{key:cloud.google.com/gke-spot,operator:Equal,value:true,effect:NoSchedule}]' --format job -o deploy/k8s/bert8gpu
$ORCH k8s render conf=bert8gpu checkpoint.url=s3://orch-checkpoints/bert8gpu run.id=bert8gpu-example '++k8s.spot_node_selector={cloud.google.com/gke-spot:true}' 'k8s.spot_tolerations=[{key:cloud.google.com/gke-spot,operator:Equal,value:true,effect:NoSchedule}]' --format jobset -o deploy/k8s/bert8gpu
$ORCH k8s render conf=bert8gpu checkpoint.url=s3://orch-checkpoints/bert8gpu run.id=bert8gpu-example '++k8s.spot_node_selector={cloud.google.com/gke-spot:true}' 'k8s.spot_tolerations=[{key:cloud.google.com/gke-spot,operator:Equal,value:true,effect:NoSchedule}]' --format trainjob -o deploy/k8s/bert8gpu
$ORCH k8s render conf=bert8gpu checkpoint.url=s3://orch-checkpoints/bert8gpu run.id=bert8gpu-example '++k8s.spot_node_selector={cloud.google.com/gke-spot:true}' 'k8s.spot_tolerations=[{key:cloud.google.com/gke-spot,operator:Equal,value:true,effect:NoSchedule}]' --format pytorchjob -o deploy/k8s/bert8gpu
$ORCH k8s render conf=bert8gpu checkpoint.url=s3://orch-checkpoints/bert8gpu run.id=bert8gpu-example '++k8s.spot_node_selector={cloud.google.com/gke-spot:true}' 'k8s.spot_tolerations=[{key:cloud.google.com/gke-spot,operator:Equal,value:true,effect:NoSchedule}]' --format rayjob -o deploy/k8s/bert8gpu
# fault_tolerance.mode=per_step: the quorum service (orch quorum-service) beside the store, 1 to 3 pods:
$ORCH k8s render conf=cpu_elastic fault_tolerance.mode=per_step checkpoint.url=s3://orch-checkpoints/cpu_elastic run.id=per-step-example --format job -o deploy/k8s/per_step
$ORCH k8s render conf=cpu_elastic fault_tolerance.mode=per_step checkpoint.url=s3://orch-checkpoints/cpu_elastic run.id=per-step-example --format jobset -o deploy/k8s/per_step
# A user's own script in an image built FROM orch's (Dockerfile.user), queued in Kueue, a Secret for a token:
$ORCH k8s render conf=cpu_gloo checkpoint.url=s3://orch-checkpoints/user_script run.id=user-script-example k8s.image=my-training:latest entrypoint.script=/opt/app/elastic_train.py k8s.queue=team-a +k8s.secrets.HF_TOKEN=hf-token --format jobset -o deploy/k8s/user_script
