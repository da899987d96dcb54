"""`backend="sky"` checks SkyPilot's enabled clouds before a launch, and leaves no key file when none can happen."""

from __future__ import annotations

import pytest
from test_sky import FakeSky, sky, tl_home  # noqa: F401  (fixtures: SkyPilot offline, a per-test key home)

from tinkerless.cloud.sky_backend import key_file, make_sky_backend
from tinkerless.errors import ConfigError, RemoteError


def _key_files(tl_home) -> list:
    return sorted(tl_home.rglob("*.key")) if tl_home.exists() else []


def test_no_enabled_cloud_is_refused_before_any_launch_and_writes_no_key(sky, tl_home, monkeypatch):
    fake = FakeSky(sky, monkeypatch, endpoint="127.0.0.1:1")
    fake.enabled = []
    with pytest.raises(ConfigError, match="SkyPilot has no enabled cloud") as error:
        make_sky_backend("smollm2", cluster="tl-none")
    assert "sky check" in error.value.hint
    assert fake.names() == ["status", "enabled_clouds"], "nothing is launched"
    assert _key_files(tl_home) == [] and not key_file("tl-none").exists()


def test_infra_must_be_an_enabled_cloud(sky, tl_home, monkeypatch):
    fake = FakeSky(sky, monkeypatch, endpoint="127.0.0.1:1")
    fake.enabled = ["aws", "kubernetes"]
    with pytest.raises(ConfigError, match="gcp is not among SkyPilot's enabled clouds \\(aws, kubernetes\\)") as error:
        make_sky_backend("smollm2", cluster="tl-gcp", infra="gcp/us-central1")
    assert "sky check gcp" in error.value.hint
    assert "launch" not in fake.names() and _key_files(tl_home) == []


def test_an_enabled_infra_alias_passes_the_check(sky, tl_home, monkeypatch):
    fake = FakeSky(sky, monkeypatch, endpoint="127.0.0.1:1")
    fake.enabled = ["kubernetes"]
    fake.launch_error = RuntimeError("stop after the check")  # the launch itself is not what this test is about
    with pytest.raises(RemoteError, match="stop after the check"):
        make_sky_backend("smollm2", cluster="tl-k8s", infra="k8s/my-context")
    assert fake.names()[:3] == ["status", "enabled_clouds", "launch"]


def test_a_launch_that_provisions_nothing_leaves_no_key(sky, tl_home, monkeypatch):
    fake = FakeSky(sky, monkeypatch, endpoint="127.0.0.1:1")
    fake.launch_error = sky.exceptions.ResourcesUnavailableError("no L4 anywhere")
    with pytest.raises(RemoteError, match="sky launch of cluster tl-nothing failed"):
        make_sky_backend("smollm2", cluster="tl-nothing")
    assert not key_file("tl-nothing").exists(), "no cluster exists, so no key is kept for one"


def test_a_failed_launch_that_left_a_cluster_keeps_its_key(sky, tl_home, monkeypatch):
    fake = FakeSky(sky, monkeypatch, endpoint="127.0.0.1:1")
    launch = fake.launch

    def launch_then_fail(task, cluster_name=None, **kwargs):  # provisioned, then its setup failed
        launch(task, cluster_name=cluster_name, **kwargs)
        return fake._request("launch", error=RuntimeError("setup failed"))

    monkeypatch.setattr(sky, "launch", launch_then_fail)
    with pytest.raises(RemoteError, match="setup failed"):
        make_sky_backend("smollm2", cluster="tl-half")
    assert key_file("tl-half").exists(), "the cluster exists: its key is what lets a later run reuse or inspect it"


def test_an_unreachable_skypilot_api_server_is_a_clear_error(sky, tl_home, monkeypatch):
    fake = FakeSky(sky, monkeypatch, endpoint="127.0.0.1:1")

    def unreachable(workspace=None, expand=False):
        return fake._request("enabled_clouds", error=sky.exceptions.ApiServerConnectionError("http://127.0.0.1:46580"))

    monkeypatch.setattr(sky, "enabled_clouds", unreachable, raising=False)
    with pytest.raises(RemoteError, match="the SkyPilot API server is unreachable"):
        make_sky_backend("smollm2", cluster="tl-noapi")
    assert _key_files(tl_home) == []
