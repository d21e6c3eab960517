#!/bin/sh
# Regenerate every manifest under deploy/k8s from the presets in conf/. Run from the repository root:
#
#     sh deploy/k8s/render.sh
#
# tests/test_k8s_manifests.py renders these same commands and fails when a checked-in file differs, so
# change a preset (or orchestrator/k8s/), run this, and commit the diff with it. One command a line.
set -eu
ORCH="${ORCH:-.venv/bin/orch}"
$ORCH k8s render conf=cpu_gloo checkpoint.url=s3://orch-checkpoints/cpu_gloo --format job -o deploy/k8s/cpu_gloo
$ORCH k8s render conf=cpu_gloo checkpoint.url=s3://orch-checkpoints/cpu_gloo --format pytorchjob -o deploy/k8s/cpu_gloo
$ORCH k8s render conf=cpu_gloo checkpoint.url=s3://orch-checkpoints/cpu_gloo --format rayjob -o deploy/k8s/cpu_gloo
$ORCH k8s render conf=bert8gpu checkpoint.url=s3://orch-checkpoints/bert8gpu '++k8s.spot_node_selector={cloud.google.com/gke-spot:true}' 'k8s.spot_tolerations=[{key:cloud.google.com/gke-spot,operator:Equal,value:true,effect:NoSchedule}]' --format job -o deploy/k8s/bert8gpu
$ORCH k8s render conf=bert8gpu checkpoint.url=s3://orch-checkpoints/bert8gpu '++k8s.spot_node_selector={cloud.google.com/gke-spot:true}' 'k8s.spot_tolerations=[{key:cloud.google.com/gke-spot,operator:Equal,value:true,effect:NoSchedule}]' --format pytorchjob -o deploy/k8s/bert8gpu
$ORCH k8s render conf=bert8gpu checkpoint.url=s3://orch-checkpoints/bert8gpu '++k8s.spot_node_selector={cloud.google.com/gke-spot:true}' 'k8s.spot_tolerations=[{key:cloud.google.com/gke-spot,operator:Equal,value:true,effect:NoSchedule}]' --format rayjob -o deploy/k8s/bert8gpu
