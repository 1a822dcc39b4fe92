"""A pure-Python ``kustomize build`` for the subset deploy/kubernetes uses, so the suite renders
the overlays where no kustomize binary is installed (where one is, the tests check that both
agree): ``resources`` (files, or folders holding a kustomization.yaml), ``labels`` (metadata
labels only: no selectors, no templates), ``images`` (``newName`` / ``newTag`` of the
containers of a pod template) and ``patches`` given as a file of JSON 6902 operations with a
``target`` (kind and name). Anything else is refused naming it, so the subset cannot drift
silently."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

_KNOWN = {"apiVersion", "kind", "resources", "labels", "images", "patches"}


def build(folder: Path) -> list[dict]:
    """The resources ``kustomize build folder`` emits (in resource order)."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - _KNOWN
    if unknown:
        raise ValueError(f"{folder}/kustomization.yaml: unsupported fields {sorted(unknown)}")
    docs: list[dict] = []
    for entry in k.get("resources", []):
        path = (folder / entry).resolve()
        if path.is_dir():
            docs += build(path)
        else:
            # through JSON: YAML aliases (&args / *args) become separate copies, as in kustomize
            loaded = yaml.safe_load_all(path.read_text())
            docs += [json.loads(json.dumps(d)) for d in loaded if d is not None]
    for patch in k.get("patches", []):
        if set(patch) != {"path", "target"}:
            raise ValueError(f"{folder}: only JSON 6902 patches with path and target, got {patch}")
        ops = yaml.safe_load((folder / patch["path"]).read_text())
        targets = [d for d in docs if _matches(d, patch["target"])]
        if not targets:
            raise ValueError(f"{folder}: patch {patch['path']} matches no resource")
        for doc in targets:
            for op in ops:
                _apply(doc, op)
    for image in k.get("images", []):
        for doc in docs:
            for container in _containers(doc):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    new = image.get("newName", name)
                    tag = image.get("newTag", tag)
                    container["image"] = f"{new}:{tag}" if tag else new
    for group in k.get("labels", []):
        if set(group) != {"pairs"}:
            raise ValueError(f"{folder}: labels support only pairs, got {group}")
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(group["pairs"])
    return docs


def _matches(doc: dict, target: dict) -> bool:
    return all(
        (doc["kind"] if key == "kind" else doc["metadata"]["name"]) == value
        for key, value in target.items()
    )


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    templates = [spec.get("template")]
    lwt = spec.get("leaderWorkerTemplate", {})
    templates += [lwt.get("leaderTemplate"), lwt.get("workerTemplate")]
    return [c for t in templates if t for c in t.get("spec", {}).get("containers", [])]


def _apply(doc: dict, op: dict) -> None:
    """One JSON 6902 operation (add, replace, remove) in place."""
    keys = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent: Any = doc
    for key in keys[:-1]:
        parent = parent[int(key)] if isinstance(parent, list) else parent[key]
    last = keys[-1]
    kind = op["op"]
    if kind == "remove":
        del parent[int(last) if isinstance(parent, list) else last]
    elif kind not in ("add", "replace"):
        raise ValueError(f"unsupported JSON patch operation {kind!r}")
    elif isinstance(parent, list):
        value = copy.deepcopy(op["value"])
        if last == "-":
            parent.append(value)
        elif kind == "add":
            parent.insert(int(last), value)
        else:
            parent[int(last)] = value
    else:
        if kind == "replace" and last not in parent:
            raise ValueError(f"replace: {op['path']} does not exist")
        parent[last] = copy.deepcopy(op["value"])
