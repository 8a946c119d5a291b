"""`regent k8s manifest`: print the Kubernetes objects of a run for review or GitOps, without a cluster.

The objects are the ones `regent train --job k8s` creates for each replica (the same builders in
`regent.jobs.kubernetes`): per replica an Indexed Job of `--hosts-per-replica` worker pods and the headless
Service that gives them DNS names. Names are fixed (`<name>-replica-<i>`) instead of carrying the per-allocation
uid, so the output is stable across invocations and diffs cleanly in git.

The job secret is never printed. Every pod mounts one Secret, `<name>-secret` (key `secret`), which the user
creates out of band from a file; the header comment says how. A Secret with a placeholder value is not
printed either: applying it by GitOps would overwrite the real secret with the placeholder.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from regent import settings
from regent.jobs.base import validate_job_name
from regent.jobs.kubernetes import (
    DEFAULT_PORT,
    GPU_RESOURCE,
    JOB_LABEL,
    KubernetesSpec,
    build_job_manifest,
    build_service_manifest,
)

RUN_LABEL = "regent.dev/run"
RESOURCE_PLATFORM = {resource: platform for platform, resource in GPU_RESOURCE.items()}
_LABEL_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_KEY_VALUE_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_./]*)=([-A-Za-z0-9_.]*)$")


class ManifestError(ValueError):
    """Bad input to `regent k8s manifest`; the message names the flag and the fix."""


def replica_job_name(name: str, index: int) -> str:
    """The Job/Service name of replica `index`: what `regent train --job k8s` names its allocations, minus uid."""
    return f"{name}-replica-{index}"


def secret_object_name(name: str) -> str:
    return f"{name}-secret"


def build_run_manifests(
    *,
    image: str,
    name: str = "regent",
    namespace: str = "default",
    replicas: int = 2,
    hosts_per_replica: int = 1,
    procs_per_replica: int = 1,
    gpus_per_pod: int = 0,
    gpu_resource: str | None = None,
    port: int = DEFAULT_PORT,
    cpu: str | None = None,
    memory: str | None = None,
    node_selector: dict[str, str] | None = None,
    service_account: str | None = None,
    image_pull_secrets: Sequence[str] = (),
    image_pull_policy: str | None = None,
    host_network: bool = False,
    shm_size: str | None = "16Gi",
    command: Sequence[str] = ("regent",),
) -> list[dict[str, Any]]:
    """The objects of a run: per replica a headless Service and an Indexed Job. Raises ManifestError on bad input.

    Checks what the API server would only refuse at apply time (names, counts, quantities), so a reviewer
    never sees a manifest that cannot be applied."""
    if not image:
        raise ManifestError("--image is required: a container image with regent installed (e.g. "
                            "ghcr.io/you/regent:0.1.0)")
    try:
        validate_job_name(name)
    except ValueError as exc:
        raise ManifestError(f"--name: {exc}") from exc
    if not _LABEL_RE.match(namespace) or len(namespace) > 63:
        raise ManifestError(f"--namespace {namespace!r} is not a valid namespace name (lowercase letters, digits "
                            f"and '-', at most 63)")
    for flag, value in (("--replicas", replicas), ("--hosts-per-replica", hosts_per_replica),
                        ("--procs-per-replica", procs_per_replica)):
        if value < 1:
            raise ManifestError(f"{flag} must be at least 1, not {value}")
    if gpus_per_pod < 0:
        raise ManifestError(f"--gpus-per-pod must be 0 (no GPUs) or more, not {gpus_per_pod}")
    if gpu_resource is not None and gpu_resource not in RESOURCE_PLATFORM:
        raise ManifestError(f"--gpu-resource {gpu_resource!r} is not supported; use one of "
                            f"{', '.join(sorted(RESOURCE_PLATFORM))}")
    if gpu_resource is not None and gpus_per_pod == 0:
        raise ManifestError("--gpu-resource needs --gpus-per-pod G (G > 0): how many GPUs each pod asks for")
    if gpus_per_pod and procs_per_replica > gpus_per_pod * hosts_per_replica:
        raise ManifestError(
            f"--procs-per-replica {procs_per_replica} needs one GPU per trainer process, but a replica has "
            f"{gpus_per_pod * hosts_per_replica} (--gpus-per-pod {gpus_per_pod} x --hosts-per-replica "
            f"{hosts_per_replica}); raise --gpus-per-pod or lower --procs-per-replica")
    if not 1 <= port <= 65535:
        raise ManifestError(f"--port must be a TCP port (1-65535), not {port}")
    for flag, quantity in (("--cpu", cpu), ("--memory", memory), ("--shm-size", shm_size)):
        if quantity is not None and not _QUANTITY_RE.match(quantity):
            raise ManifestError(f"{flag} {quantity!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")
    platform = RESOURCE_PLATFORM[gpu_resource or "nvidia.com/gpu"]
    objects: list[dict[str, Any]] = []
    for index in range(replicas):
        spec = KubernetesSpec(
            name=replica_job_name(name, index), hosts=hosts_per_replica, image=image, namespace=namespace,
            port=port, gpus_per_host=gpus_per_pod or None, platform=platform, command=tuple(command), cpu=cpu,
            memory=memory, node_selector=dict(node_selector or {}), service_account=service_account,
            image_pull_policy=image_pull_policy, image_pull_secrets=tuple(image_pull_secrets),
            host_network=host_network, shm_size=shm_size,
            labels={RUN_LABEL: name, "regent.dev/replica": str(index)},
            secret_object=secret_object_name(name),
        )
        objects.append(build_service_manifest(spec))
        objects.append(build_job_manifest(spec))
    return objects


CONTROLLER_RUNS_DIR = "/runs"


def controller_job_name(name: str) -> str:
    return f"{name}-controller"


def controller_script(run_dir: str, train_args: str) -> str:
    """The controller's command: take the run over when its directory (on the volume) says one was started,
    else start it. A finished run ends the pod successfully, so the Job completes instead of training again."""
    return (f'run={run_dir}\n'
            f'if [ -f "$run/summary.json" ]; then echo "run $run finished"; exit 0; fi\n'
            f'if [ -f "$run/controller/attach.json" ]; then exec regent train --resume "$run" --takeover --no-live; fi\n'
            f'exec regent train --job k8s --no-live --run-dir "$run" {train_args}\n')


def build_controller_manifest(*, image: str, name: str, namespace: str, volume_claim: str, train_args: str = "",
                              service_account: str | None = None, image_pull_policy: str | None = None,
                              image_pull_secrets: Sequence[str] = ()) -> dict[str, Any]:
    """The controller (`regent train`) as a Kubernetes Job of one pod that Kubernetes restarts (issue 33).

    A Job, not a Deployment: a Deployment restarts a finished run forever. `restartPolicy: OnFailure` restarts
    a crashed or OOM-killed controller in place; a deleted or evicted pod is replaced (`backoffLimit`). The run
    directory lives on `volume_claim` (a PersistentVolumeClaim the user made), so the new pod finds it and
    resumes: on the same pod the replicas it adopts trained on meanwhile (`--controller-grace`); on a new pod
    the old one's processes are gone with it, and the run goes on from its backstop (`--takeover`, counted)."""
    if not volume_claim or not _LABEL_RE.match(volume_claim):
        raise ManifestError(f"--controller-volume-claim {volume_claim!r}: name an existing PersistentVolumeClaim "
                            "(lowercase letters, digits and '-') to hold the run directory")
    job = controller_job_name(name)
    container: dict[str, Any] = {
        "name": "controller", "image": image,
        "command": ["sh", "-c", controller_script(f"{CONTROLLER_RUNS_DIR}/{name}", train_args)],
        "env": [{"name": settings.REGENT_JOB_SECRET_FILE.name, "value": "/etc/regent/secret"},
                {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "volumeMounts": [{"name": "regent-secret", "mountPath": "/etc/regent", "readOnly": True},
                         {"name": "runs", "mountPath": CONTROLLER_RUNS_DIR}],
    }
    if image_pull_policy:
        container["imagePullPolicy"] = image_pull_policy
    pod_spec: dict[str, Any] = {
        "restartPolicy": "OnFailure",
        "containers": [container],
        "volumes": [{"name": "regent-secret", "secret": {"secretName": secret_object_name(name), "defaultMode": 0o400}},
                    {"name": "runs", "persistentVolumeClaim": {"claimName": volume_claim}}],
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account  # it creates the replicas' Jobs: it needs that RBAC
    if image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in image_pull_secrets]
    labels = {RUN_LABEL: name, "regent.dev/role": "controller"}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": job, "namespace": namespace, "labels": labels},
            "spec": {"completions": 1, "parallelism": 1, "backoffLimit": 100,
                     "template": {"metadata": {"labels": labels}, "spec": pod_spec}}}


def secret_instructions(name: str, namespace: str) -> list[str]:
    """How to create the Secret the pods mount, from a file (never a literal on a command line)."""
    secret = secret_object_name(name)
    return [
        f"The job secret is not in this output. Every pod mounts the Secret {secret!r} (key 'secret', file mode",
        "0400). Create it once from a file, so the value never appears on a command line, in shell history or",
        "in git:",
        "  (umask 077; python3 -c 'import secrets; print(secrets.token_hex(32))' > regent-secret.hex)",
        f"  kubectl -n {namespace} create secret generic {secret} --from-file=secret=regent-secret.hex",
        "or manage it with your secret store (External Secrets, Sealed Secrets, ...). The controller that attaches",
        "to these workers needs the same secret (REGENT_JOB_SECRET_FILE=regent-secret.hex).",
    ]


def to_yaml(objects: Sequence[dict[str, Any]], header: Sequence[str] = ()) -> str:
    """Multi-document block YAML (a `---` per object) with `header` as leading comments.

    Written here rather than with PyYAML, which is not a runtime dependency. Only the value types the
    builders produce occur: dicts, lists, str, int, bool and None. Strings are plain only when YAML 1.1 and
    1.2 both read them back as the same string; otherwise they are JSON-quoted (valid YAML double quotes)."""
    out = [f"# {line}".rstrip() for line in header]
    for obj in objects:
        out.append("---")
        out.extend(_block(obj, 0))
    return "\n".join(out) + "\n"


_PLAIN_RE = re.compile(r"^[A-Za-z_/][A-Za-z0-9_./-]*$")
_YAML_WORDS = frozenset({"y", "n", "yes", "no", "true", "false", "on", "off", "null", "~"})


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if _PLAIN_RE.match(value) and value.lower() not in _YAML_WORDS:
            return value
        return json.dumps(value)
    raise TypeError(f"cannot write {type(value).__name__} as YAML here")


def _block(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            head = f"{pad}{_scalar(str(key))}:"
            if isinstance(item, (dict, list)) and item:
                lines.append(head)
                lines.extend(_block(item, indent + 2 if isinstance(item, dict) else indent))
            else:
                lines.append(f"{head} {_inline(item)}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)) and item:
                inner = _block(item, indent + 2)
                lines.append(f"{pad}- {inner[0].lstrip()}")
                lines.extend(inner[1:])
            else:
                lines.append(f"{pad}- {_inline(item)}")
    else:
        lines.append(f"{pad}{_inline(value)}")
    return lines


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def _key_values(items: Sequence[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        match = _KEY_VALUE_RE.match(item)
        if not match:
            raise ManifestError(f"{flag} {item!r}: expected KEY=VALUE (a label key and value)")
        out[match.group(1)] = match.group(2)
    return out


def add_parser(subparsers: Any) -> None:
    """Register `regent k8s` (with its one action, `manifest`)."""
    k8s = subparsers.add_parser("k8s", help="Kubernetes helpers (print the objects a run creates)")
    actions = k8s.add_subparsers(dest="k8s_action", metavar="ACTION")
    p = actions.add_parser(
        "manifest", help="print the Kubernetes objects of a run (for review or GitOps); no cluster needed",
        description="Print, per replica, the Indexed Job of worker pods and its headless Service that "
                    "`regent train --job k8s` creates. The job secret is not printed: create the Secret "
                    "from a file as the header comment says.")
    p.add_argument("--image", required=False, default="", help="container image with regent installed (required)")
    p.add_argument("--name", default="regent", help="name prefix of every object (default: regent)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--replicas", type=int, default=2, help="replica groups: one Indexed Job each (default 2)")
    p.add_argument("--hosts-per-replica", type=int, default=1, help="worker pods per replica (default 1)")
    p.add_argument("--procs-per-replica", type=int, default=1,
                   help="trainer processes per replica; with GPUs each needs one (default 1)")
    p.add_argument("--gpus-per-pod", type=int, default=0, help="GPUs each worker pod asks for (default 0: none)")
    p.add_argument("--gpu-resource", default=None, metavar="RESOURCE",
                   help="extended resource for GPUs: nvidia.com/gpu (default) or amd.com/gpu")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"worker port (default {DEFAULT_PORT})")
    p.add_argument("--cpu", default=None, help="CPU request and limit per pod, e.g. 16")
    p.add_argument("--memory", default=None, help="memory request and limit per pod, e.g. 128Gi")
    p.add_argument("--shm-size", default="16Gi", help="size of the /dev/shm memory volume (default 16Gi)")
    p.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--service-account", default=None)
    p.add_argument("--image-pull-secret", action="append", default=[], metavar="NAME")
    p.add_argument("--image-pull-policy", default=None, choices=("Always", "IfNotPresent", "Never"))
    p.add_argument("--host-network", action="store_true", help="pods use the node's network (node IPs)")
    p.add_argument("--controller-volume-claim", default=None, metavar="PVC",
                   help="also print the controller: a Job of one pod running regent train with its run directory "
                        "on this PersistentVolumeClaim, restarted by Kubernetes and resuming the run (--resume)")
    p.add_argument("--train-args", default="", metavar="'--replicas 4 ...'",
                   help="with --controller-volume-claim: the regent train flags of the run")
    p.add_argument("--output", "-o", default="yaml", choices=("yaml", "json"),
                   help="yaml: multi-document YAML (default); json: one v1 List")
    p.set_defaults(func=run_manifest)
    k8s.set_defaults(func=lambda _args: (k8s.print_help(), 2)[1])


def run_manifest(args: argparse.Namespace) -> int:
    """Print the manifests; on bad input print the reason and the fix to stderr and return 2."""
    try:
        objects = build_run_manifests(
            image=args.image, name=args.name, namespace=args.namespace, replicas=args.replicas,
            hosts_per_replica=args.hosts_per_replica, procs_per_replica=args.procs_per_replica,
            gpus_per_pod=args.gpus_per_pod, gpu_resource=args.gpu_resource, port=args.port, cpu=args.cpu,
            memory=args.memory, node_selector=_key_values(args.node_selector, "--node-selector"),
            service_account=args.service_account, image_pull_secrets=args.image_pull_secret,
            image_pull_policy=args.image_pull_policy, host_network=args.host_network,
            shm_size=args.shm_size or None,
        )
        if args.controller_volume_claim is not None:
            objects.append(build_controller_manifest(
                image=args.image, name=args.name, namespace=args.namespace,
                volume_claim=args.controller_volume_claim, train_args=args.train_args,
                service_account=args.service_account, image_pull_policy=args.image_pull_policy,
                image_pull_secrets=args.image_pull_secret))
    except ManifestError as exc:
        print(f"regent k8s manifest: {exc}", file=sys.stderr)
        return 2
    notes = secret_instructions(args.name, args.namespace)
    if args.output == "json":
        print("\n".join(notes), file=sys.stderr)  # JSON has no comments; keep stdout machine-readable
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
    else:
        header = [f"regent k8s manifest: {args.replicas} replica(s) x {args.hosts_per_replica} worker pod(s); "
                  f"select them with -l {RUN_LABEL}={args.name}", "", *notes,
                  "", f"Each replica's pods carry {JOB_LABEL}=<job name>; restartPolicy Never and backoffLimit 0:",
                  "a failed pod is not restarted by Kubernetes (`regent train --job k8s` replaces the Job instead)."]
        sys.stdout.write(to_yaml(objects, header))
    return 0
