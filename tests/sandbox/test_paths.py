"""The sandbox's settings from the environment, read in k3/sandbox/paths.py alone."""

import pytest

from k3.sandbox import paths


def test_spare_supervisors_default_count_and_a_bad_value(monkeypatch):
    monkeypatch.delenv("K3_SANDBOX_SPARES", raising=False)
    assert paths.spare_supervisors() == 2
    monkeypatch.setenv("K3_SANDBOX_SPARES", "0")
    assert paths.spare_supervisors() == 0
    monkeypatch.setenv("K3_SANDBOX_SPARES", "-1")
    with pytest.raises(ValueError, match="K3_SANDBOX_SPARES must be a count"):
        paths.spare_supervisors()


def test_path_environment_forwards_only_the_path_variables_that_are_set(monkeypatch):
    monkeypatch.setenv("K3_SANDBOX_HOME", "/srv/k3")
    monkeypatch.delenv("K3_SANDBOX_SCRATCH", raising=False)
    monkeypatch.setenv("K3_SANDBOX_SPARES", "3")
    assert paths.path_environment() == {"K3_SANDBOX_HOME": "/srv/k3"}
