"""deploy/: the manifests parse and say what the README promises; local-cluster.sh really runs.

Docker and Kubernetes are not available here, so the YAML files are parsed (PyYAML from the
test environment, else from the system ``python3``; skipped if neither has it) and checked for
the things that matter to apsup: roles, probes, the secret DSN, scrape settings, grace periods.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.replicas.cluster import REPO_ROOT, Cluster

DEPLOY = REPO_ROOT / "deploy"
PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"
YAML_FILES = sorted([DEPLOY / "compose.yaml", *(DEPLOY / "k8s").glob("*.yaml")])


@functools.cache
def _load_all(path: Path) -> list[Any]:
    try:
        import yaml
    except ImportError:
        python3 = shutil.which("python3")
        code = (
            "import json, sys, yaml; "
            "print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1]))), default=str))"
        )
        if python3 is None:
            pytest.skip("PyYAML is not available")
        out = subprocess.run(
            [python3, "-c", code, str(path)], capture_output=True, text=True, timeout=30
        )
        if out.returncode != 0:
            if "No module named 'yaml'" in out.stderr:
                pytest.skip("PyYAML is not available")
            raise AssertionError(f"{path.name} does not parse:\n{out.stderr}") from None
        return list(json.loads(out.stdout))
    with open(path) as fh:
        return [d for d in yaml.safe_load_all(fh) if d is not None]


@pytest.mark.parametrize("path", YAML_FILES, ids=[p.name for p in YAML_FILES])
def test_yaml_parses(path: Path) -> None:
    text = path.read_text()
    assert "\t" not in text, "tabs in YAML"
    docs = _load_all(path)
    assert docs and all(isinstance(d, dict) for d in docs)


def _k8s() -> dict[tuple[str, str], Any]:
    docs: dict[tuple[str, str], Any] = {}
    for path in (DEPLOY / "k8s").glob("*.yaml"):
        for doc in _load_all(path):
            if "kind" in doc and "metadata" in doc:
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_k8s_deployments_roles_probes_and_secrets() -> None:
    docs = _k8s()
    kustom = _load_all(DEPLOY / "k8s" / "kustomization.yaml")[0]
    for res in kustom["resources"]:
        assert (DEPLOY / "k8s" / res).exists(), res
    config = docs[("ConfigMap", "apsup-config")]["data"]
    assert config[PREFIX + "ARTIFACT_PROCESSING_SUPERVISOR_MODE"] in ("global", "dedicated")
    assert config[PREFIX + "HTTP_HOST"] == "0.0.0.0"
    assert not any("DATABASE_URL" in k for k in config), "the DSN belongs in the Secret"
    secret = docs[("Secret", "apsup-db")]
    assert PREFIX + "DATABASE_URL" in secret["stringData"]
    grace = float(config[PREFIX + "SHUTDOWN_GRACE_SECONDS"])
    for name, role in (("apsup-background", "background"), ("apsup-api", "api")):
        dep = docs[("Deployment", name)]
        pod = dep["spec"]["template"]
        spec = pod["spec"]
        (container,) = spec["containers"]
        assert _env(container)[PREFIX + "ARTIFACT_PROCESSING_ROLE"] == role
        refs = {next(iter(r.values()))["name"] for r in container["envFrom"]}
        assert refs == {"apsup-config", "apsup-db"}
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9100"
        assert spec["terminationGracePeriodSeconds"] > grace
        if role == "background":  # running Workers may finish first (drain), then the grace
            drain = float(config[PREFIX + "SHUTDOWN_DRAIN_SECONDS"])
            assert spec["terminationGracePeriodSeconds"] >= drain + grace + 15
        assert container["args"][:2] == ["run", "--app"]
    assert docs[("Deployment", "apsup-background")]["spec"]["replicas"] >= 2
    # The default APSUP_APP is a reference family: its tables come with the flag.
    assert "apsup.families." in config["APSUP_APP"]
    assert docs[("Job", "apsup-migrate")]["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "migrate",
        "--with-reference-families",
    ]
    monitor = docs[("ServiceMonitor", "apsup")]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_compose_services() -> None:
    (compose,) = _load_all(DEPLOY / "compose.yaml")
    services = compose["services"]
    assert {"oceanbase", "migrate", "background", "api"} <= set(services)
    # The default app is a reference family: its tables come with the flag.
    assert services["migrate"]["command"] == ["migrate", "--with-reference-families"]
    assert "apsup.families." in services["background"]["command"][-1]
    for name, role in (("background", "background"), ("api", "api")):
        svc = services[name]
        assert svc["environment"][PREFIX + "ARTIFACT_PROCESSING_ROLE"] == role
        assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert svc["init"] is True
    assert "replicas" in services["background"]["deploy"]


def test_dockerfile_and_systemd_unit() -> None:
    docker = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["tini", "--", "apsup"\]', docker, re.M)
    assert "USER 10001" in docker and "HEALTHCHECK" in docker
    for folder in ("apsup", "workers", "families", "migrations"):
        assert f"COPY {folder} " in docker, folder  # every mapped package is in the image
    unit = (DEPLOY / "systemd" / "apsup@.service").read_text()
    sections = re.findall(r"^\[(\w+)\]", unit, re.M)
    assert sections == ["Unit", "Service", "Install"]
    service = unit.split("[Service]", 1)[1].split("[Install]", 1)[0]
    assert "KillMode=mixed" in service and "ExecStart=" in service
    assert "StartLimit" not in service  # those belong to [Unit]
    analyze = shutil.which("systemd-analyze")
    if analyze:
        out = subprocess.run(
            [analyze, "verify", str(DEPLOY / "systemd" / "apsup@.service")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        problems = [
            line
            for line in (out.stdout + out.stderr).splitlines()
            if line.strip() and "is not executable" not in line and "No such file" not in line
        ]
        assert problems == [], problems


@pytest.mark.mysql_only
@pytest.mark.timeout(180)
def test_local_cluster_script_starts_one_leader_and_standbys(db_url: str, tmp_path: Path) -> None:
    script = DEPLOY / "local-cluster.sh"
    assert os.access(script, os.X_OK)
    Cluster.prepare(db_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env["APSUP_PYTHON"] = sys.executable
    env["APSUP_CLUSTER_STATE"] = str(tmp_path / "state")  # never a developer's running cluster
    out = subprocess.run(
        [
            *("bash", str(script), "--url", db_url, "--background", "2", "--api", "1"),
            *("--app", "tests.replicas.cli_app", "--seconds", "1", "--base-port", "0"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=str(REPO_ROOT),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("global=leader") == 1, out.stdout
    assert out.stdout.count("global=standby") == 1, out.stdout
    assert "local-cluster: stopped" in out.stdout


@pytest.mark.mysql_only
@pytest.mark.timeout(240)
def test_local_cluster_runs_its_default_app_ready_and_not_degraded(
    db_url: str, tmp_path: Path
) -> None:
    """As an operator first meets it: the default app (a reference family), no --app, a fresh
    database. The script migrates what that app needs, every replica becomes ready, and after
    30 s none is down and no family is degraded (before: ``reconcile: ProgrammingError``). It
    runs from another directory, and its printed hints run as printed."""
    script = DEPLOY / "local-cluster.sh"
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env["APSUP_PYTHON"] = sys.executable
    env["APSUP_CLUSTER_STATE"] = str(tmp_path / "state")
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [
            *("bash", str(script), "--url", db_url, "--background", "2", "--api", "1"),
            *("--seconds", "30", "--base-port", "0"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 of 3 replicas ready, no family degraded" in out.stdout, out.stdout + out.stderr
    hint = next(line for line in out.stdout.splitlines() if "watch it with:" in line)
    command = hint.split("watch it with: ", 1)[1] + " --json"
    shown = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=60, env=env
    )
    assert shown.returncode == 0, shown.stderr
    assert "topic-memory" in shown.stdout


@pytest.mark.mysql_only
@pytest.mark.timeout(180)
def test_local_cluster_stops_on_sigterm_while_idle_and_guards_its_state(
    db_url: str, tmp_path: Path
) -> None:
    """Idle (no --seconds) it answers SIGTERM at once: every replica stopped, exit 143 (a
    foreground sleep used to hold the trap for up to an hour). A second cluster started on the
    same state folder is refused in one line instead of overwriting the first one's files."""
    script = DEPLOY / "local-cluster.sh"
    Cluster.prepare(db_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env["APSUP_PYTHON"] = sys.executable
    env["APSUP_CLUSTER_STATE"] = str(tmp_path / "state")
    args = ["bash", str(script), "--url", db_url, "--background", "1", "--api", "0"]
    args += ["--app", "tests.replicas.cli_app", "--base-port", "0"]
    first = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=str(REPO_ROOT),
    )  # fmt: skip
    try:
        assert first.stdout is not None
        lines = []
        for line in first.stdout:
            lines.append(line)
            if "to stop" in line:
                break
        assert any("running (mode global)" in line for line in lines), "".join(lines)
        second = subprocess.run(
            args, env=env, capture_output=True, text=True, timeout=60, cwd=str(REPO_ROOT)
        )
        assert second.returncode == 1
        assert "a local cluster already runs from" in second.stderr, second.stderr
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr
        time.sleep(1.0)  # idle in its wait
        t0 = time.monotonic()
        first.send_signal(signal.SIGTERM)
        rest = first.stdout.read()
        code = first.wait(60)
        took = time.monotonic() - t0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert code == 143, rest
    assert "local-cluster: stopped" in rest
    assert took < 30, took  # the replica's drain, not an hour of sleep
