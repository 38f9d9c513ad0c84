#!/usr/bin/env python3
"""Validate every manifest under k8s/ offline.

Built-in kinds go through kubernetes-validate (strict: unknown fields fail) against the
Kubernetes schemas it bundles. Kinds it has no schema for are validated against schemas supplied
in k8s/schemas/ (LeaderWorkerSet, Kustomization); a LeaderWorkerSet's leader and worker pod
templates are also checked strictly as Kubernetes PodTemplates. Anything else fails.
Also checks that every file a kustomization lists exists.
"""
import json
import pathlib
import sys

import jsonschema
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent / "k8s"
K8S_VERSION = "1.33.0"
SUPPLIED = {
    "LeaderWorkerSet": ROOT / "schemas" / "leaderworkerset.schema.json",
    "Kustomization": ROOT / "schemas" / "kustomization.schema.json",
}


def validate_builtin(resource, where):
    kubernetes_validate.validate(resource, K8S_VERSION, strict=True)
    print(f"ok   {where}: {resource['kind']} {resource['metadata'].get('name', '')}")


def validate(resource, path):
    kind = resource.get("kind")
    where = path.relative_to(ROOT.parent)
    if kind in SUPPLIED:
        schema = json.loads(SUPPLIED[kind].read_text())
        jsonschema.validate(resource, schema)
        if kind == "LeaderWorkerSet":
            template = resource["spec"]["leaderWorkerTemplate"]
            for role in ("leaderTemplate", "workerTemplate"):
                if role in template:
                    pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                                    "metadata": {"name": f"{resource['metadata']['name']}-{role.lower()}"},
                                    "template": template[role]}
                    validate_builtin(pod_template, f"{where} ({role})")
        if kind == "Kustomization":
            for listed in resource["resources"]:
                if not (path.parent / listed).exists():
                    raise SystemExit(f"{where}: lists {listed}, which does not exist")
        print(f"ok   {where}: {kind} (schema {SUPPLIED[kind].name})")
        return
    validate_builtin(resource, where)


def main():
    files = sorted(p for p in ROOT.rglob("*.yaml") if "schemas" not in p.parts)
    if not files:
        raise SystemExit("no manifests found")
    failures = 0
    for path in files:
        for resource in yaml.safe_load_all(path.read_text()):
            if resource is None:
                continue
            try:
                validate(resource, path)
            except (kubernetes_validate.ValidationError, jsonschema.ValidationError,
                    kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as err:
                failures += 1
                print(f"FAIL {path.relative_to(ROOT.parent)}: {resource.get('kind')}: {err}", file=sys.stderr)
    if failures:
        raise SystemExit(f"{failures} manifest(s) failed validation")


if __name__ == "__main__":
    main()
