"""YAML -> nested typed config dataclasses, with errors naming the field."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sparse_rl_megatron.utils.config_io import ConfigError, from_dict, load_config, to_dict


@dataclass
class Inner:
    budget: int = 512
    """KV budget."""
    method: str = "rkv"
    ratio: float = 0.5
    tags: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")


@dataclass
class Outer:
    name: str = "run"
    inner: Inner = field(default_factory=Inner)
    seed: int | None = None
    extra: dict = field(default_factory=dict)


def test_nested_build_and_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\ninner:\n  budget: 64\n  ratio: 1\n  tags: [a, b]\nextra: {k: 1}\n")
    cfg = load_config(Outer, path, overrides=["inner.method=snapkv", "seed=3"])
    assert cfg == Outer(name="x", inner=Inner(budget=64, method="snapkv", ratio=1.0, tags=["a", "b"]), seed=3,
                        extra={"k": 1})
    assert isinstance(cfg.inner.ratio, float)
    assert from_dict(Outer, to_dict(cfg)) == cfg


@pytest.mark.parametrize("data,msg", [
    ({"inner": {"budgett": 3}}, r"inner: unknown key\(s\) budgett; valid keys: budget, method, ratio, tags"),
    ({"nme": 1}, r"Outer: unknown key\(s\) nme; valid keys: extra, inner, name, seed"),
    ({"inner": {"budget": "many"}}, r"inner.budget: expected int, got 'many'"),
    ({"inner": {"budget": True}}, r"inner.budget: expected int, got True"),
    ({"inner": {"budget": 0}}, r"inner: budget must be >= 1, got 0"),
    ({"inner": 5}, r"inner: expected a mapping for Inner"),
    ({"seed": "x"}, r"seed: 'x' does not fit"),
])
def test_errors_name_the_field(data, msg):
    with pytest.raises(ConfigError, match=msg):
        from_dict(Outer, data)


def test_top_level_validation_error_is_a_config_error():
    # a CLI catches ConfigError only: a plain ValueError here would reach the user as a traceback
    with pytest.raises(ConfigError, match=r"^budget must be >= 1, got 0$"):
        from_dict(Inner, {"budget": 0})


def test_bad_override_and_top_level(tmp_path):
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        load_config(Outer, None, ["seed"])
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level of a config must be a mapping"):
        load_config(Outer, path)


def test_include_deep_merges_relative_to_the_including_file(tmp_path):
    from sparse_rl_megatron.utils.config_io import load_recipe

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "a.yaml").write_text("name: a\ninner:\n  budget: 64\n  method: snapkv\n  tags: [x]\n")
    (tmp_path / "base" / "b.yaml").write_text("include: a.yaml\ninner:\n  budget: 128\n")  # relative to base/
    (tmp_path / "run.yaml").write_text("include: [base/b.yaml]\ninner:\n  tags: [y]\nseed: 1\n")
    assert load_recipe(tmp_path / "run.yaml") == {
        "name": "a", "inner": {"budget": 128, "method": "snapkv", "tags": ["y"]}, "seed": 1}
    cfg = load_config(Outer, tmp_path / "run.yaml", ["inner.budget=32"])
    assert cfg == Outer(name="a", inner=Inner(budget=32, method="snapkv", tags=["y"]), seed=1)


def test_include_errors_name_the_file(tmp_path):
    (tmp_path / "a.yaml").write_text("include: b.yaml\n")
    (tmp_path / "b.yaml").write_text("include: a.yaml\n")
    with pytest.raises(ConfigError, match=r"include cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(Outer, tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("include: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: included file .*missing\.yaml does not exist"):
        load_config(Outer, tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("include: {x: 1}\n")
    with pytest.raises(ConfigError, match=r"d\.yaml: 'include' must be a file name or a list"):
        load_config(Outer, tmp_path / "d.yaml")
    (tmp_path / "e.yaml").write_text("include: f.yaml\n")
    (tmp_path / "f.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"f\.yaml: malformed YAML"):
        load_config(Outer, tmp_path / "e.yaml")


def test_exponent_without_a_dot_is_a_float(tmp_path):
    # YAML 1.1 (PyYAML) reads 1e-4 as the string '1e-4'; a float field takes it, from a file and an override
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  ratio: 1e-4\n")
    assert load_config(Outer, path).inner.ratio == 1e-4
    assert load_config(Outer, None, ["inner.ratio=3e-5"]).inner.ratio == 3e-5
    with pytest.raises(ConfigError, match=r"inner.ratio: expected float, got 'fast'"):
        load_config(Outer, None, ["inner.ratio=fast"])


def test_an_override_of_a_string_field_stays_the_text_as_written():
    # YAML reads these as a mapping, an int, a bool; a str field keeps the text (other fields the YAML value)
    cfg = load_config(Outer, None, ["name=rollout: 1 sglang engine", "inner.method=007", "extra={k: 1}", "seed=3"])
    assert cfg.name == "rollout: 1 sglang engine" and cfg.inner.method == "007"
    assert cfg.extra == {"k": 1} and cfg.seed == 3
    assert load_config(Outer, None, ["name=true"]).name == "true"
    assert load_config(Outer, None, ["name='quoted'"]).name == "quoted"  # YAML quoting still works
    with pytest.raises(ConfigError, match=r"^inner.budget: expected int, got {'x': 1}$"):
        load_config(Outer, None, ["inner.budget=x: 1"])  # a non-string field is not rescued by the text
    # a whole section, then a key inside it
    assert load_config(Outer, None, ["inner={budget: 8}", "inner.ratio=2"]).inner == Inner(budget=8, ratio=2.0)
    # a key inside a free-form mapping takes the YAML value (an int, not the override's text), and the config dumps
    cfg = load_config(Outer, None, ["extra.steps=20", "extra.name=x"])
    assert cfg.extra == {"steps": 20, "name": "x"} and type(cfg.extra["steps"]) is int and type(cfg.extra["name"]) is str
    import yaml

    assert yaml.safe_load(yaml.safe_dump(to_dict(cfg)))["extra"] == {"steps": 20, "name": "x"}



def test_keys_overridden_inside_an_untyped_mapping_are_plain_values_yaml_can_write():
    import yaml

    cfg = load_config(Outer, None, ["extra.steps=20", "extra.names=[a, b]", "extra.sub.x=1.5"])
    assert cfg.extra == {"steps": 20, "names": ["a", "b"], "sub": {"x": 1.5}}
    assert type(cfg.extra["steps"]) is int and type(cfg.extra["names"][0]) is str
    assert yaml.safe_load(yaml.safe_dump(to_dict(cfg)))["extra"] == cfg.extra


@dataclass
class Launch:
    gpus: int | None = None
    layout: str = ""


@dataclass
class Scaled:
    DERIVED_KEYS = {"launch.layout": "launch.gpus"}
    launch: Launch = field(default_factory=Launch)


def test_a_derived_key_is_dropped_when_its_source_is_overridden(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("launch:\n  gpus: 4\n  layout: 'rollout: 4 engines'\n")
    assert load_config(Scaled, path).launch == Launch(4, "rollout: 4 engines")
    assert load_config(Scaled, path, ["launch.gpus=1"]).launch == Launch(1, "")
    assert load_config(Scaled, path, ["launch.gpus=1", "launch.layout=rollout: 1 engine"]).launch == Launch(
        1, "rollout: 1 engine")
    assert load_config(Scaled, None, ["launch.gpus=2"]).launch == Launch(2, "")
    assert load_config(Scaled, path, ["launch.gpus=4"]).launch == Launch(4, "rollout: 4 engines")  # unchanged
