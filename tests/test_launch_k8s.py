"""`kiln launch k8s`: every document it writes (and the Kueue example in configs/k8s/) is valid
against the real schemas, offline: the CRDs' openAPIV3Schema (tests/data/k8s-schemas/, copied
from Kubeflow Trainer, the Training Operator and Kueue) with jsonschema, made strict the way
`kubectl apply --validate=strict` is (an unknown field is an error), and core objects and the
pod specs inside with kubernetes-validate's upstream schemas. Bad options are one clear error."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils as kv_utils
import pytest
import referencing
import yaml

from kiln.config import load_config
from kiln.errors import KilnError
from kiln.launch import k8s

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = Path(__file__).parent / "data" / "k8s-schemas"
K8S_VERSION = kubernetes_validate.latest_version()

JOB = """\
name: Pretrain_7B
model: {vocab_size: 512, dim: 64, n_layers: 2, n_heads: 4, max_seq_len: 64}
data: {seq_len: 32}
train: {max_steps: 10}
"""


def _strict(schema):
    """An object schema that lists its properties refuses others (the API server prunes or, with
    strict field validation, rejects them); x-kubernetes-preserve-unknown-fields keeps it open."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict:
    group, version = api_version.split("/")
    for path in SCHEMAS.glob(f"{group}_*.yaml"):
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if crd["spec"]["names"]["kind"] == kind:
            for v in crd["spec"]["versions"]:
                if v["name"] == version and v.get("served"):
                    return _strict(v["schema"]["openAPIV3Schema"])
    raise AssertionError(f"no CRD for {kind} {api_version} in {SCHEMAS}")


@functools.cache
def _core_definitions() -> tuple[str, referencing.Registry]:
    defs = kv_utils.schema_contents(
        f"kubernetes-json-schema/v{K8S_VERSION}-local-strict/_definitions.json", K8S_VERSION)
    return defs["$id"], referencing.Resource.from_contents(defs) @ referencing.Registry()


def core_errors(obj: dict, definition: str) -> list[str]:
    """Validate obj against a core Kubernetes definition (e.g. io.k8s.api.core.v1.PodSpec) with
    kubernetes-validate's strict schemas."""
    uri, registry = _core_definitions()
    validator = jsonschema.Draft202012Validator({"$ref": f"{uri}#/$defs/{definition}"},
                                                registry=registry)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def validate(doc: dict) -> None:
    """The document against its real schema; fails the test with every error found."""
    errors = []
    if doc["apiVersion"] == "v1":
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(str(e).splitlines()[0])
    else:
        validator = jsonschema.Draft7Validator(crd_schema(doc["apiVersion"], doc["kind"]))
        errors += [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                   for e in validator.iter_errors(doc)]
        # The CRDs leave metadata open: check it against ObjectMeta.
        errors += core_errors(doc["metadata"], "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
    if doc["kind"] == "PyTorchJob":  # full pod templates inside
        for replica in doc["spec"]["pytorchReplicaSpecs"].values():
            errors += core_errors(replica["template"]["spec"], "io.k8s.api.core.v1.PodSpec")
    assert not errors, f"{doc['kind']} is not valid:\n" + "\n".join(errors)


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    return path


def options(**kw) -> k8s.K8sOptions:
    return k8s.K8sOptions(**{"nodes": 1, "gpus_per_node": 8, "image": "registry.example/kiln:0.2",
                             "pvc": "kiln-data:/mnt/kiln", **kw})


CASES = {
    "1 node, nvidia, pvc, no queue": dict(),
    "4 nodes, nvidia, pvc, queue": dict(nodes=4, queue="team-a", priority_class="kiln-high"),
    "4 nodes, amd, s3, queue": dict(nodes=4, accelerator="amd", pvc=None, s3_secret="s3-creds",
                                    queue="team-a"),
    "2 nodes, selectors and tolerations": dict(
        nodes=2, node_selector=["nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"],
        tolerations=["nvidia.com/gpu:NoSchedule", "dedicated=training:NoExecute", "spot"],
        namespace="team-a", shm_size="64Gi"),
}


@pytest.mark.parametrize("fmt", ["trainjob", "pytorchjob"])
@pytest.mark.parametrize("case", CASES)
def test_manifests_validate_against_real_schemas(job, tmp_path, case, fmt):
    kw = CASES[case]
    s3 = kw.get("s3_secret") is not None
    overrides = ["checkpoint.dir=s3://ckpts/pretrain"] if s3 else []
    manifests = k8s.build(job, overrides, options(format=fmt, **kw))
    config_map, workload = manifests.documents
    for doc in manifests.documents:
        validate(doc)
    assert workload["kind"] == {"trainjob": "TrainJob", "pytorchjob": "PyTorchJob"}[fmt]
    assert manifests.name == "pretrain-7b"  # a DNS name made from the run name

    # The ConfigMap's job YAML loads back into the resolved config, run dir on the PVC.
    (tmp_path / "from-cm.yaml").write_text(config_map["data"]["job.yaml"])
    cfg = load_config(tmp_path / "from-cm.yaml")
    assert cfg == load_config(job, overrides).model_copy(
        update={"out_dir": "runs" if s3 else "/mnt/kiln/runs"})

    pods = ([r["template"]["spec"] for r in workload["spec"]["pytorchReplicaSpecs"].values()]
            if fmt == "pytorchjob" else
            [workload["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
             ["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]])
    if fmt == "pytorchjob":
        replicas = {k: v["replicas"] for k, v in workload["spec"]["pytorchReplicaSpecs"].items()}
        assert replicas == ({"Master": 1} if kw.get("nodes", 1) == 1
                            else {"Master": 1, "Worker": kw["nodes"] - 1})
        container = pods[0]["containers"][0]
        env, resources, command = container["env"], container["resources"], container["command"]
        assert f"--nnodes={kw.get('nodes', 1)}" in command and "--nproc-per-node=8" in command
    else:
        trainer = workload["spec"]["trainer"]
        assert (trainer["numNodes"], trainer["numProcPerNode"]) == (kw.get("nodes", 1), 8)
        env, resources, command = trainer["env"], trainer["resourcesPerNode"], trainer["command"]
    gpu = "amd.com/gpu" if kw.get("accelerator") == "amd" else "nvidia.com/gpu"
    assert resources == {"requests": {gpu: 8}, "limits": {gpu: 8}}
    assert command[0] == "torchrun" and command[-6:] == [
        "-m", "kiln", "train", "/etc/kiln/job.yaml", "--resume", "auto"]
    assert "--rdzv-backend=c10d" in command and "--max-restarts=3" in command

    labels = workload["metadata"]["labels"]
    assert labels.get(k8s.QUEUE_LABEL) == kw.get("queue")
    assert labels.get(k8s.PRIORITY_LABEL) == kw.get("priority_class")
    secret_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
    if s3:  # credentials only as references to the Secret, never as values
        assert secret_env["AWS_SECRET_ACCESS_KEY"] == {"name": "s3-creds",
                                                       "key": "AWS_SECRET_ACCESS_KEY"}
        assert set(secret_env) == set(k8s.S3_KEYS)
    else:
        assert not secret_env
    for pod in pods:
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory",
                                               "sizeLimit": kw.get("shm_size", "16Gi")}
        assert volumes["kiln-job"]["configMap"]["name"] == config_map["metadata"]["name"]
        assert ("kiln-data" in volumes) == (not s3)
        mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert {"/etc/kiln", "/dev/shm"} <= mounts
        assert pod.get("nodeSelector", {}) == dict(
            s.split("=") for s in kw.get("node_selector", []))
        assert len(pod.get("tolerations", [])) == len(kw.get("tolerations", []))
        assert pod["terminationGracePeriodSeconds"] == 120


def test_kueue_example_validates():
    docs = list(yaml.safe_load_all((ROOT / "configs/k8s/kueue.yaml").read_text()))
    assert {d["kind"] for d in docs} == {"ResourceFlavor", "ClusterQueue", "LocalQueue",
                                         "WorkloadPriorityClass"}
    for doc in docs:
        validate(doc)
    queue = next(d for d in docs if d["kind"] == "ClusterQueue")
    covered = queue["spec"]["resourceGroups"][0]["coveredResources"]
    assert "nvidia.com/gpu" in covered


def test_schema_check_catches_a_typo(job):
    """The validation above can fail: a misspelt field, a wrong type are caught."""
    config_map, workload = k8s.build(job, [], options(nodes=2)).documents
    workload["spec"]["trainer"]["numNode"] = workload["spec"]["trainer"].pop("numNodes")
    with pytest.raises(AssertionError, match="numNode"):
        validate(workload)
    config_map["data"]["job.yaml"] = 1
    with pytest.raises(AssertionError, match="not of type"):
        validate(config_map)
    _, pytorchjob = k8s.build(job, [], options(format="pytorchjob")).documents
    pytorchjob["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
        "volumeMount"] = []
    with pytest.raises(AssertionError, match="volumeMount"):
        validate(pytorchjob)


@pytest.mark.parametrize("kw, overrides, message", [
    (dict(nodes=0), [], "--nodes must be at least 1"),
    (dict(accelerator="intel"), [], "--accelerator must be one of nvidia, amd"),
    (dict(pvc="kiln-data"), [], "--pvc 'kiln-data': expected CLAIM:/absolute/mount/path"),
    (dict(pvc="kiln-data:relative"), [], "expected CLAIM:/absolute/mount/path"),
    (dict(format="mpijob"), [], "--format must be trainjob or pytorchjob"),
    (dict(tolerations=["gpu:Sometimes"]), [],
     "--toleration 'gpu:Sometimes'"),
    (dict(priority_class="kiln-high"), [], "needs --queue"),
    (dict(pvc=None), [], "lost when the pod is preempted"),
    (dict(pvc=None), ["checkpoint.dir=s3://b/ckpt"], "--s3-secret NAME"),
    (dict(), ["checkpoint.endpoint_url=https://AKIAABCDEFGHIJKLMNOP:x@s3.example"],
     "looks like a credential"),
    (dict(), ["aws_secret_access_key=abc"], "looks like a credential"),
])
def test_bad_options_are_one_clear_error(job, kw, overrides, message):
    with pytest.raises(KilnError, match=message.replace("(", r"\(").replace("[", r"\[")):
        k8s.build(job, overrides, options(**kw))


def _kiln(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=120)


def test_cli_prints_manifests_and_refuses_inlined_secret(job):
    done = _kiln("launch", "k8s", str(job), "--nodes", "4", "--gpus-per-node", "8",
                 "--image", "r/kiln:0.2", "--queue", "team-a", "--format", "pytorchjob",
                 "--pvc", "kiln-data:/mnt/kiln", "--set", "train.max_steps=20")
    assert done.returncode == 0, done.stderr
    docs = list(yaml.safe_load_all(done.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
    assert "max_steps: 20" in docs[0]["data"]["job.yaml"]
    bad = _kiln("launch", "k8s", str(job), "--nodes", "1", "--gpus-per-node", "8", "--image",
                "r/kiln:0.2", "--pvc", "d:/mnt", "--set",
                "checkpoint.endpoint_url=https://user:hunter2@minio.local")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "credential" in bad.stderr and "hunter2" not in bad.stderr + bad.stdout


def test_apply_without_a_reachable_cluster_is_a_clear_error(job, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    args = ["launch", "k8s", str(job), "--nodes", "1", "--gpus-per-node", "1", "--image",
            "r/kiln:0.2", "--pvc", "d:/mnt", "--apply"]
    done = _kiln(*args, env={"KUBECONFIG": str(kubeconfig)})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "cannot reach the Kubernetes API at https://127.0.0.1:9" in done.stderr
    none = _kiln(*args, env={"KUBECONFIG": str(tmp_path / "missing"), "HOME": str(tmp_path),
                             "KUBERNETES_SERVICE_HOST": ""})
    assert none.returncode == 2 and "no Kubernetes cluster configured" in none.stderr, none.stderr


def test_credential_in_the_job_file_is_refused_and_not_echoed(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB + "checkpoint: {endpoint_url: 'https://admin:hunter2@minio.local'}\n")
    with pytest.raises(KilnError, match=r"'checkpoint.endpoint_url' holds a credential "
                                        r"\(https://minio.local\)") as e:
        k8s.build(path, [], options())
    assert "hunter2" not in str(e.value)
