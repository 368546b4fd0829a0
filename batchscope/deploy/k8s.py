"""``batchscope k8s``: the Kubernetes manifests that serve one model.

Four documents, as YAML:

- a ``Deployment`` running ``batchscope serve`` for the model on port 8000 (named
  ``http``), listening on every address with the control token from a Secret (required
  beyond loopback), recording into the database named by another Secret, with a startup
  probe and a liveness probe on ``/v2/health/live`` and a readiness probe on
  ``/v2/health/ready``; its ``resources:`` come from the recorded usage
  (``analysis.recommend``) when ``--db`` is given, else from ``DEFAULT_RESOURCES``;
- a ``Service`` in front of it;
- a ``VerticalPodAutoscaler`` for the Deployment, in ``Initial`` mode by default (new
  pods get the recommended requests; a running replica is never evicted mid-batch), its
  ``minAllowed``/``maxAllowed`` from the recommendation's bounds;
- a Prometheus operator ``ServiceMonitor`` scraping ``/metrics``.

The Secrets are not written (they hold secrets): create them with ``kubectl create
secret generic batchscope-db --from-literal=url=postgresql+psycopg://...`` and
``kubectl create secret generic batchscope-control-token --from-literal=token=...``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from importlib import resources as package_files
from typing import NoReturn, Sequence

import yaml

from batchscope.analysis import recommend

CONTAINER = "batchscope"
HTTP_PORT_NAME = "http"
LIVE_PATH, READY_PATH, METRICS_PATH = "/v2/health/live", "/v2/health/ready", "/metrics"
#: requests/limits when no recorded usage says better
DEFAULT_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"},
                     "limits": {"cpu": "2", "memory": "4Gi"}}
VPA_MODES = ("Off", "Initial", "Recreate", "InPlaceOrRecreate")
KINDS = ("deployment", "service", "vpa", "servicemonitor")
EXIT_USAGE = 2
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DURATION = re.compile(r"^(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?$")


class UsageError(Exception):
    """A mistake in the command line; reported as one line, exit status 2."""


@dataclass(frozen=True)
class Spec:
    """What the manifests serve and where."""

    #: the model spec handed to ``batchscope serve --model`` (builtin name, module:Class, ...)
    model: str
    name: str
    namespace: str | None = None
    image: str = "batchscope:latest"
    replicas: int = 1
    port: int = 8000
    device: str = "cpu"
    #: Secret with key ``url`` holding the database URL; None serves with --no-record
    db_secret: str | None = "batchscope-db"
    #: Secret with key ``token`` holding the control token
    token_secret: str = "batchscope-control-token"
    scrape_interval: str = "15s"
    vpa_mode: str = "Initial"
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.model:
            raise UsageError("--model is empty: name the model to serve (e.g. mlp)")
        for what, value in (("--name", self.name), ("--namespace", self.namespace)):
            if value is not None and (len(value) > 63 or not _DNS_LABEL.match(value)):
                raise UsageError(f"{what} {value!r} is not a Kubernetes name: use at most 63 "
                                 "lower-case letters, digits and '-', starting and ending "
                                 "with a letter or digit")
        if self.replicas < 0:
            raise UsageError(f"--replicas must be 0 or more, got {self.replicas}")
        if not 1 <= self.port <= 65535:
            raise UsageError(f"--port must be 1..65535, got {self.port}")
        if not self.image.strip():
            raise UsageError("--image is empty: name the container image with batchscope "
                             "installed")
        if not self.scrape_interval or not _DURATION.match(self.scrape_interval):
            raise UsageError(f"--scrape-interval {self.scrape_interval!r} is not a duration "
                             "such as 15s, 1m or 1m30s")
        if self.vpa_mode not in VPA_MODES:
            raise UsageError(f"--vpa-mode {self.vpa_mode!r} is not one of {', '.join(VPA_MODES)}")

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")


def default_name(model: str) -> str:
    """``batchscope-<model>`` as a Kubernetes name (a path or ``module:Class`` spec is
    reduced to its last part)."""
    base = re.split(r"[/:]", model.strip())[-1].removesuffix(".py")
    slug = re.sub(r"[^a-z0-9]+", "-", base.lower()).strip("-") or "model"
    return f"batchscope-{slug}"[:63].rstrip("-")


# -- the documents ----------------------------------------------------------------------
def selector_labels(spec: Spec) -> dict:
    return {"app.kubernetes.io/name": "batchscope", "app.kubernetes.io/instance": spec.name}


def labels(spec: Spec) -> dict:
    model = re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.model)[:63].strip("-_.") or "model"
    return {**selector_labels(spec), "app.kubernetes.io/component": "inference",
            "batchscope.io/model": model}


def metadata(spec: Spec, **extra) -> dict:
    out = {"name": spec.name}
    if spec.namespace:
        out["namespace"] = spec.namespace
    out["labels"] = labels(spec)
    out.update(extra)
    return out


def _cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000.0 if quantity.endswith("m") else float(quantity)


def container_resources(spec: Spec, rec: recommend.Recommendation | None,
                        options: recommend.VpaOptions | None = None) -> dict:
    """The recommendation's requests/limits, the defaults for what it lacks, one GPU
    on a CUDA device."""
    found = recommend.resources(rec, options) if rec is not None else {}
    out = {}
    for part in ("requests", "limits"):
        merged = {**DEFAULT_RESOURCES[part], **found.get(part, {})}
        merged.pop("nvidia.com/gpu", None)
        out[part] = merged
    if spec.gpu:
        out["limits"]["nvidia.com/gpu"] = 1
    return out


def _probe(path: str, *, period_s: int, failures: int, timeout_s: int) -> dict:
    return {"httpGet": {"path": path, "port": HTTP_PORT_NAME}, "periodSeconds": period_s,
            "timeoutSeconds": timeout_s, "failureThreshold": failures}


def deployment(spec: Spec, resources: dict) -> dict:
    args = ["serve", "--model", spec.model, "--host", "0.0.0.0", "--port", str(spec.port),
            "--device", spec.device]
    if not spec.gpu:  # as many PyTorch threads as the CPUs requested, not the node's count
        args += ["--torch-threads", str(max(1, math.ceil(_cores(resources["requests"]["cpu"]))))]
    env = [{"name": "BATCHSCOPE_CONTROL_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": spec.token_secret, "key": "token"}}}]
    if spec.db_secret:
        env.insert(0, {"name": "BATCHSCOPE_DB_URL",
                       "valueFrom": {"secretKeyRef": {"name": spec.db_secret, "key": "url"}}})
    else:
        args.append("--no-record")
    container = {
        "name": CONTAINER, "image": spec.image, "command": ["batchscope"],
        "args": args + list(spec.extra_args),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": spec.port, "protocol": "TCP"}],
        "env": env, "resources": resources,
        # loading a model may take minutes; the liveness probe waits for the first answer
        "startupProbe": _probe(LIVE_PATH, period_s=5, failures=60, timeout_s=5),
        # a replica busy with large batches answers late, not never: a generous timeout
        "livenessProbe": _probe(LIVE_PATH, period_s=10, failures=3, timeout_s=5),
        "readinessProbe": _probe(READY_PATH, period_s=5, failures=3, timeout_s=3),
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(spec.port),
              "prometheus.io/path": METRICS_PATH}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(spec),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(spec)},
            # a new replica is ready before an old one goes: capacity never drops
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels(spec), "annotations": scrape},
                "spec": {"terminationGracePeriodSeconds": 30, "containers": [container]},
            },
        },
    }


def service(spec: Spec) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(spec),
            "spec": {"type": "ClusterIP", "selector": selector_labels(spec),
                     "ports": [{"name": HTTP_PORT_NAME, "port": spec.port,
                                "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}]}}


def service_monitor(spec: Spec) -> dict:
    out = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
           "metadata": metadata(spec),
           "spec": {"selector": {"matchLabels": selector_labels(spec)},
                    "endpoints": [{"port": HTTP_PORT_NAME, "path": METRICS_PATH,
                                   "interval": spec.scrape_interval, "scheme": "http"}]}}
    if spec.namespace:
        out["spec"]["namespaceSelector"] = {"matchNames": [spec.namespace]}
    return out


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(seconds))


def vpa(spec: Spec, rec: recommend.Recommendation | None) -> dict:
    """The VerticalPodAutoscaler: the recommendation's lower bounds as ``minAllowed``, its
    upper bounds as ``maxAllowed`` once a day of history backs them (VPA's own upper
    bound is unbounded before), the GPU memory target as an annotation (VPA has no GPU
    resource)."""
    policy: dict = {"containerName": CONTAINER, "controlledResources": ["cpu", "memory"],
                    "controlledValues": "RequestsAndLimits"}
    annotations = {}
    if rec is not None:
        lows, highs = {}, {}
        for res, quantity in (("cpu", recommend.cpu_quantity),
                              ("memory", recommend.memory_quantity)):
            est = getattr(rec, res)
            if est is None:
                continue
            lows[res] = quantity(est.lower)
            if est.confidence_days >= 1.0 and math.isfinite(est.upper):
                highs[res] = quantity(est.upper)
        if lows:
            policy["minAllowed"] = lows
        if highs:
            policy["maxAllowed"] = highs
        if rec.gpu_memory is not None:
            annotations["batchscope.io/gpu-memory-target"] = \
                recommend.memory_quantity(rec.gpu_memory.target)
        annotations["batchscope.io/recommended-from"] = (
            f"{len(rec.instances)} instance(s), {_utc(rec.start_s)} to {_utc(rec.end_s)} UTC")
    meta = metadata(spec, annotations=annotations) if annotations else metadata(spec)
    return {"apiVersion": "autoscaling.k8s.io/v1", "kind": "VerticalPodAutoscaler",
            "metadata": meta,
            "spec": {"targetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                   "name": spec.name},
                     "updatePolicy": {"updateMode": spec.vpa_mode},
                     "resourcePolicy": {"containerPolicies": [policy]}}}


def manifests(spec: Spec, rec: recommend.Recommendation | None = None, *,
              options: recommend.VpaOptions | None = None,
              kinds: Sequence[str] = KINDS) -> list[dict]:
    """The documents of ``kinds`` (all four by default), in the order ``KINDS`` lists."""
    build = {"deployment": lambda: deployment(spec, container_resources(spec, rec, options)),
             "service": lambda: service(spec), "vpa": lambda: vpa(spec, rec),
             "servicemonitor": lambda: service_monitor(spec)}
    return [build[k]() for k in KINDS if k in kinds]


def to_yaml(docs: list[dict], header: Sequence[str] = ()) -> str:
    """The documents as one YAML stream, each opened with ``---``, comment lines first."""
    lines = "".join(f"# {line}\n" for line in header)
    return lines + yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True,
                                      default_flow_style=False)


def provenance(rec: recommend.Recommendation | None, model: str) -> list[str]:
    """Comment lines saying where the resources come from."""
    if rec is None:
        return [f"batchscope k8s for model {model}: default resources (no --db, or no "
                "recorded usage for the model)"]
    out = [f"batchscope k8s for model {model}: resources recommended from recorded usage of "
           f"{', '.join(rec.instances)} (VPA's method: p90 target, p50/p95 bounds, 15% margin)"]
    for est in (rec.cpu, rec.memory, rec.gpu_memory):
        if est is not None:
            out.append(f"  {est.resource}: {est.samples} samples, {est.peaks} interval peaks, "
                       f"{est.oom_bumps} OOM bumps, {est.confidence_days:.2f} days of history")
    out += [f"  note: {n}" for n in rec.notes]
    return out


def _matches(selector: dict, labels_: dict) -> bool:
    return bool(selector) and all(labels_.get(k) == v for k, v in selector.items())


def check_links(docs: list[dict]) -> list[str]:
    """What ties the documents together and a schema cannot see: the Deployment's
    selector picks its own pods, the probes and the Service name a port the container
    has, the Service selects the pods, the ServiceMonitor selects the Service and names
    its port, the VPA targets the Deployment. Returns the problems found (none: [])."""
    by_kind = {d.get("kind"): d for d in docs}
    problems = []
    dep, svc = by_kind.get("Deployment"), by_kind.get("Service")
    pod_labels, port_names = {}, set()
    if dep is not None:
        pod = dep["spec"]["template"]
        pod_labels = pod.get("metadata", {}).get("labels", {})
        if not _matches(dep["spec"].get("selector", {}).get("matchLabels", {}), pod_labels):
            problems.append("the Deployment's selector does not match its pod labels")
        for c in pod["spec"]["containers"]:
            names = {p.get("name") for p in c.get("ports", [])}
            port_names |= names
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if isinstance(port, str) and port not in names:
                    problems.append(f"the {probe} of container {c['name']} names port "
                                    f"{port!r}, which the container does not have")
    if svc is not None:
        if dep is not None and not _matches(svc["spec"].get("selector", {}), pod_labels):
            problems.append("the Service's selector does not match the Deployment's pods")
        for p in svc["spec"].get("ports", []):
            target = p.get("targetPort")
            if dep is not None and isinstance(target, str) and target not in port_names:
                problems.append(f"the Service's targetPort {target!r} is no container port")
    mon = by_kind.get("ServiceMonitor")
    if mon is not None and svc is not None:
        if not _matches(mon["spec"].get("selector", {}).get("matchLabels", {}),
                        svc["metadata"].get("labels", {})):
            problems.append("the ServiceMonitor's selector does not match the Service's labels")
        svc_ports = {p.get("name") for p in svc["spec"].get("ports", [])}
        for e in mon["spec"].get("endpoints", []):
            if e.get("port") not in svc_ports:
                problems.append(f"the ServiceMonitor scrapes port {e.get('port')!r}, which the "
                                "Service does not name")
    auto = by_kind.get("VerticalPodAutoscaler")
    if auto is not None and dep is not None:
        ref = auto["spec"].get("targetRef", {})
        if (ref.get("kind"), ref.get("name")) != ("Deployment", dep["metadata"]["name"]):
            problems.append("the VerticalPodAutoscaler does not target the Deployment")
    return problems


def crd_schema(kind: str) -> dict:
    """The JSON schema (``schemas/``) of the custom resource ``kind``
    ("VerticalPodAutoscaler" or "ServiceMonitor"), for an offline check of the output."""
    files = {"VerticalPodAutoscaler": "verticalpodautoscaler-v1.json",
             "ServiceMonitor": "servicemonitor-v1.json"}
    if kind not in files:
        raise ValueError(f"no schema for kind {kind!r}; there are schemas for {', '.join(files)}")
    found = package_files.files("batchscope.deploy").joinpath("schemas", files[kind])
    return json.loads(found.read_text("utf-8"))


# -- the command ------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="batchscope k8s",
                description="Write a Deployment, Service, VerticalPodAutoscaler and "
                            "ServiceMonitor serving one model, as YAML.")
    p.add_argument("--model", required=True, metavar="SPEC",
                   help="the model for batchscope serve --model (builtin name, module:Class, "
                        "path/file.py:Class)")
    p.add_argument("--name", default=None, help="name of every object (default "
                                                "batchscope-<model>)")
    p.add_argument("--namespace", default=None)
    p.add_argument("--image", default="batchscope:latest",
                   help="container image with batchscope installed (default batchscope:latest)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (asks for one nvidia.com/gpu)")
    p.add_argument("--db", default=None, metavar="URL",
                   help="a BatchScope database to size the resources from (the model's "
                        "recorded CPU, memory and GPU memory); default resources without it")
    p.add_argument("--recorded-as", default=None, metavar="NAME",
                   help="the name the model is recorded under in --db (default: --model)")
    p.add_argument("--history-h", type=float, default=recommend.VpaOptions().history_s / 3600,
                   help="hours of recorded history to size from (default 192, VPA's 8 days)")
    p.add_argument("--host-cpus", type=float, default=None,
                   help="CPU count of the hosts the model was recorded on (their CPU "
                        "utilization is host-wide); without it the CPU stays at the default")
    p.add_argument("--db-secret", default="batchscope-db",
                   help="Secret whose key 'url' is the database URL the replicas record "
                        "into (default batchscope-db)")
    p.add_argument("--no-record", action="store_true",
                   help="replicas record nothing (no database Secret)")
    p.add_argument("--token-secret", default="batchscope-control-token",
                   help="Secret whose key 'token' is the control token (default "
                        "batchscope-control-token)")
    p.add_argument("--scrape-interval", default="15s")
    p.add_argument("--vpa-mode", default="Initial", choices=VPA_MODES)
    p.add_argument("--only", default=",".join(KINDS),
                   help=f"comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--out", default="-", metavar="PATH", help="file to write (default stdout)")
    return p


def _recommendation(args: argparse.Namespace) -> recommend.Recommendation | None:
    from batchscope.storage import db

    model = args.recorded_as or args.model
    if args.history_h <= 0:
        raise UsageError(f"--history-h must be > 0, got {args.history_h}")
    try:
        engine = db.make_engine(args.db, create=False)
    except Exception as exc:  # a missing file, a bad URL, a missing driver...
        raise UsageError(f"batchscope k8s: cannot open --db {args.db!r}: {exc}") from None
    try:
        options = recommend.VpaOptions(history_s=args.history_h * 3600.0)
        recs = recommend.recommend(engine, end_s=time.time(), model=model,
                                   host_cpus=args.host_cpus, options=options)
    except Exception as exc:
        raise UsageError(f"batchscope k8s: cannot read the recorded usage in {args.db!r}: "
                         f"{exc}") from None
    finally:
        engine.dispose()
    return next((r for r in recs if r.scope == "model" and r.key == model), None)


def run(args: argparse.Namespace) -> str:
    kinds = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise UsageError(f"--only {args.only!r}: choose from {', '.join(KINDS)}")
    spec = Spec(model=args.model, name=args.name or default_name(args.model),
                namespace=args.namespace, image=args.image, replicas=args.replicas,
                port=args.port, device=args.device,
                db_secret=None if args.no_record else args.db_secret,
                token_secret=args.token_secret, scrape_interval=args.scrape_interval,
                vpa_mode=args.vpa_mode)
    rec = _recommendation(args) if args.db else None
    if args.db and rec is None:
        print(f"batchscope k8s: no recorded usage of model {args.recorded_as or args.model!r} "
              f"in the last {args.history_h:g} h of {args.db}; using the default resources",
              file=sys.stderr)
    return to_yaml(manifests(spec, rec, kinds=kinds), provenance(rec, spec.model))


def main(argv: Sequence[str] | None = None) -> int:
    """``batchscope k8s ...``: 0 when written, 2 with one line on stderr for a mistake."""
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        text = run(args)
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    if args.out == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        try:
            with open(args.out, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            print(f"batchscope k8s: cannot write {args.out}: {exc.strerror or exc}",
                  file=sys.stderr)
            return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
