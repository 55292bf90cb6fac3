from pathlib import Path

import pytest
from pydantic import ValidationError

from kvgate.config import GatewaySettings, format_validation_error
from kvgate.sim.settings import SimSettings


def test_env_vars_configure_workers(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("KVGATE_WORKERS", '[{"url": "http://127.0.0.1:8001/", "model": "m", "engine": "sim"}]')
    clean_env.setenv("KVGATE_POLICY", "least_loaded")
    s = GatewaySettings()
    assert s.policy == "least_loaded"
    assert s.workers[0].url == "http://127.0.0.1:8001" and s.workers[0].id == "127.0.0.1:8001"


def test_yaml_file_with_env_override(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "kvgate.yaml"
    f.write_text("port: 9000\npolicy: round_robin\nworkers:\n  - {url: 'http://a:1', model: m}\n")
    clean_env.setenv("KVGATE_CONFIG", str(f))
    clean_env.setenv("KVGATE_PORT", "9100")
    s = GatewaySettings()
    assert (s.port, s.policy, len(s.workers)) == (9100, "round_robin", 1)


def test_bad_values_name_the_field(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError) as ei:
        GatewaySettings(policy="random", affinity_epsilon=-1, workers=[{"url": "ftp://x", "model": "m"}])
    msg = format_validation_error(ei.value)
    assert "policy:" in msg and "affinity_epsilon:" in msg and "workers.0.url:" in msg


def test_unknown_yaml_key_is_rejected(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "kvgate.yaml"
    f.write_text("polcy: round_robin\n")
    clean_env.setenv("KVGATE_CONFIG", str(f))
    with pytest.raises(ValidationError, match="polcy"):
        GatewaySettings()


def test_missing_config_file_is_reported(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("KVGATE_CONFIG", "/nonexistent/kvgate.yaml")
    with pytest.raises(FileNotFoundError, match="KVGATE_CONFIG"):
        GatewaySettings()


def test_duplicate_worker_ids_rejected(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="duplicate worker ids"):
        GatewaySettings(workers=[{"url": "http://a:1", "model": "m"}, {"url": "http://a:1/", "model": "n"}])


def test_sim_profile_validated(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("KVGATE_SIM_PROFILE", "b200")
    with pytest.raises(ValidationError, match="unknown profile"):
        SimSettings()
