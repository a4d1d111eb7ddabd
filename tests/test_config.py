"""Configs: YAML load, dotted overrides, validation errors that name key, value and rule."""

from __future__ import annotations

import re

import pytest

from epscale.cli import main as cli_main
from epscale.config import (ConfigError, MoEConfig, RunConfig, apply_overrides, dump_yaml,
                            from_dict, load_config, load_recipe, load_yaml, parse_override,
                            recipe_path)


def moe(**kw) -> MoEConfig:
    return from_dict(MoEConfig, kw, prefix="moe")


# ------------------------------------------------------------------ valid configs

def test_defaults_and_issue_fields_exist():
    cfg = MoEConfig()
    for name in ("dim", "hidden_dim", "num_experts", "top_k", "score_func", "route_norm",
                 "route_scale", "num_shared_experts", "num_groups", "topk_groups",
                 "capacity_factor", "drop_policy", "activation", "aux_loss_coeff",
                 "seq_aux_loss_coeff", "z_loss_coeff"):
        assert hasattr(cfg, name), name
    assert cfg.capacity_factor is None  # dropless by default


def test_from_dict_coerces_harmless_numbers():
    cfg = moe(top_k=4.0, route_scale=2, capacity_factor=1, num_experts=16)
    assert cfg.top_k == 4 and isinstance(cfg.top_k, int)
    assert cfg.route_scale == 2.0 and isinstance(cfg.route_scale, float)
    assert cfg.capacity_factor == 1.0 and isinstance(cfg.capacity_factor, float)


def test_group_limited_config_accepted():
    cfg = moe(num_experts=16, top_k=4, num_groups=4, topk_groups=2)
    assert (cfg.num_groups, cfg.topk_groups) == (4, 2)


# ------------------------------------------------------------------ validation errors

@pytest.mark.parametrize("kw, key, value, rule", [
    (dict(num_experts=4, top_k=5), "moe.top_k", "5", "num_experts (4)"),
    (dict(num_experts=8, num_groups=3, topk_groups=1), "moe.num_groups", "3", "divide"),
    (dict(num_experts=8, num_groups=4, topk_groups=5), "moe.topk_groups", "5", "[1, moe.num_groups=4]"),
    (dict(num_experts=8, top_k=4, num_groups=4, topk_groups=1), "moe.topk_groups", "1", "fewer than moe.top_k=4"),
    (dict(topk_groups=2), "moe.topk_groups", "2", "num_groups > 0"),
    (dict(capacity_factor=0.0), "moe.capacity_factor", "0.0", "> 0 or null"),
    (dict(score_func="softmx"), "moe.score_func", "'softmx'", "did you mean 'softmax'"),
    (dict(drop_policy="prob"), "moe.drop_policy", "'prob'", "did you mean 'probs'"),
    (dict(activation="relu"), "moe.activation", "'relu'", "'swiglu', 'gelu'"),
    (dict(dim=0), "moe.dim", "0", "positive integer"),
    (dict(route_scale=-1.0), "moe.route_scale", "-1.0", "> 0"),
    (dict(z_loss_coeff=-0.1), "moe.z_loss_coeff", "-0.1", ">= 0"),
    (dict(num_shared_experts=-1), "moe.num_shared_experts", "-1", ">= 0"),
])
def test_invalid_values_name_key_value_and_rule(kw, key, value, rule):
    with pytest.raises(ConfigError) as info:
        moe(**kw)
    msg = str(info.value)
    assert f"'{key}'" in msg and value in msg and rule in msg, msg


@pytest.mark.parametrize("kw, key, rule", [
    (dict(top_k="two"), "moe.top_k", "must be an integer"),
    (dict(top_k=2.5), "moe.top_k", "must be an integer"),
    (dict(top_k=True), "moe.top_k", "must be an integer"),
    (dict(route_norm=1), "moe.route_norm", "true or false"),
    (dict(route_scale="big"), "moe.route_scale", "must be a number"),
    (dict(capacity_factor="lots"), "moe.capacity_factor", "must be a number"),
    (dict(score_func=3), "moe.score_func", "must be a string"),
])
def test_wrong_types_from_dict(kw, key, rule):
    with pytest.raises(ConfigError, match=rule) as info:
        moe(**kw)
    assert f"'{key}'" in str(info.value)


@pytest.mark.parametrize("kw, key", [
    (dict(route_scale="2"), "moe.route_scale"),
    (dict(num_shared_experts=1.5), "moe.num_shared_experts"),
    (dict(aux_loss_coeff=None), "moe.aux_loss_coeff"),
    (dict(route_norm="yes"), "moe.route_norm"),
])
def test_wrong_types_in_python_constructor(kw, key):
    """Building the dataclass directly gets the same clear error, not a TypeError."""
    with pytest.raises(ConfigError) as info:
        MoEConfig(**kw)
    assert f"'{key}'" in str(info.value)


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match=r"unknown config key 'moe.topk'. Did you mean 'top_k'\?"):
        moe(topk=2)
    with pytest.raises(ConfigError, match="Known keys here"):
        moe(zzzzzz=1)


def test_unknown_section_and_nested_key_in_run_config():
    with pytest.raises(ConfigError, match=r"'moee'. Did you mean 'moe'\?"):
        from_dict(RunConfig, {"moee": {}})
    with pytest.raises(ConfigError, match=r"'moe.capacity'. Did you mean 'capacity_factor'\?"):
        from_dict(RunConfig, {"moe": {"capacity": 1.0}})
    with pytest.raises(ConfigError, match="'moe' .*must be a mapping"):
        from_dict(RunConfig, {"moe": 3})


# ------------------------------------------------------------------ YAML and overrides

def test_parse_override_values_are_yaml():
    assert parse_override("moe.top_k=4") == (["moe", "top_k"], 4)
    assert parse_override("moe.capacity_factor=null") == (["moe", "capacity_factor"], None)
    assert parse_override("moe.route_norm=false") == (["moe", "route_norm"], False)
    assert parse_override("moe.score_func=sigmoid") == (["moe", "score_func"], "sigmoid")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("moe.top_k")
    with pytest.raises(ConfigError, match="empty key"):
        parse_override("=3")


def test_on_off_yes_no_are_strings_not_booleans(tmp_path):
    """YAML 1.2 booleans: only true/false. YAML 1.1 would read off as False, and
    moe.cpu.elementwise=off (a string choice) would be rejected as a boolean."""
    assert parse_override("moe.cpu.elementwise=off") == (["moe", "cpu", "elementwise"], "off")
    assert parse_override("moe.route_norm=True") == (["moe", "route_norm"], True)
    path = tmp_path / "r.yaml"
    path.write_text("name: t\nmoe:\n  cpu:\n    elementwise: off\n  route_norm: false\n")
    cfg = load_config(path, [])
    assert cfg.moe.cpu.elementwise == "off" and cfg.moe.route_norm is False
    assert load_config(path, ["moe.cpu.elementwise=native"]).moe.cpu.elementwise == "native"
    with pytest.raises(ConfigError, match="moe.route_norm.*true or false"):
        load_config(path, ["moe.route_norm=yes"])


def test_apply_overrides_does_not_mutate_input():
    base = {"moe": {"top_k": 2}}
    out = apply_overrides(base, ["moe.top_k=4", "moe.num_experts=16", "train.steps=5"])
    assert base == {"moe": {"top_k": 2}}
    assert out == {"moe": {"top_k": 4, "num_experts": 16}, "train": {"steps": 5}}
    with pytest.raises(ConfigError, match="not a section"):
        apply_overrides({"moe": {"top_k": 2}}, ["moe.top_k.x=1"])


def test_load_yaml_with_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: tiny\nmodel:\n  dim: 64\nmoe:\n  num_experts: 8\n  top_k: 2\n"
                    "  score_func: sigmoid\n  capacity_factor: 1.25\n")
    cfg = load_config(path, ["moe.top_k=4", "moe.capacity_factor=null"])
    assert isinstance(cfg, RunConfig)
    assert cfg.name == "tiny"
    assert cfg.moe.dim == 64  # follows model.dim
    assert (cfg.moe.top_k, cfg.moe.capacity_factor, cfg.moe.score_func) == (4, None, "sigmoid")


def test_load_config_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("moe:\n  num_experts: 4\n  top_k: 8\n")
    with pytest.raises(ConfigError, match=r"'moe.top_k' = 8 .*\(in .*bad.yaml\)"):
        load_config(path)
    with pytest.raises(ConfigError, match="Did you mean 'num_experts'"):
        load_config(None, ["moe.num_expert=4"])


def test_load_yaml_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("moe: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at top level"):
        load_yaml(lst)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_yaml(empty) == {}


def test_moe_dim_must_match_model_dim():
    with pytest.raises(ConfigError, match=r"'moe.dim' = 32 .*model.dim \(64\)"):
        load_config(None, ["model.dim=64", "moe.dim=32"])


def test_dump_and_reload_round_trip(tmp_path):
    cfg = load_config(None, ["moe.num_experts=16", "moe.top_k=4", "moe.num_groups=4",
                             "moe.topk_groups=2", "moe.capacity_factor=1.5"])
    path = tmp_path / "out.yaml"
    dump_yaml(cfg, path)
    again = load_config(path)
    assert again == cfg


def test_redundant_expert_keys_are_validated():
    from epscale.plan.layout import Layout

    def layout(world, ep, redundant):
        over = [f"parallel.ep={ep}", f"parallel.redundant_experts={redundant}", "moe.num_experts=8"]
        return Layout.from_config(load_config(None, over), world)

    with pytest.raises(ConfigError, match=r"parallel.redundant_experts.*spill_threshold"):
        load_config(None, ["parallel.redundant_experts=2", "parallel.spill_threshold=1.2"])
    with pytest.raises(ConfigError, match=r"parallel.rebalance_every.*>= 0"):
        load_config(None, ["parallel.rebalance_every=-1"])
    with pytest.raises(ConfigError, match=r"parallel.rebalance_window"):
        load_config(None, ["parallel.rebalance_window=0"])
    # The physical slots must divide over the EP ranks; copies need ep >= 2.
    with pytest.raises(ConfigError, match=r"redundant_experts' = 3 .*11 physical slots.*ep = 2"):
        layout(2, 2, 3)
    with pytest.raises(ConfigError, match=r"redundant_experts' = 2 .*needs parallel.ep >= 2"):
        layout(1, 1, 2)
    lay = layout(2, 2, 4)
    assert (lay.dp, lay.ep, lay.redundant_experts) == (1, 2, 4)


# ----------------------------------------------------------------- issue #24: bad input


@pytest.mark.parametrize("text, what", [("", "is empty"), ("\n  \n", "is empty"),
                                        ("# nothing set yet\n\n# moe:\n", "is empty (only comments)")])
def test_empty_config_file_is_an_error_naming_it(tmp_path, text, what):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    msg = (rf"config file '.*x\.yaml' {re.escape(what)}: it sets nothing; to train on the "
           r"built-in defaults leave out --config")
    with pytest.raises(ConfigError, match=msg):
        load_config(path)
    with pytest.raises(ConfigError, match=msg):
        load_recipe(path, ["train.steps=5"])
    assert load_yaml(path) == {}  # cluster and alert-rule files: nothing set means the defaults
    (tmp_path / "braces.yaml").write_text("{}\n")  # an explicit empty mapping is deliberate
    assert load_config(tmp_path / "braces.yaml") == load_config(None)


def test_directory_as_config_file_says_so(tmp_path, capsys):
    run = tmp_path / "run1"
    run.mkdir()
    with pytest.raises(ConfigError, match=r"'.*run1' is a directory, not a YAML file; give the "
                                          r"path of a YAML file$"):
        load_yaml(run)
    (run / "alerts.yaml").write_text("imbalance_steps: 3\n")
    (run / "config.yaml").write_text("name: r\n")
    with pytest.raises(ConfigError, match=r"is a directory.*\(e\.g\. '.*run1/config\.yaml'\)"):
        load_config(run)
    with pytest.raises(ConfigError, match=r"is a directory.*config\.yaml'\), or a recipe name; "
                                          r"recipes: .*deepseek-v3"):
        recipe_path(run)
    assert cli_main(["describe", str(run)]) == 2
    assert "is a directory, not a YAML file" in capsys.readouterr().err


def test_override_errors_name_the_override_not_the_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("moe:\n  num_experts: 8\n  top_k: 2\n")
    from_override = r"\(from the command-line override 'moe.top_k=99'\)$"
    with pytest.raises(ConfigError, match=r"'moe.top_k' = 99 .*" + from_override):
        load_config(path, ["moe.top_k=99"])
    with pytest.raises(ConfigError, match=from_override):
        load_config(None, ["moe.top_k=99"])
    with pytest.raises(ConfigError, match=r"unknown config key 'moe.num_expert'.*"
                                          r"\(from the command-line override 'moe.num_expert=4'\)$"):
        load_config(path, ["moe.num_expert=4"])
    # a key from the file keeps '(in PATH)'; a clash with an override names both
    bad = tmp_path / "bad.yaml"
    bad.write_text("moe:\n  num_experts: 4\n  top_k: 8\n")
    with pytest.raises(ConfigError, match=r"'moe.top_k' = 8 .*\(in [^,]*bad\.yaml\)$"):
        load_config(bad, ["train.steps=3"])
    with pytest.raises(ConfigError, match=r"'moe.top_k' = 8 .*\(in .*bad\.yaml, with the "
                                          r"command-line override 'moe.num_experts=2'\)$"):
        load_config(bad, ["moe.num_experts=2"])
    # with scale=tiny the overrides apply after shrinking: still named
    with pytest.raises(ConfigError, match=from_override):
        load_recipe("mixtral-8x7b", ["scale=tiny", "moe.top_k=99"])


def test_renamed_keys_in_overrides_are_named_and_work_with_scale_tiny(tmp_path):
    with pytest.warns(FutureWarning, match=r"has moved to 'moe.cpu.elementwise' \(from the "
                                           r"command-line override 'moe.compile_kernels=on'\)"):
        cfg = load_recipe("mixtral-8x7b", ["scale=tiny", "moe.compile_kernels=on"])
    assert cfg.moe.cpu.elementwise == "inductor" and cfg.model.dim == 64
    with pytest.warns(FutureWarning), pytest.raises(
            ConfigError, match=r"'moe.cpu.elementwise' = 'bogus' .*\(from the command-line "
                               r"override 'moe.compile_kernels=bogus'\)$"):
        load_config(None, ["moe.compile_kernels=bogus"])
    old = tmp_path / "old.yaml"
    old.write_text("moe:\n  compile_kernels: on\n")
    with pytest.warns(FutureWarning, match=r"has moved to 'moe.cpu.elementwise' \(in .*old\.yaml\)"):
        assert load_config(old).moe.cpu.elementwise == "inductor"
    with pytest.raises(ConfigError, match=r"both set \(in .*old\.yaml, with the command-line "
                                          r"override 'moe.cpu.elementwise=auto'\)"):
        load_config(old, ["moe.cpu.elementwise=auto"])
