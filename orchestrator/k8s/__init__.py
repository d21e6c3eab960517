"""Kubernetes manifests from the same composed config as ``orch launch`` (``orch k8s render``).

One module per format (``job``: plain Kubernetes, ``pytorchjob``: Kubeflow training-operator, ``rayjob``:
KubeRay), the pod pieces they share (``pods``), the standalone rendezvous store and its objects (``store``),
and the entry point (``render``). Rendering is pure: no cluster, no network, no clock.
"""

from orchestrator.k8s.render import FORMATS, Rendered, render, write

__all__ = ["FORMATS", "Rendered", "render", "write"]
