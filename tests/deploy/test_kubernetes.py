"""The Kubernetes manifests (deploy/kubernetes): every kustomization renders (with the
pure-Python subset in kustomize_lite.py, and where a kustomize binary is installed, equal to
its output), every resource validates offline against the Kubernetes schemas of
``kubernetes-validate`` (strict: an unknown field fails), the LeaderWorkerSet against its
CRD's fields (data/leaderworkerset-v1.schema.json; its pod templates against the core
PodTemplateSpec schema, which the CRD embeds), and every `jaxpaged serve` command line, with
Kubernetes' $(VAR) expansion and LWS's variables, parses with the server's real parser and
agrees with the ports, probes, drain and device counts around it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from kustomize_lite import build

from jaxpaged.args import EngineArgs
from jaxpaged.cli.serve import build_parser
from jaxpaged.distributed import multihost

kubernetes_validate = pytest.importorskip("kubernetes_validate")  # the k8s extra (in dev)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
K8S_VERSION = "1.30"  # the oldest release the manifests target (LWS needs >= 1.26)
LWS_SCHEMA = json.loads(
    (Path(__file__).parent / "data" / "leaderworkerset-v1.schema.json").read_text()
)


def _key(doc: dict) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """kustomization folder (relative to deploy/kubernetes) -> its resources."""
    return {str(p.relative_to(K8S)): build(p) for p in KUSTOMIZATIONS}


def test_layout():
    names = {str(p.relative_to(K8S)) for p in KUSTOMIZATIONS}
    assert names == {"base", "overlays/cpu", "overlays/gpu", "multihost"}


def _kustomize_binary() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.skipif(_kustomize_binary() is None, reason="no kustomize or kubectl installed")
def test_render_equals_kustomize(rendered):
    for name, docs in rendered.items():
        out = subprocess.run(
            [*_kustomize_binary(), str(K8S / name)], capture_output=True, text=True, check=True
        ).stdout
        theirs = [d for d in yaml.safe_load_all(out) if d is not None]
        assert sorted(theirs, key=_key) == sorted(docs, key=_key), name


def _pod_templates(doc: dict) -> list[tuple[str, dict]]:
    if doc["kind"] == "Deployment":
        return [("pod", doc["spec"]["template"])]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return [("leader", lwt["leaderTemplate"]), ("worker", lwt["workerTemplate"])]
    return []


def _validate(doc: dict) -> None:
    if doc["kind"] != "LeaderWorkerSet":
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    jsonschema.validate(doc, LWS_SCHEMA)
    for _, template in _pod_templates(doc):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
        kubernetes_validate.validate({**wrapped, "template": template}, K8S_VERSION, strict=True)
    crd = os.environ.get("JAXPAGED_LWS_CRD")  # LWS's CRD file, to check against it in full
    if crd:
        (version,) = (
            v
            for v in yaml.safe_load(Path(crd).read_text())["spec"]["versions"]
            if v["name"] == "v1"
        )
        jsonschema.validate(doc, version["schema"]["openAPIV3Schema"])


def test_every_resource_validates(rendered):
    kinds = set()
    for docs in rendered.values():
        for doc in docs:
            _validate(doc)
            kinds.add(doc["kind"])
    assert kinds == {"Deployment", "Service", "HorizontalPodAutoscaler", "LeaderWorkerSet"}


def test_validation_catches_mistakes(rendered):
    """The checks above can fail: a misspelt field in a pod template, a bad LWS field."""
    deployment = next(d for d in rendered["overlays/gpu"] if d["kind"] == "Deployment")
    bad = json.loads(json.dumps(deployment))
    container = bad["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        _validate(bad)
    lws = next(d for d in rendered["multihost"] if d["kind"] == "LeaderWorkerSet")
    for field, value in (("sizee", 2), ("restartPolicy", "Always")):
        bad = json.loads(json.dumps(lws))
        bad["spec"]["leaderWorkerTemplate"][field] = value
        with pytest.raises(jsonschema.ValidationError):
            _validate(bad)
    bad = json.loads(json.dumps(lws))
    bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0][
        "imagePullPolicy"
    ] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of a container's args (an unknown one stays, and fails)."""
    return [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def _servers(rendered) -> list[tuple[str, dict, dict, dict, dict]]:
    """(where, workload, pod template, container, LWS's variables) of every `jaxpaged serve`."""
    out = []
    for name, docs in rendered.items():
        for doc in docs:
            for role, template in _pod_templates(doc):
                lws = {}
                if doc["kind"] == "LeaderWorkerSet":
                    size = doc["spec"]["leaderWorkerTemplate"]["size"]
                    lws = {
                        "LWS_LEADER_ADDRESS": f"{doc['metadata']['name']}-0.{doc['metadata']['name']}",
                        "LWS_GROUP_SIZE": str(size),
                        "LWS_WORKER_INDEX": "0" if role == "leader" else str(size - 1),
                    }
                for c in template["spec"]["containers"]:
                    if c["command"] == ["jaxpaged", "serve"]:
                        out.append((f"{name}:{role}", doc, template, c, lws))
    return out


def test_command_lines_parse_and_agree(rendered):
    servers = _servers(rendered)
    assert len(servers) == 5  # base, cpu, gpu, the LWS leader and worker
    parser = build_parser("jaxpaged serve")
    for where, doc, template, c, lws in servers:
        env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
        args = parser.parse_args(_expand(c["args"], {**env, **lws}))
        engine_args = EngineArgs.from_cli_args(args)
        engine_args.cache_config()  # the checks `jaxpaged serve` runs before starting JAX
        engine_args.parallel_config()
        multihost.check_engine_args(
            num_processes=args.num_processes, preemption_mode=engine_args.preemption_mode
        )
        assert args.host == "0.0.0.0", where
        assert env["HF_HOME"] == c["volumeMounts"][0]["mountPath"], where
        # the image's own cache folder and user (docker/Dockerfile, Dockerfile.cuda)
        dockerfile = "Dockerfile.cuda" if c["image"].endswith(":cuda") else "Dockerfile"
        text = (ROOT / "docker" / dockerfile).read_text()
        assert f"HF_HOME={env['HF_HOME']} " in text, where
        assert "USER 1000:1000" in text and template["spec"]["securityContext"]["runAsUser"] == 1000
        (token,) = (e for e in c["env"] if e["name"] == "HF_TOKEN")
        assert token["valueFrom"]["secretKeyRef"]["name"] == "hf-token", where
        limits = c.get("resources", {}).get("limits", {})
        if "nvidia.com/gpu" in limits:  # -tp covers every GPU of the replica
            hosts = doc["spec"]["leaderWorkerTemplate"]["size"] if lws else 1
            assert args.tensor_parallel_size == hosts * int(limits["nvidia.com/gpu"]), where
        if lws:
            assert args.num_processes == doc["spec"]["leaderWorkerTemplate"]["size"], where
            assert args.process_id == int(lws["LWS_WORKER_INDEX"]), where
            host, port = args.coordinator_address.rsplit(":", 1)
            assert host == lws["LWS_LEADER_ADDRESS"], where
            leader = doc["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
            ports = {p["name"]: p["containerPort"] for p in leader["containers"][0]["ports"]}
            assert int(port) == ports["coordinator"], where
        if args.process_id != 0:
            assert "readinessProbe" not in c, where  # a worker serves no HTTP
            continue
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert (args.port, args.grpc_port) == (ports["http"], ports["grpc"]), where
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, (where, probe)
        # the grace period covers the preStop pause, the server's drain and its exit
        pause = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
        grace = template["spec"]["terminationGracePeriodSeconds"]
        assert grace >= pause + args.shutdown_timeout + 5, where


def test_services_and_autoscaler_point_at_the_servers(rendered):
    for name, docs in rendered.items():
        (service,) = (d for d in docs if d["kind"] == "Service")
        selector = service["spec"]["selector"]
        pods = [
            (t["metadata"]["labels"], t["spec"]["containers"][0])
            for d in docs
            for role, t in _pod_templates(d)
            if role != "worker"
        ]
        for labels, container in pods:
            if name == "multihost":  # LWS labels the leader with worker-index 0
                labels = {**labels, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
            assert selector.items() <= labels.items(), name
            names = {p["name"] for p in container["ports"]}
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= names, name
        for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
            ref = hpa["spec"]["scaleTargetRef"]
            assert any(_key(d) == (ref["kind"], ref["name"]) for d in docs), name
