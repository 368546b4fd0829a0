"""Deployment artefacts: ``k8s`` writes the Kubernetes manifests behind ``batchscope k8s``.

``schemas/`` holds JSON schemas of the two custom resources the manifests use (the
VerticalPodAutoscaler of the Kubernetes autoscaler project and the Prometheus operator's
ServiceMonitor), written after their published CRDs, so the output can be checked offline.
"""
