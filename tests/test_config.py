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


def _models(t: object, seen: dict[type, object]) -> dict[type, object]:
    import typing

    from pydantic import BaseModel

    for arg in typing.get_args(t):
        _models(arg, seen)
    if isinstance(t, type) and issubclass(t, BaseModel) and t not in seen:
        seen[t] = t.model_config.get("extra")
        for f in t.model_fields.values():
            _models(f.annotation, seen)
    return seen


@pytest.mark.parametrize("root", [GatewaySettings, SimSettings])
def test_every_nested_settings_model_forbids_unknown_keys(root: type) -> None:
    # A model added later without extra="forbid" would silently drop a misspelt key again.
    models = _models(root, {})
    assert len(models) > (10 if root is GatewaySettings else 0)
    assert {m.__name__: extra for m, extra in models.items() if extra != "forbid"} == {}


@pytest.mark.parametrize(("yaml_text", "loc"), [
    ("workers:\n  - {url: 'http://a:1', model: m, kv_event: auto}\n", "workers.0.kv_event"),
    ("discovery: {kind: dns, name: x, worker: {model: m, blocksize: 16}}\n", "discovery.dns.worker.blocksize"),
    ("auth: {mode: 'off', jwt: {issuer: x, audiance: y}}\n", "auth.jwt.audiance"),
    ("admission: {enabled: true, defaults: {max_concurent: 1}}\n", "admission.defaults.max_concurent"),
    ("hostile: {json_limits: {max_dept: 3}}\n", "hostile.json_limits.max_dept"),
])
def test_an_unknown_key_inside_a_section_is_refused_by_its_path(clean_env: pytest.MonkeyPatch, tmp_path: Path,
                                                                yaml_text: str, loc: str) -> None:
    f = tmp_path / "kvgate.yaml"
    f.write_text(yaml_text)
    clean_env.setenv("KVGATE_CONFIG", str(f))
    with pytest.raises(ValidationError) as ei:
        GatewaySettings()
    # The value is not echoed: a misspelt `cache_salt_secrte:` would print the secret.
    assert f"  {loc}: Extra inputs are not permitted" in format_validation_error(ei.value).splitlines()
