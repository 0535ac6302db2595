"""deploy/kubernetes/: valid against the Kubernetes schemas, offline (kubernetes-validate
bundles them), and consistent with butter's flags, its probe routes and the router flags
that tests/test_scale_out.py runs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from butter.cli import HARD_EXIT_MARGIN_SECONDS, build_parser, settings_from_args
from butter.server.readiness import LIVE_PATH, READY_PATH
from tests.test_scale_out import ROUTER_FLAGS

MANIFESTS = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
# The oldest release the manifests target (the preStop `sleep` action is on by default
# from 1.30), and the newest whose schemas the validator bundles.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
ROUTER_ONLY_IN_TESTS = {"--worker-startup-timeout-secs", "--worker-startup-check-interval",
                        "--log-level"}


def _resources() -> list[dict[str, Any]]:
    resources = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        resources += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return resources


def _find(kind: str, name: str) -> dict[str, Any]:
    (found,) = [r for r in _resources() if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def _container(deployment: str) -> dict[str, Any]:
    (container,) = _find("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return container


def _flags(args: list[str]) -> dict[str, str]:
    """`--name=value` and `--name value` alike."""
    flags, name = {}, None
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            flags[name] = value
        elif name is not None:
            flags[name] = arg
    return flags


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_kubernetes(version: str) -> None:
    resources = _resources()
    assert {r["kind"] for r in resources} >= {"Deployment", "Service", "PersistentVolumeClaim"}
    for resource in resources:
        kubernetes_validate.validate(resource, version, strict=True)


def test_the_validator_rejects_an_unknown_field() -> None:
    deployment = copy.deepcopy(_find("Deployment", "butter"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def test_butter_probes_its_own_routes_with_flags_it_accepts() -> None:
    container = _container("butter")
    assert container["readinessProbe"]["httpGet"]["path"] == READY_PATH
    assert container["livenessProbe"]["httpGet"]["path"] == LIVE_PATH
    assert container["startupProbe"]["httpGet"]["path"] == LIVE_PATH
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    settings = settings_from_args(args)
    assert settings.threads == int(container["resources"]["requests"]["cpu"])
    pod = _find("Deployment", "butter")["spec"]["template"]["spec"]
    stop_within = (container["lifecycle"]["preStop"]["sleep"]["seconds"]
                   + settings.shutdown_grace + HARD_EXIT_MARGIN_SECONDS)
    assert pod["terminationGracePeriodSeconds"] >= stop_within  # SIGKILL only after butter's own


def test_the_router_runs_with_the_flags_the_loopback_test_runs() -> None:
    container = _container("vllm-router")
    deployed = _flags(container["args"])
    tested = _flags(ROUTER_FLAGS)
    assert {k: v for k, v in tested.items() if k not in ROUTER_ONLY_IN_TESTS} == {
        k: v for k, v in deployed.items() if k in tested}
    assert deployed["--health-check-endpoint"] == READY_PATH
    selector = _find("Deployment", "butter")["spec"]["template"]["metadata"]["labels"]
    assert deployed["--selector"] in {f"{k}={v}" for k, v in selector.items()}
    assert deployed["--service-discovery-port"] == str(_container("butter")["ports"][0][
        "containerPort"])
