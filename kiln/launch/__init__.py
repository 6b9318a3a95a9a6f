"""`kiln launch`: start a job the way a cluster expects it (Kubernetes manifests, Slurm scripts).

This module only parses and dispatches; kiln/launch/k8s.py and kiln/launch/slurm.py do the work.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(commands) -> None:
    """The `kiln launch k8s|slurm` subcommands on the kiln command's subparsers."""
    launch = commands.add_parser("launch", help="run a job on a cluster (Kubernetes, Slurm)")
    targets = launch.add_subparsers(dest="launch_target", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="a YAML job file")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field (repeatable); never a credential")
        p.add_argument("--nodes", type=int, required=True, help="number of nodes")
        p.add_argument("--name", help="the job's name (default: from the run name)")
        p.add_argument("--max-restarts", type=int, default=3,
                       help="torchrun --max-restarts: restarts of all workers after one dies")

    k8s = targets.add_parser("k8s", help="a Kubeflow TrainJob or PyTorchJob (+ ConfigMap)")
    common(k8s)
    k8s.add_argument("--gpus-per-node", type=int, required=True)
    k8s.add_argument("--image", required=True, help="a container image with kiln installed")
    k8s.add_argument("--queue", help="a Kueue LocalQueue; the job waits for its quota")
    k8s.add_argument("--priority-class", help="a Kueue WorkloadPriorityClass (needs --queue)")
    k8s.add_argument("--accelerator", default="nvidia", help="nvidia (nvidia.com/gpu) or amd "
                                                             "(amd.com/gpu)")
    k8s.add_argument("--format", default="trainjob",
                     help="trainjob (Kubeflow Trainer v2) or pytorchjob (Training Operator v1)")
    k8s.add_argument("--runtime", default="torch-distributed",
                     help="the ClusterTrainingRuntime of a TrainJob")
    k8s.add_argument("--pvc", metavar="CLAIM:/MOUNT",
                     help="a PersistentVolumeClaim for the run directory (and data)")
    k8s.add_argument("--s3-secret", metavar="SECRET",
                     help="a Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for s3://")
    k8s.add_argument("--shm-size", default="16Gi", help="size of /dev/shm (data workers)")
    k8s.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE")
    k8s.add_argument("--toleration", dest="tolerations", action="append", default=[],
                     metavar="KEY[=VALUE][:EFFECT]")
    k8s.add_argument("--namespace")
    k8s.add_argument("--grace-seconds", type=int, default=120,
                     help="time from SIGTERM to SIGKILL: enough to save a checkpoint")
    k8s.add_argument("--apply", action="store_true",
                     help="create the objects through the Kubernetes API instead of printing")

    slurm = targets.add_parser("slurm", help="an sbatch script")
    common(slurm)
    slurm.add_argument("--gpus-per-node", type=int, default=0)
    slurm.add_argument("--nproc-per-node", type=int,
                       help="processes per node (default: one per GPU; needed on CPUs)")
    slurm.add_argument("--cpus", type=int, help="CPUs per node")
    slurm.add_argument("--time", required=True, metavar="HH:MM:SS", help="the time limit")
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument("--signal-seconds", type=int, default=120,
                       help="warn this long before the time limit: checkpoint and requeue")
    slurm.add_argument("--max-requeues", type=int, default=20)
    slurm.add_argument("--python", default=sys.executable,
                       help="the Python with kiln on the compute nodes (default: this one)")
    slurm.add_argument("--submit", action="store_true", help="sbatch it and print the job id")


def run(args: argparse.Namespace) -> None:
    """Carry out a parsed `kiln launch ...`; KilnError on a bad option."""
    if args.launch_target == "k8s":
        from kiln.launch import k8s

        opts = k8s.K8sOptions(
            nodes=args.nodes, gpus_per_node=args.gpus_per_node, image=args.image,
            queue=args.queue, priority_class=args.priority_class, accelerator=args.accelerator,
            format=args.format, runtime=args.runtime, pvc=args.pvc, s3_secret=args.s3_secret,
            shm_size=args.shm_size, node_selector=args.node_selector,
            tolerations=args.tolerations, name=args.name, namespace=args.namespace,
            max_restarts=args.max_restarts, grace_seconds=args.grace_seconds)
        manifests = k8s.build(args.config, args.overrides, opts)
        if args.apply:
            where = k8s.apply(manifests, args.namespace)
            kind = manifests.documents[1]["kind"]
            print(f"kiln: created {kind} {where} and its ConfigMap {manifests.name}-job")
        else:
            print(manifests.to_yaml(), end="")
        return
    from kiln.launch import slurm

    opts = slurm.SlurmOptions(
        time=args.time, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        nproc_per_node=args.nproc_per_node, cpus=args.cpus, partition=args.partition,
        account=args.account, signal_seconds=args.signal_seconds,
        max_restarts=args.max_restarts, max_requeues=args.max_requeues, python=args.python,
        name=args.name)
    script = slurm.build(args.config, args.overrides, opts, log_in_run_dir=args.submit)
    if args.submit:
        job_id, path = slurm.submit(script)
        # The id alone on stdout (JOB=$(kiln launch slurm ... --submit)); the rest on stderr.
        print(f"kiln: submitted Slurm job {job_id} ({path}; output in "
              f"{Path(script.run_dir) / f'slurm-{job_id}.out'})", file=sys.stderr)
        print(job_id)
    else:
        print(script.text, end="")
