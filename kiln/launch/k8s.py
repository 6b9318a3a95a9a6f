"""Kubernetes manifests for a kiln job: a Kubeflow Trainer v2 TrainJob or a Training Operator v1
PyTorchJob, plus a ConfigMap holding the resolved job YAML; optionally applied to a cluster.

Every node runs `torchrun ... -m kiln train /etc/kiln/job.yaml --resume auto`: c10d rendezvous on
the first pod (so `--max-restarts` can restart all workers after one dies) and `--resume auto`
(so a restarted or rescheduled pod continues from the newest committed checkpoint).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kiln.errors import KilnError
from kiln.launch.common import ResolvedJob, dns_name, resolve_job

JOB_DIR = "/etc/kiln"
JOB_FILE = f"{JOB_DIR}/job.yaml"
GPU_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
TRAINER_CONTAINER = "node"  # the container name Kubeflow Trainer's torch runtimes use
PYTORCHJOB_CONTAINER = "pytorch"  # the container the Training Operator injects MASTER_ADDR into
PYTORCHJOB_PORT = 23456
# Keys read from the --s3-secret Secret into the environment (the names OpenShift AI data
# connections also use); the optional ones may be absent from the Secret.
S3_KEYS = {"AWS_ACCESS_KEY_ID": False, "AWS_SECRET_ACCESS_KEY": False, "AWS_SESSION_TOKEN": True,
           "AWS_DEFAULT_REGION": True, "AWS_ENDPOINT_URL": True}

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE])?$")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass
class K8sOptions:
    nodes: int
    gpus_per_node: int
    image: str
    queue: str | None = None
    """A Kueue LocalQueue: the job waits for its quota (label kueue.x-k8s.io/queue-name)."""
    priority_class: str | None = None
    """A Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class); needs a queue."""
    accelerator: str = "nvidia"
    format: str = "trainjob"
    runtime: str = "torch-distributed"
    """The ClusterTrainingRuntime a TrainJob runs on."""
    pvc: str | None = None
    """NAME:/mount: a PersistentVolumeClaim for data and the run directory."""
    s3_secret: str | None = None
    """A Secret holding AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and optionally more)."""
    shm_size: str = "16Gi"
    node_selector: list[str] = field(default_factory=list)
    tolerations: list[str] = field(default_factory=list)
    name: str | None = None
    namespace: str | None = None
    max_restarts: int = 3
    """torchrun's --max-restarts, and the PyTorchJob's backoffLimit."""
    grace_seconds: int = 120
    """Time between SIGTERM (eviction, preemption) and SIGKILL: enough to save a checkpoint."""


@dataclass
class Manifests:
    name: str
    documents: list[dict[str, Any]]

    def to_yaml(self) -> str:
        return yaml.dump_all(self.documents, Dumper=_Dumper, sort_keys=False)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the job YAML in the ConfigMap) as readable `|` blocks."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def build(job_path: str | Path, overrides: list[str], opts: K8sOptions) -> Manifests:
    """The ConfigMap and the TrainJob/PyTorchJob for this job; KilnError on a bad option."""
    _check(opts)
    pvc_name, mount = _parse_pvc(opts.pvc) if opts.pvc else (None, None)
    # The run directory (metrics, checkpoints by default) must outlive the pod: on the PVC.
    job = resolve_job(job_path, overrides, out_dir=f"{mount}" if mount else None)
    _check_storage(job.config.checkpoint.dir, mount, opts.s3_secret)
    name = opts.name or dns_name(job.config.name)
    config_map = _config_map(name, job, opts)
    pod = _pod_parts(name, pvc_name, mount, opts)
    if opts.format == "trainjob":
        workload = _trainjob(name, pod, opts)
    else:
        workload = _pytorchjob(name, pod, opts)
    return Manifests(name, [config_map, workload])


def _check_storage(ckpt_dir: str | None, mount: str | None, s3_secret: str | None) -> None:
    """Checkpoints must outlive the pod: on the PVC, or in S3 with a Secret for credentials."""
    if ckpt_dir is None:
        if not mount:
            raise KilnError("checkpoints would be written inside the container and lost when "
                            "the pod is preempted or restarted: give --pvc NAME:/mount for the "
                            "run directory, or set checkpoint.dir to an s3:// URL and name the "
                            "Secret with its credentials with --s3-secret")
    elif ckpt_dir.startswith("s3://"):
        if not s3_secret:
            raise KilnError(f"checkpoint.dir is {ckpt_dir}: name the Secret that holds "
                            f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY with --s3-secret NAME "
                            f"(credentials never go into the manifest)")
    elif "://" not in ckpt_dir and not (mount and Path(ckpt_dir).is_absolute()
                                        and Path(ckpt_dir).is_relative_to(mount)):
        raise KilnError(f"checkpoint.dir {ckpt_dir} is not on shared storage: inside the pod it "
                        f"would be lost at the first restart; leave it unset (the run directory "
                        f"on the --pvc mount) or point it under the --pvc mount or to s3://")


def _check(opts: K8sOptions) -> None:
    problems = []
    if opts.nodes < 1:
        problems.append(f"--nodes must be at least 1 (got {opts.nodes})")
    if opts.gpus_per_node < 1:
        problems.append(f"--gpus-per-node must be at least 1 (got {opts.gpus_per_node})")
    if opts.accelerator not in GPU_RESOURCE:
        problems.append(f"--accelerator must be one of {', '.join(GPU_RESOURCE)} "
                        f"(got {opts.accelerator!r})")
    if opts.format not in ("trainjob", "pytorchjob"):
        problems.append(f"--format must be trainjob or pytorchjob (got {opts.format!r})")
    if not opts.image or any(c.isspace() for c in opts.image):
        problems.append(f"--image must be an image reference like registry/kiln:0.2 "
                        f"(got {opts.image!r})")
    for flag, value, pattern in (("--queue", opts.queue, _LABEL_VALUE),
                                 ("--priority-class", opts.priority_class, _LABEL_VALUE),
                                 ("--s3-secret", opts.s3_secret, _DNS_SUBDOMAIN),
                                 ("--runtime", opts.runtime, _DNS_SUBDOMAIN),
                                 ("--namespace", opts.namespace, _DNS_LABEL),
                                 ("--name", opts.name, _DNS_LABEL)):
        if value is not None and (not value or not pattern.match(value)):
            problems.append(f"{flag} {value!r} is not a valid Kubernetes name")
    if opts.name and len(opts.name) > 40:
        problems.append(f"--name {opts.name!r} is longer than 40 characters (pod host names "
                        f"add a suffix and must stay within 63)")
    if opts.priority_class and not opts.queue:
        problems.append("--priority-class names a Kueue WorkloadPriorityClass: it needs --queue")
    if not _QUANTITY.match(opts.shm_size):
        problems.append(f"--shm-size must be a Kubernetes quantity like 16Gi (got {opts.shm_size!r})")
    if opts.max_restarts < 0:
        problems.append(f"--max-restarts must be >= 0 (got {opts.max_restarts})")
    if opts.grace_seconds < 1:
        problems.append(f"--grace-seconds must be >= 1 (got {opts.grace_seconds})")
    for item in opts.node_selector:
        key, sep, value = item.partition("=")
        if not sep or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
            problems.append(f"--node-selector {item!r}: expected KEY=VALUE with a valid label key "
                            f"and value, e.g. nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3")
    for item in opts.tolerations:
        try:
            _toleration(item)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise KilnError("kiln launch k8s: " + "; ".join(problems) + ".")


def _parse_pvc(spec: str) -> tuple[str, str]:
    name, sep, mount = spec.partition(":")
    if not sep or not _DNS_SUBDOMAIN.match(name) or not mount.startswith("/") \
            or mount.rstrip("/") in ("", JOB_DIR, "/dev/shm"):
        raise KilnError(f"--pvc {spec!r}: expected CLAIM:/absolute/mount/path, e.g. "
                        f"kiln-data:/mnt/kiln (a PersistentVolumeClaim name, then where to "
                        f"mount it; not /, {JOB_DIR} or /dev/shm)")
    return name, mount.rstrip("/")


def _toleration(item: str) -> dict[str, str]:
    """kubectl-taint syntax: KEY[=VALUE][:EFFECT]; without a value the key need only exist."""
    body, _, effect = item.partition(":")
    key, sep, value = body.partition("=")
    if not _LABEL_KEY.match(key) or (effect and effect not in _EFFECTS) \
            or (sep and not _LABEL_VALUE.match(value)):
        raise ValueError(f"--toleration {item!r}: expected KEY[=VALUE][:EFFECT] with EFFECT one "
                         f"of {', '.join(_EFFECTS)}, e.g. nvidia.com/gpu:NoSchedule")
    tol = {"key": key, "operator": "Equal" if sep else "Exists"}
    if sep:
        tol["value"] = value
    if effect:
        tol["effect"] = effect
    return tol


def _config_map(name: str, job: ResolvedJob, opts: K8sOptions) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(f"{name}-job", opts, labels={"app.kubernetes.io/name": "kiln",
                                                                "kiln/job": name}),
            "data": {"job.yaml": job.yaml}}


def _metadata(name: str, opts: K8sOptions, labels: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {"name": name}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    if labels:
        meta["labels"] = labels
    return meta


@dataclass
class _Pod:
    env: list[dict]
    volumes: list[dict]
    mounts: list[dict]
    node_selector: dict[str, str]
    tolerations: list[dict]
    resources: dict


def _pod_parts(name: str, pvc_name: str | None, mount: str | None, opts: K8sOptions) -> _Pod:
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"},
           # torchrun waits this long for workers to save and exit after SIGTERM (then SIGKILL);
           # keep it inside the pod's grace period.
           {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
            "value": str(max(opts.grace_seconds - 10, 1))}]
    if opts.s3_secret:
        env += [{"name": key, "valueFrom": {"secretKeyRef": {
            "name": opts.s3_secret, "key": key, **({"optional": True} if optional else {})}}}
            for key, optional in S3_KEYS.items()]
    volumes = [{"name": "kiln-job", "configMap": {"name": f"{name}-job"}},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}}]
    mounts = [{"name": "kiln-job", "mountPath": JOB_DIR, "readOnly": True},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    if pvc_name:
        volumes.append({"name": "kiln-data", "persistentVolumeClaim": {"claimName": pvc_name}})
        mounts.append({"name": "kiln-data", "mountPath": mount})
    gpus = {GPU_RESOURCE[opts.accelerator]: opts.gpus_per_node}
    return _Pod(env, volumes, mounts,
                dict(item.split("=", 1) for item in opts.node_selector),
                [_toleration(item) for item in opts.tolerations],
                {"requests": dict(gpus), "limits": dict(gpus)})


def _train_command(name: str, endpoint: str, opts: K8sOptions, nodes_args: list[str]) -> list[str]:
    return ["torchrun", *nodes_args, "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={name}", f"--max-restarts={opts.max_restarts}",
            "-m", "kiln", "train", JOB_FILE, "--resume", "auto"]


def _job_labels(opts: K8sOptions) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "kiln"}
    if opts.queue:
        labels[QUEUE_LABEL] = opts.queue
    if opts.priority_class:
        labels[PRIORITY_LABEL] = opts.priority_class
    return labels


def _trainjob(name: str, pod: _Pod, opts: K8sOptions) -> dict:
    # numNodes / numProcPerNode reach torchrun as PET_NNODES / PET_NPROC_PER_NODE, set by the
    # runtime's torch plugin together with PET_MASTER_ADDR / PET_MASTER_PORT (the first pod).
    pod_spec: dict[str, Any] = {
        "volumes": pod.volumes,
        "terminationGracePeriodSeconds": opts.grace_seconds,
        "containers": [{"name": TRAINER_CONTAINER, "volumeMounts": pod.mounts}]}
    if pod.node_selector:
        pod_spec["nodeSelector"] = pod.node_selector
    if pod.tolerations:
        pod_spec["tolerations"] = pod.tolerations
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": _metadata(name, opts, _job_labels(opts)),
        "spec": {
            "runtimeRef": {"name": opts.runtime},
            "trainer": {
                "image": opts.image,
                "command": _train_command(name, "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)", opts, []),
                "numNodes": opts.nodes,
                "numProcPerNode": opts.gpus_per_node,
                "resourcesPerNode": pod.resources,
                "env": pod.env},
            "runtimePatches": [{"manager": "kiln", "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {
                    "spec": pod_spec}}}}]}}}}]}}


def _pytorchjob(name: str, pod: _Pod, opts: K8sOptions) -> dict:
    command = _train_command(name, "$(MASTER_ADDR):$(MASTER_PORT)", opts,
                             [f"--nnodes={opts.nodes}", f"--nproc-per-node={opts.gpus_per_node}"])
    container = {"name": PYTORCHJOB_CONTAINER, "image": opts.image, "command": command,
                 "env": pod.env, "resources": pod.resources, "volumeMounts": pod.mounts,
                 "ports": [{"name": "pytorchjob-port", "containerPort": PYTORCHJOB_PORT}]}
    pod_spec: dict[str, Any] = {"containers": [container], "volumes": pod.volumes,
                                "terminationGracePeriodSeconds": opts.grace_seconds}
    if pod.node_selector:
        pod_spec["nodeSelector"] = pod.node_selector
    if pod.tolerations:
        pod_spec["tolerations"] = pod.tolerations

    def replicas(n: int) -> dict:
        # OnFailure: a failed container restarts in place and resumes from the last checkpoint.
        return {"replicas": n, "restartPolicy": "OnFailure", "template": {"spec": pod_spec}}

    specs = {"Master": replicas(1)}
    if opts.nodes > 1:
        specs["Worker"] = replicas(opts.nodes - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": _metadata(name, opts, _job_labels(opts)),
            "spec": {"nprocPerNode": str(opts.gpus_per_node),
                     "runPolicy": {"backoffLimit": opts.max_restarts, "cleanPodPolicy": "None"},
                     "pytorchReplicaSpecs": specs}}


def apply(manifests: Manifests, namespace: str | None = None) -> str:
    """Create the ConfigMap and the job through the Kubernetes API; returns 'namespace/name'."""
    try:
        from kubernetes import client, config
        from kubernetes.client.rest import ApiException
        from kubernetes.config.config_exception import ConfigException
        from urllib3.exceptions import HTTPError
    except ImportError:
        raise KilnError("--apply needs the Kubernetes Python client: pip install 'kiln[k8s]' "
                        "(or pip install kubernetes); without --apply the manifests are printed "
                        "for kubectl apply -f -") from None
    try:
        try:
            config.load_kube_config()
            _, context = config.list_kube_config_contexts()
            default_ns = context.get("context", {}).get("namespace") or "default"
        except ConfigException:
            config.load_incluster_config()
            default_ns = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace"
                              ).read_text().strip()
    except (ConfigException, OSError) as e:
        raise KilnError(f"--apply: no Kubernetes cluster configured (no usable kubeconfig at "
                        f"$KUBECONFIG or ~/.kube/config, and not inside a pod): {e}") from None
    ns = namespace or default_ns
    config_map, job = manifests.documents
    group, version = job["apiVersion"].split("/")
    plural = {"TrainJob": "trainjobs", "PyTorchJob": "pytorchjobs"}[job["kind"]]
    core, custom = client.CoreV1Api(), client.CustomObjectsApi()
    where = client.Configuration.get_default_copy().host
    try:
        core.create_namespaced_config_map(ns, config_map, _request_timeout=30)
        created = custom.create_namespaced_custom_object(group, version, ns, plural, job,
                                                         _request_timeout=30)
        # Owned by the job, the ConfigMap goes when the job is deleted.
        owner = {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": manifests.name,
                 "uid": created["metadata"]["uid"]}
        core.patch_namespaced_config_map(config_map["metadata"]["name"], ns,
                                         {"metadata": {"ownerReferences": [owner]}},
                                         _request_timeout=30)
    except ApiException as e:
        hint = (" (delete the old one, or pick another --name)" if e.status == 409 else
                f" (is the {job['kind']} CRD installed?)" if e.status == 404 else "")
        raise KilnError(f"--apply: the Kubernetes API at {where} refused {job['kind']} "
                        f"{ns}/{manifests.name}: {e.status} {e.reason}{hint}") from None
    except (HTTPError, OSError) as e:  # the cluster cannot be reached
        raise KilnError(f"--apply: cannot reach the Kubernetes API at {where}: "
                        f"{type(e).__name__}: {e}") from None
    return f"{ns}/{manifests.name}"
