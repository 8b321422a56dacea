"""The Kubernetes manifests (deploy/k8s): both overlays render with `kubectl kustomize`, every object validates
against the Kubernetes API schemas offline (kubernetes-validate, strict: an unknown field fails), and what the
containers are told is what specwire takes: their arguments parse with the CLI, every SPECWIRE_* variable is a
flag of that command, every file they name is mounted. No cluster runs here: scheduling, probes, the HPA's
custom metric and the policies' effect are not exercised (docs/deployment.md says so)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.config import env_name

ROOT = Path(__file__).resolve().parents[1]
KUBERNETES_VERSION = "1.33.0"
CRDS = {"ServiceMonitor"}  # no schema in kubernetes-validate: checked by hand below


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl (with its built-in kustomize) is needed to render deploy/k8s: apt-get install kubectl")
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", tree, ignore=shutil.ignore_patterns("secrets"))
    # the command docs/deployment.md gives
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_dev_certs.py"), str(tree / "base" / "secrets"),
                    "--host", "specwire-verifier.specwire.svc.cluster.local",
                    "--host", "specwire-draft.specwire.svc.cluster.local"], check=True, capture_output=True)
    out = {"secrets": tree / "base" / "secrets"}
    for overlay in ("nvidia", "amd"):
        text = subprocess.run([kubectl, "kustomize", str(tree / "overlays" / overlay)], check=True,
                              capture_output=True, text=True).stdout
        out[overlay] = [d for d in yaml.safe_load_all(text) if d]
    return out


def _one(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


@pytest.mark.parametrize("overlay", ["nvidia", "amd"])
def test_every_object_validates_against_the_kubernetes_schemas(rendered, overlay):
    import kubernetes_validate

    docs = rendered[overlay]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Namespace", "Secret", "Secret", "PersistentVolumeClaim", "Service", "Service", "Service",
                            "StatefulSet", "Deployment", "Deployment", "HorizontalPodAutoscaler",
                            "PodDisruptionBudget", "PodDisruptionBudget", "NetworkPolicy", "NetworkPolicy",
                            "NetworkPolicy", "ServiceMonitor"])
    for doc in docs:
        if doc["kind"] in CRDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert all(d["metadata"].get("namespace") == "specwire" for d in docs if d["kind"] != "Namespace")


def test_the_validation_refuses_a_misspelt_field(rendered):
    """The check above can fail: strict validation refuses an unknown field and a wrong type."""
    import kubernetes_validate

    statefulset = _one(rendered["nvidia"], "StatefulSet", "specwire-verifier")
    bad = yaml.safe_load(yaml.safe_dump(statefulset))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPortt"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(statefulset))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(("overlay", "gpu"), [("nvidia", "nvidia.com/gpu"), ("amd", "amd.com/gpu")])
def test_verifiers_get_a_gpu_and_are_reached_through_a_headless_service(rendered, overlay, gpu):
    docs = rendered[overlay]
    statefulset = _one(docs, "StatefulSet", "specwire-verifier")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"][gpu] == 1
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["SPECWIRE_DEVICE"] == "cuda" and env["SPECWIRE_MODEL"] == "/models/target"
    service = _one(docs, "Service", "specwire-verifier")
    assert service["spec"]["clusterIP"] == "None" and statefulset["spec"]["serviceName"] == "specwire-verifier"
    # the drafts find every verifier through that Service's name
    draft = _one(docs, "Deployment", "specwire-draft")["spec"]["template"]["spec"]["containers"][0]
    verifier = {e["name"]: e["value"] for e in draft["env"]}["SPECWIRE_VERIFIER"]
    assert verifier == "dns:///specwire-verifier.specwire.svc.cluster.local:50051"
    # a drain needs its grace period inside the pod's
    args = container["args"]
    drain = float(args[args.index("--drain-grace") + 1])
    assert drain < statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def test_probes_speak_mutual_tls_and_only_drafts_reach_verifiers(rendered):
    docs = rendered["nvidia"]
    verifier = _one(docs, "StatefulSet", "specwire-verifier")["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = verifier[probe]["exec"]["command"]
        assert command[:3] == ["python", "-m", "specwire.healthcheck"]
        assert {"--ca", "--cert", "--key"} <= set(command)
    assert "specwire.v1.Verifier" in verifier["readinessProbe"]["exec"]["command"]  # NOT_SERVING once draining
    policy = _one(docs, "NetworkPolicy", "specwire-verifier")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "verifier"
    grpc_rules = [r for r in policy["spec"]["ingress"] if any(p["port"] == 50051 for p in r["ports"])]
    assert [r["from"] for r in grpc_rules] == [[{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "specwire", "app.kubernetes.io/component": "draft"}}}]]
    hpa = _one(docs, "HorizontalPodAutoscaler", "specwire-draft")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "specwire_draft_active_generations"
    monitor = _one(docs, "ServiceMonitor", "specwire")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "interval": "15s"}]
    metrics_services = [d for d in docs if d["kind"] == "Service"
                        and any(p["name"] == "metrics" for p in d["spec"]["ports"])]
    assert {s["metadata"]["name"] for s in metrics_services} == {"specwire-verifier", "specwire-draft"}


def test_every_name_a_tls_client_checks_is_in_the_documented_certificate(rendered):
    """The server certificate made as the docs say names every host a client checks it against: the probes'
    --server-name, and the DNS names the drafts and the gateway dial."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((rendered["secrets"] / "server.pem").read_bytes())
    names = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName))
    checked = set()
    for workload in (d for d in rendered["nvidia"] if d["kind"] in ("StatefulSet", "Deployment")):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        words = [*container["args"], *env.values(),
                 *(x for p in ("startupProbe", "readinessProbe", "livenessProbe")
                   for x in container.get(p, {}).get("exec", {}).get("command", []))]
        for i, word in enumerate(words):
            if word == "--server-name":
                checked.add(words[i + 1])
            elif word.startswith("dns:///"):
                checked.add(word[len("dns:///"):].rsplit(":", 1)[0])
    assert checked == {"specwire-verifier.specwire.svc.cluster.local", "specwire-draft.specwire.svc.cluster.local"}
    assert checked <= names


def _subcommand(command: str) -> argparse.ArgumentParser:
    from specwire.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


def test_what_the_containers_are_told_is_what_specwire_takes(rendered, monkeypatch):
    """Every container's arguments parse with the CLI (an unknown or misspelt flag fails), each SPECWIRE_*
    variable names a flag of its command, and every /certs, /tokens or /models path it names is mounted from the
    Secret (a key of it) or the models volume."""
    docs = rendered["nvidia"]
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    workloads = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    assert len(workloads) == 3
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        assert pod["enableServiceLinks"] is False  # else Services named specwire-* set SPECWIRE_* variables
        (container,) = pod["containers"]
        args = container["args"]
        parser = _subcommand(args[0])
        flags = {env_name(o) for a in parser._actions for o in a.option_strings if o.startswith("--")}
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert set(env) <= flags, f"{workload['metadata']['name']}: no such flag for {set(env) - flags}"
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        _subcommand(args[0]).parse_args(args[1:])  # exits (SystemExit) on an unknown flag or a bad value
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        probes = [container[p]["exec"]["command"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
                  if "exec" in container.get(p, {})]
        paths = [v for v in [*env.values(), *args, *(x for c in probes for x in c)] if v.startswith("/")]
        for path in paths:
            mount, _, key = path[1:].partition("/")
            volume = mounts[f"/{mount}"]
            if "secret" in volume:
                assert key in secrets[volume["secret"]["secretName"]]["data"], path
            else:
                assert volume["persistentVolumeClaim"]["claimName"] == "specwire-models"
        for name in env:
            monkeypatch.delenv(name)
