"""deploy/kubernetes: the manifests fit together and their configs are valid as rendered in a pod.

No cluster is needed. Every manifest is parsed; the structure that matters is checked (the
native sidecar, probes on the endpoints with the right semantics, ports equal to the configs'
listen addresses, resources covering the stated memory bound, the Secret mounted where the
config reads it, the router's event sources naming the pods and the Service the StatefulSet
produces, security contexts). Then each listener pod is simulated: its volumes are materialised
under tmp_path from the manifests' own ConfigMap and Secret, the sidecar's own shell command
renders the config (the listener it execs is a stub that records its arguments), and the real
CLI's `config validate` checks the result. `kubectl kustomize` (offline) builds the
kustomization when kubectl is installed.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kv_listener import __version__
from tests.conftest import ROOT

K8S = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
SECRET_EXAMPLE = "listener-secret.example.yaml"
NAMESPACE = "inference"
IMAGE = f"ghcr.io/example/continuum-kv-listener:{__version__}"
PLACEHOLDER = "__POD_NAME__"
MIB = 1 << 20

# docs/reliability.md, "Memory bound", per source: block records x 150 B (multi-block chains) up
# to x 550 B (every block its own prefix) + max_retained_tokens x 4 B + 44 MiB (queued batches
# and resolver requests) + 10 x max_message_bytes (a frame being received, its decoded form) +
# 64 MiB + 14 x max_message_bytes (frames received and not handled yet).
# test_memory_bound_constants_match_the_doc ties these to the doc's text.
BYTES_PER_BLOCK_WORST = 550
BYTES_PER_TOKEN = 4
QUEUES_BYTES = 44 * MIB
MESSAGE_FACTOR = 10
RECEIVED_BYTES = 64 * MIB
RECEIVED_MESSAGE_FACTOR = 14
#: Idle RSS of the listener with one source: 55 MiB measured, 85 MiB once transformers is
#: imported to learn a chat template from /tokenizer_info (Python 3.11, this machine).
IDLE_RSS_BYTES = 96 * MIB


Obj = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Loading


@functools.cache
def manifests() -> dict[tuple[str, str], tuple[str, Obj]]:
    """(kind, name) -> (file name, object) for every document of every manifest."""
    out: dict[tuple[str, str], tuple[str, Obj]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} defined twice ({out[key][0]}, {path.name})"
            out[key] = (path.name, doc)
    return out


def obj(kind: str, name: str) -> Obj:
    return manifests()[(kind, name)][1]


def of_kind(kind: str) -> list[Obj]:
    return [o for (k, _), (_, o) in manifests().items() if k == kind]


def statefulset() -> Obj:
    (sts,) = of_kind("StatefulSet")
    return sts


def router_deployment() -> Obj:
    return obj("Deployment", "kv-router")


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def find(items: list[Obj], key: str, value: str, what: str) -> Obj:
    """The item of `items` whose `key` is `value`; `what` names the missing one."""
    for item in items:
        if item[key] == value:
            return item
    raise AssertionError(what)


def container(spec: Obj, name: str) -> Obj:
    return find([*spec.get("initContainers", []), *spec.get("containers", [])], "name", name,
                f"no container {name!r}")

def listener() -> Obj:
    return container(pod_spec(statefulset()), "kv-listener")


def vllm() -> Obj:
    return container(pod_spec(statefulset()), "vllm")


def router() -> Obj:
    return container(pod_spec(router_deployment()), "kv-router")


def listener_templates() -> dict[str, str]:
    """The listener config variants: the ConfigMap the sidecar's template volume holds."""
    volume = volumes(pod_spec(statefulset()))[mount(listener(), "/etc/continuum-kv-listener/template")]
    data: dict[str, str] = obj("ConfigMap", volume["configMap"]["name"])["data"]
    return data


def router_config_text() -> str:
    (cmd_config,) = [a for a in router()["command"] if a.endswith(".yaml")]
    directory, _, filename = cmd_config.rpartition("/")
    volume = volumes(pod_spec(router_deployment()))[mount(router(), directory)]
    text: str = obj("ConfigMap", volume["configMap"]["name"])["data"][filename]
    return text


def volumes(spec: Obj) -> dict[str, Obj]:
    return {v["name"]: v for v in spec.get("volumes", [])}


def mount(c: Obj, path: str) -> str:
    """The name of the volume `c` mounts at `path`."""
    name: str = find(c.get("volumeMounts", []), "mountPath", path,
                     f"{c['name']} mounts nothing at {path}")["name"]
    return name


def port(c: Obj, name: str) -> int:
    number: int = find(c.get("ports", []), "name", name,
                       f"{c['name']} has no port {name!r}")["containerPort"]
    return number

def listen_port(text: str) -> int:
    return int(text.rpartition(":")[2])


def replicas() -> list[str]:
    sts = statefulset()
    return [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]


def cli() -> Path:
    """The project's console script next to the interpreter running the tests (.venv/bin)."""
    exe = Path(sys.executable).parent / "continuum-kv-listener"
    if not exe.exists():
        exe = ROOT / ".venv" / "bin" / "continuum-kv-listener"
    assert exe.exists(), "run the tests with the project's venv (.venv/bin/python -m pytest)"
    return exe


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cli()), "config", "validate", str(path)], capture_output=True,
                          text=True, check=False, timeout=60)


# ---------------------------------------------------------------------------------------------
# A pod's filesystem under tmp_path


class PodFS:
    """What one container of the pod sees, under `tmp`: every volumeMount materialised at
    root + mountPath from the manifests' own objects (ConfigMap data, the Secret example's keys,
    empty emptyDirs). `remap` rewrites a text's absolute paths under those mounts to there."""

    def __init__(self, tmp: Path, spec: Obj, c: Obj) -> None:
        self.root = tmp / "root"
        vols = volumes(spec)
        self.mounts: list[str] = []
        for m in c.get("volumeMounts", []):
            assert "subPath" not in m, "subPath mounts are not updated on ConfigMap changes"
            vol = vols[m["name"]]
            target = self.root / m["mountPath"].lstrip("/")
            target.mkdir(parents=True)
            if "configMap" in vol:
                assert "items" not in vol["configMap"]
                files = obj("ConfigMap", vol["configMap"]["name"])["data"]
            elif "secret" in vol:
                assert "items" not in vol["secret"]
                files = secret_files(vol["secret"]["secretName"])
            else:
                assert set(vol) == {"name", "emptyDir"}, vol
                files = {}
            for key, content in files.items():
                (target / key).write_text(content)
            self.mounts.append(m["mountPath"])
        longest_first = sorted(self.mounts, key=len, reverse=True)
        self._re = re.compile(r"(?<![\w./-])(" + "|".join(map(re.escape, longest_first))
                              + r")(?=/|[\"'\s]|$)")

    def remap(self, text: str) -> str:
        return self._re.sub(lambda m: str(self.root) + m.group(1), text)

    def mount_of(self, path: str) -> str | None:
        """The mountPath `path` lies in, if any."""
        for mp in sorted(self.mounts, key=len, reverse=True):
            if path.startswith(mp + "/"):
                return mp
        return None


def secret_files(name: str) -> dict[str, str]:
    secret = obj("Secret", name)
    files = dict(secret.get("stringData", {}))
    for key, value in secret.get("data", {}).items():
        files[key] = base64.b64decode(value).decode()
    return files


def render(tmp: Path, pod: str, variant: str | None = None) -> tuple[PodFS, Path, str]:
    """Run the sidecar's own command for pod `pod` (its exec'd listener is a stub recording its
    argv). Returns the pod filesystem, the rendered config's path in it and its pod path."""
    c = listener()
    assert c["command"] == ["/bin/sh", "-ec"]
    (script,) = c["args"]
    fs = PodFS(tmp, pod_spec(statefulset()), c)
    stub_dir = tmp / "stub-bin"
    stub_dir.mkdir()
    argv_file = tmp / "argv"
    stub = stub_dir / "continuum-kv-listener"
    stub.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > '{argv_file}'\n")
    stub.chmod(0o755)
    env = {"PATH": f"{stub_dir}:/usr/bin:/bin", "LC_ALL": "C"}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, e
            env[e["name"]] = pod
    if variant is not None:
        env["KV_LISTENER_CONFIG"] = variant
    proc = subprocess.run(["/bin/sh", "-ec", fs.remap(script)], env=env, capture_output=True,
                          text=True, check=False, timeout=30)
    assert proc.returncode == 0, proc.stderr
    argv = argv_file.read_text().splitlines()
    assert argv[0] == "--config" and len(argv) == 2, argv
    rendered = Path(argv[1])
    pod_path = "/" + str(rendered.relative_to(fs.root))
    return fs, rendered, pod_path


# ---------------------------------------------------------------------------------------------
# The files


def test_every_manifest_parses_and_the_kustomization_lists_them() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {f for f, _ in manifests().values()}
    assert set(kustomization["resources"]) == files - {SECRET_EXAMPLE}
    assert kustomization["namespace"] == NAMESPACE
    for (kind, name), (_, o) in manifests().items():
        assert o["apiVersion"] and name
        if kind != "Namespace":
            assert o["metadata"].get("namespace") == NAMESPACE, (kind, name)
    assert (K8S / "README.md").is_file()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is optional here")
def test_kustomize_builds_offline(tmp_path: Path) -> None:
    """`kubectl kustomize` needs no cluster; an empty kubeconfig makes sure none is asked."""
    proc = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                          check=False, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "none"),
                               "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(proc.stdout) if d}
    expected = {k for k, (f, _) in manifests().items() if f != SECRET_EXAMPLE}
    assert built == expected


def test_images_are_the_project_version() -> None:
    for workload in (statefulset(), router_deployment()):
        spec = pod_spec(workload)
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            if c["name"] != "vllm":
                assert c["image"] == IMAGE, c["name"]
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    # the wheel is built where a C compiler is (the compiled hot path), the image installs it
    assert re.search(r"^FROM python:3\.11-slim AS build$", text, re.M)
    assert re.search(r"apt-get install .*\bgcc\b", text)
    assert re.search(r"^RUN pip wheel .*--wheel-dir /wheels \.$", text, re.M)
    assert re.search(r"^RUN pip install /wheels/\*\.whl", text, re.M)
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    assert user is not None
    assert int(user.group(1)) == listener()["securityContext"]["runAsUser"]
    assert int(user.group(2)) == pod_spec(statefulset())["securityContext"]["fsGroup"]


def test_memory_bound_constants_match_the_doc() -> None:
    doc = (ROOT / "docs" / "reliability.md").read_text()
    section = doc.split("## Memory bound", 1)[1].split("\n## ", 1)[0]
    flat = " ".join(section.split())
    assert f"x {BYTES_PER_BLOCK_WORST} bytes" in flat
    assert f"`max_retained_tokens` x {BYTES_PER_TOKEN} bytes" in flat
    assert f"+ {QUEUES_BYTES // MIB} MiB" in flat
    assert f"+ {MESSAGE_FACTOR} x `max_message_bytes`" in flat
    assert (f"+ {RECEIVED_BYTES // MIB} MiB + {RECEIVED_MESSAGE_FACTOR} x `max_message_bytes` "
            "for frames received and not handled yet") in flat


# ---------------------------------------------------------------------------------------------
# The vLLM pod and its sidecar


def test_listener_is_a_native_sidecar_started_before_vllm() -> None:
    spec = pod_spec(statefulset())
    init = spec["initContainers"]
    assert [c["name"] for c in init] == ["kv-listener"]
    assert init[0]["restartPolicy"] == "Always"
    assert "startupProbe" in init[0]  # the kubelet starts vLLM once it passes
    assert [c["name"] for c in spec["containers"]] == ["vllm"]


def http_probe(c: Obj, kind: str) -> tuple[str, str]:
    probe = c[kind]["httpGet"]
    return probe["path"], probe["port"]


def test_probes_have_the_right_endpoints_and_semantics() -> None:
    templates = listener_templates()
    for text in templates.values():
        assert listen_port(yaml.safe_load(text)["listen"]) == port(listener(), "kv-events")
    # The sidecar: /healthz only. Every container's readiness gates the pod's: an engine-stream
    # readiness (/readyz, /readyz/{backend}) would take a serving GPU pod out of its Service.
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert http_probe(listener(), kind) == ("/healthz", "kv-events"), kind
    for workload in (statefulset(), router_deployment()):
        spec = pod_spec(workload)
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                if kind in c:
                    assert not http_probe(c, kind)[0].startswith("/readyz"), (c["name"], kind)
    # vLLM: its own /health, with a startup window for a model download and load.
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert http_probe(vllm(), kind) == ("/health", "http"), kind
    startup = vllm()["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    # The router: its admin port, which admin.listen names.
    admin = yaml.safe_load(router_config_text())["admin"]["listen"]
    assert listen_port(admin) == port(router(), "admin")
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        # /healthz: the one admin-port path admin.auth never guards (a probe has no token)
        assert http_probe(router(), kind) == ("/healthz", "admin"), kind


def kv_events_config() -> Obj:
    args = vllm()["args"]
    i = args.index("--kv-events-config")
    cfg: Obj = json.loads(args[i + 1])
    return cfg


def vllm_flag(name: str) -> str | None:
    args: list[str] = vllm()["args"]
    for a in args:
        if a == name:
            return ""
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def test_vllm_publishes_its_kv_events_to_the_sidecar() -> None:
    events = kv_events_config()
    assert events["enable_kv_cache_events"] is True
    assert events["publisher"] == "zmq"
    assert vllm_flag("--enable-prefix-caching") == ""
    assert vllm_flag("--enable-tokenizer-info-endpoint") == ""
    model = vllm()["args"][0]
    assert vllm_flag("--served-model-name") == model
    for text in listener_templates().values():
        (src,) = yaml.safe_load(text)["sources"]
        assert src["engine"] == "vllm" and src["model"] == model
        # vLLM connects for tcp://host:port (binds with * or ::), so the listener binds.
        assert events["endpoint"] == src["zmq_endpoint"] and "*" not in events["endpoint"]
        assert src["zmq_mode"] == "bind"
        assert events["replay_endpoint"] == src["replay_endpoint"]
        assert events.get("topic", "").startswith(src.get("zmq_topic", ""))
        assert urlsplit(src["detokenize_endpoint"]).port == int(vllm_flag("--port") or 0)
        assert port(vllm(), "http") == int(vllm_flag("--port") or 0)
        # Everything between the engine and the sidecar stays inside the pod.
        for endpoint in (src["zmq_endpoint"], src["replay_endpoint"], src["detokenize_endpoint"]):
            assert "127.0.0.1" in endpoint, endpoint
        assert src["allowed_publishers"] == ["127.0.0.1"]


def memory_bound(limits: Obj) -> int:
    return int(limits["max_tracked_blocks"] * BYTES_PER_BLOCK_WORST
               + limits["max_retained_tokens"] * BYTES_PER_TOKEN
               + QUEUES_BYTES + MESSAGE_FACTOR * limits["max_message_bytes"]
               + RECEIVED_BYTES + RECEIVED_MESSAGE_FACTOR * limits["max_message_bytes"])


def quantity_bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", q)
    assert m, q
    return int(m.group(1)) << {"Ki": 10, "Mi": 20, "Gi": 30}[m.group(2)]


def test_sidecar_resources_cover_the_memory_bound() -> None:
    res = listener()["resources"]
    assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"])
    limit = quantity_bytes(res["limits"]["memory"])
    assert quantity_bytes(res["requests"]["memory"]) == limit  # no overcommit on a GPU node
    for text in listener_templates().values():
        cfg = yaml.safe_load(text)
        assert all(s.get("limits") is None for s in cfg["sources"])
        bound = memory_bound(cfg["limits"])
        assert bound + IDLE_RSS_BYTES <= limit, (bound / MIB, limit / MIB)
        # The arithmetic in the manifest's comment is this one.
        assert f"= {bound / MIB:.1f} MiB" in (K8S / "vllm-statefulset.yaml").read_text()
        # max_retained_tokens never prunes before max_tracked_blocks at vLLM's block size.
        block = int(vllm_flag("--block-size") or 0)
        assert cfg["limits"]["max_tracked_blocks"] * block <= cfg["limits"]["max_retained_tokens"]
    assert {"cpu", "memory"} <= set(router()["resources"]["limits"])


def check_hardened(c: Obj, spec: Obj) -> None:
    sc = {**spec.get("securityContext", {}), **c["securityContext"]}
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, c["name"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False


def test_security_contexts() -> None:
    check_hardened(listener(), pod_spec(statefulset()))
    check_hardened(router(), pod_spec(router_deployment()))
    # Kubernetes would inject VLLM_PORT for a Service named vllm; vLLM refuses that value.
    assert pod_spec(statefulset())["enableServiceLinks"] is False
    assert ("Service", "vllm") not in manifests()


def secret_paths(cfg: Obj) -> list[str]:
    paths = [cfg.get("cache_salt", {}).get("secret_file")]
    bus = cfg.get("event_bus") or {}
    paths += [bus.get(k) for k in ("credential_file", "ca_file", "client_cert_file",
                                   "client_key_file")]
    return [p for p in paths if p is not None]


def test_secret_keys_are_mounted_where_the_config_reads_them() -> None:
    spec = pod_spec(statefulset())
    vols = volumes(spec)
    referenced: set[str] = set()
    for text in listener_templates().values():
        for path in secret_paths(yaml.safe_load(text)):
            directory, _, key = path.rpartition("/")
            vol = vols[mount(listener(), directory)]
            name = vol["secret"]["secretName"]
            assert key in secret_files(name), (path, name)
            referenced.add(key)
    (secret,) = of_kind("Secret")
    assert referenced == set(secret_files(secret["metadata"]["name"]))  # no unused key
    assert manifests()[("Secret", secret["metadata"]["name"])][0] == SECRET_EXAMPLE
    assert all(v == "" for v in secret_files(secret["metadata"]["name"]).values())
    # Only the sidecar mounts it, readable by its group alone.
    (vol,) = [v for v in vols.values() if "secret" in v]
    assert vol["secret"]["defaultMode"] == 0o440
    assert spec["securityContext"]["fsGroup"] == listener()["securityContext"]["runAsGroup"]
    mounted_by = [c["name"] for c in [*spec["initContainers"], *spec["containers"]]
                  if any(m["name"] == vol["name"] for m in c.get("volumeMounts", []))]
    assert mounted_by == ["kv-listener"]


def test_push_variant_only_adds_the_event_bus() -> None:
    templates = {k: yaml.safe_load(v) for k, v in listener_templates().items()}
    assert set(templates) == {"config.yaml", "config-push.yaml"}
    pull, push = templates["config.yaml"], templates["config-push.yaml"]
    assert pull["event_bus"] is None and push["event_bus"]["credential_file"]
    assert {k: v for k, v in push.items() if k != "event_bus"} == {
        k: v for k, v in pull.items() if k != "event_bus"}
    env = {e["name"]: e.get("value") for e in listener()["env"]}
    assert env["KV_LISTENER_CONFIG"] in templates


@pytest.mark.parametrize("variant", ["config.yaml", "config-push.yaml"])
@pytest.mark.parametrize("ordinal", [0, 1])
def test_rendered_config_validates_in_the_pod(tmp_path: Path, ordinal: int, variant: str) -> None:
    pods = replicas()
    assert len(pods) == 2
    pod = pods[ordinal]
    fs, rendered, pod_path = render(tmp_path, pod, variant)
    # The listener runs the rendered file, which lives in a writable emptyDir.
    mount_path = fs.mount_of(pod_path)
    assert mount_path is not None
    assert "emptyDir" in volumes(pod_spec(statefulset()))[mount(listener(), mount_path)]
    text = rendered.read_text()
    assert PLACEHOLDER not in text
    cfg = yaml.safe_load(text)
    assert [s["backend_name"] for s in cfg["sources"]] == [pod]
    # Validate it as the pod would: its secret paths lead to the mounted Secret's files.
    in_pod = tmp_path / f"{pod}-{variant}"
    in_pod.write_text(fs.remap(text))
    proc = validate(in_pod)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert [line for line in proc.stdout.splitlines() if ": warning: " in line] == []
    assert proc.stdout.strip().endswith("valid listener configuration (1 sources)")


# ---------------------------------------------------------------------------------------------
# The router side


def test_headless_service_gives_each_pod_its_dns_name() -> None:
    sts = statefulset()
    svc = obj("Service", sts["spec"]["serviceName"])["spec"]
    assert svc["clusterIP"] == "None"
    # A pod's name resolves while vLLM loads: the router's stream is up before traffic is.
    assert svc["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["selector"].items() <= labels.items()
    ports = {p["name"]: p for p in svc["ports"]}
    listen = listen_port(yaml.safe_load(listener_templates()["config.yaml"])["listen"])
    assert ports["kv-events"]["port"] == listen
    assert ports["kv-events"]["targetPort"] == "kv-events"


def test_router_event_sources_are_the_statefulset_pods() -> None:
    sts = statefulset()
    service = sts["spec"]["serviceName"]
    namespace = sts["metadata"]["namespace"]
    svc_ports = {p["name"]: p["port"] for p in obj("Service", service)["spec"]["ports"]}
    sources = yaml.safe_load(router_config_text())["kv_cache_index"]["event_sources"]
    got = {s["backend_name"]: (s["endpoint"], s.get("transport", "sse")) for s in sources}
    expected = {
        pod: (f"http://{pod}.{service}.{namespace}.svc.cluster.local:{svc_ports['kv-events']}"
              f"/events/{pod}", "sse")
        for pod in replicas()
    }
    assert got == expected


def test_router_config_validates(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(router_config_text())
    proc = validate(path)
    assert proc.returncode == 0, proc.stderr
    warnings = [line.split(": warning: ", 1)[1] for line in proc.stdout.splitlines()
                if ": warning: " in line]
    # admin.listen is the pod IP (the kubelet's probes, Prometheus), behind admin.auth: clean.
    assert warnings == []
    assert "valid router configuration (2 event sources)" in proc.stdout


def policy_ports(name: str) -> list[tuple[Obj, list[Obj]]]:
    spec = obj("NetworkPolicy", name)["spec"]
    return [(rule, rule["ports"]) for rule in spec["ingress"]]


def test_network_policies_admit_only_the_router_to_the_streams() -> None:
    spec = obj("NetworkPolicy", "vllm-ingress")["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= (
        statefulset()["spec"]["template"]["metadata"]["labels"].items())
    router_labels = router_deployment()["spec"]["template"]["metadata"]["labels"]
    (kv_rule,) = [r for r, ports in policy_ports("vllm-ingress")
                  if any(p["port"] == "kv-events" for p in ports)]
    pod_selectors = [f["podSelector"]["matchLabels"] for f in kv_rule["from"] if "podSelector" in f]
    assert any(sel.items() <= router_labels.items() for sel in pod_selectors)
    admin_rules = [r for r, ports in policy_ports("kv-router-ingress")
                   if any(p["port"] == "admin" for p in ports)]
    assert admin_rules and all(r.get("from") for r in admin_rules)
