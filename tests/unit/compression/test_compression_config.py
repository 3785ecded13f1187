"""The exchange section: options typed per method, an option of another method is an error naming the key,
the old flat keys still load (one warning each, from a recipe or an override), and the DGS staleness bound."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from compression.config import (
    METHOD_SECTIONS,
    RENAMED_KEYS,
    DgcOptions,
    DgsOptions,
    ExchangeConfig,
    SbcOptions,
)
from compression.dgs import DENSE, ParameterServer, TopDensity, Update
from compression.hierarchy import resolve_hierarchy
from compression.registry import METHODS as METHOD_CLASSES
from compression.registry import available_methods, check_exchange, reads
from nmt.config import ConfigError, dump_config, load_config, load_saved_config

METHODS = available_methods()
SHARED_OPTIONS = [
    f.name for f in dataclasses.fields(ExchangeConfig) if f.name not in ("method", *METHOD_SECTIONS)
]
# Who reads each shared option, from the methods' declarations (compression/protocol.py).
READERS = {key: {m for m, cls in METHOD_CLASSES.items() if key in reads(cls)} for key in SHARED_OPTIONS}
# A valid value away from the default for every option, by its path under `exchange.`.
EXAMPLES: dict[str, object] = {
    "drop_ratio": 0.9,
    "threshold": "layer",
    "min_tensor_density": 0.001,
    "threshold_estimator": "exact",
    "sample_size": 10,
    "capacity_factor": 2.0,
    "warmup_steps": 5,
    "dense_vectors": False,
    "embedding_rows": False,
    "quantize_bits": 2,
    "position_code": "golomb",
    "dense_fallback": False,
    "sample_seed": 3,
    "hierarchy": "node",
    "node_size": 2,
    "overlap": True,
    "bucket_mb": 8.0,
    "local_mix.local_mode": "replace",
    "local_mix.average_every": 7,
    "local_mix.local_weight": 0.5,
    "dgc.momentum": 0.5,
    "dgc.local_clip_norm": 1.0,
    "dgc_adam.beta1": 0.8,
    "dgc_adam.beta2": 0.99,
    "dgc_adam.eps": 1e-6,
    "dgc_adam.variance_every": 50,
    "dgc_adam.local_clip_norm": 0.5,
    "dgc_adam.momentum_masking": True,
    "dgc_adam.local_update": False,
    "dgc_adam.average_every": 25,
    "sbc.delay": 3,
    "sbc.density": 0.5,
    "sbc.preset": "delay-10",
    "sbc.binarize": False,
    "sbc.selection": "magnitude",
    "sbc.dense_vectors": True,
    "sbc.momentum_masking": False,
    "dgs.max_staleness": 40,
    "dgs.mode": "one_way",
    "dgs.pull_density": 0.05,
    "dgs.deterministic": True,
    "powersgd.rank": 2,
    "powersgd.start_step": 5,
    "powersgd.min_compression_rate": 3.0,
    "local_sgd.sync_every": 4,
    "local_sgd.momentum": 0.5,
    "local_sgd.outer_lr": 0.5,
    "diloco.sync_every": 20,
    "diloco.outer_lr": 0.5,
    "diloco.outer_momentum": 0.5,
    "diloco.nesterov": False,
    "diloco.fragments": 2,
    "diloco.overlap_steps": 1,
    "diloco.mixing": 0.25,
    "diloco.outer_bits": 8,
    "diloco.density": 0.05,
    "diloco.accumulator_decay": 0.5,
}
# Sections of the methods that came after the flat keys were renamed: they never had a flat name.
NEW_SECTIONS = ("local_sgd", "diloco", "dgc_adam")
NEW_SECTION_KEYS = ("local_mix.local_weight",)  # added after the flat names were retired: none to rename
SECTION_OPTIONS = [key for key in EXAMPLES if "." in key]


def exchange_tree(method: str, **options: object) -> dict:
    """{"method": m, "sbc": {"delay": 3}, ...} from dotted options ("sbc.delay")."""
    tree: dict = {"method": method}
    for key, value in options.items():
        *section, name = key.split(".")
        (tree.setdefault(section[0], {}) if section else tree)[name] = value
    return tree


def write_recipe(tmp_path: Path, exchange: dict) -> Path:
    """A recipe of `exchange` and plain SGD without clipping (what dgc, dgc_adam and dgs require of the
    optimizer; every method runs with it)."""
    path = tmp_path / "recipe.yml"
    tree = {"train": {"optimizer": "sgd", "clip_norm": 0.0}, "exchange": exchange}
    path.write_text(yaml.safe_dump(tree, sort_keys=False), encoding="utf-8")
    return path


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip().startswith(text))


def get(exchange: ExchangeConfig, key: str) -> object:
    value: object = exchange
    for part in key.split("."):
        value = getattr(value, part)
    return value


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "nmt.config" and r.levelno == logging.WARNING]


def test_examples_cover_every_option() -> None:
    shared = SHARED_OPTIONS
    assert all(READERS[key] for key in shared)  # every shared option is read by some method
    nested = [
        f"{section}.{f.name}"
        for section in METHOD_SECTIONS
        for f in dataclasses.fields(getattr(ExchangeConfig(), section))
    ]
    assert sorted(EXAMPLES) == sorted([*shared, *nested])
    older = [
        key
        for key in SECTION_OPTIONS
        if key.split(".")[0] not in NEW_SECTIONS and key not in NEW_SECTION_KEYS
    ]
    assert sorted(RENAMED_KEYS.values()) == sorted(older)  # every older method option had a flat name


# ------------------------------------------------------------------------------------------ nested keys


def test_nested_keys_load_from_a_recipe_and_from_overrides(tmp_path: Path, caplog) -> None:
    recipe = write_recipe(tmp_path, {"method": "sbc", "sbc": {"delay": 10, "selection": "magnitude"}})
    with caplog.at_level(logging.WARNING, logger="nmt.config"):
        config = load_config(recipe, ["exchange.sbc.density=0.05", "exchange.sbc.binarize=false"])
    assert (config.exchange.sbc.delay, config.exchange.sbc.selection) == (10, "magnitude")
    assert (config.exchange.sbc.density, config.exchange.sbc.binarize) == (0.05, False)
    assert warnings_of(caplog) == []
    again = tmp_path / "dumped.yml"
    again.write_text(dump_config(config), encoding="utf-8")  # what config.yml holds: reads back the same
    assert load_config(again).exchange == config.exchange


@pytest.mark.parametrize("key", SECTION_OPTIONS)
def test_each_method_option_lands_under_its_method(key: str) -> None:
    method = key.split(".")[0]
    option = f"exchange.{key}={json.dumps(EXAMPLES[key])}"
    overrides = ["train.optimizer=sgd", "train.clip_norm=0", f"exchange.method={method}", option]
    exchange = load_config(None, overrides)
    assert get(exchange.exchange, key) == EXAMPLES[key]


# --------------------------------------------------------------------------------- options of other methods


def test_an_option_of_another_method_is_an_error_naming_the_key_and_line(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, {"method": "local_mix", "sbc": {"delay": 5}})
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    assert str(err.value) == (
        f"{recipe}:{line_of(recipe, 'delay:')}: exchange.sbc.delay is set but exchange.method is "
        "'local_mix'; it only applies to method sbc: remove it or set exchange.method=sbc"
    )
    with pytest.raises(ConfigError, match=r"^override exchange.method=dense: exchange.sbc.delay is set"):
        load_config(write_recipe(tmp_path, {"method": "sbc", "sbc": {"delay": 5}}), ["exchange.method=dense"])


@pytest.mark.parametrize("key", SECTION_OPTIONS)
@pytest.mark.parametrize("method", METHODS)
def test_method_options_apply_to_their_method_only(key: str, method: str) -> None:
    owner = key.split(".")[0]
    config = ExchangeConfig(method=method)
    setattr(getattr(config, owner), key.split(".")[1], EXAMPLES[key])
    if method == owner:
        check_exchange(config, {"train": {"optimizer": "sgd", "clip_norm": 0.0}})
        return
    with pytest.raises(ValueError) as err:
        check_exchange(config)
    assert str(err.value) == (
        f"exchange.{key} is set but exchange.method is {method!r}; it only applies to method {owner}: "
        f"remove it or set exchange.method={owner}"
    )


@pytest.mark.parametrize("key", sorted(SHARED_OPTIONS))
@pytest.mark.parametrize("method", METHODS)
def test_shared_options_apply_to_the_methods_that_read_them(key: str, method: str) -> None:
    config = ExchangeConfig(method=method, **{key: EXAMPLES[key]})
    if key == "overlap" and method in ("dropping", "local_mix", "dgc"):
        config.threshold = "layer"  # the sparse overlap needs layer thresholds (tested below)
    if method == "dgs" and key in ("threshold", "quantize_bits"):  # read only to refuse them
        with pytest.raises(ValueError, match=r"^exchange.method dgs (selects with one global|sends fp32)"):
            check_exchange(config)
        return
    if method == "diloco" and key == "quantize_bits":  # quantizes the sparse pseudo-gradient only
        with pytest.raises(ValueError, match=r"^exchange.quantize_bits quantizes the sparse pseudo-gradient"):
            check_exchange(config)
        return
    if method == "diloco" and key == "position_code":  # codes the sparse pseudo-gradient's positions only
        with pytest.raises(ValueError, match=r"^exchange.position_code codes the positions of exchange"):
            check_exchange(config)
        return
    if method in READERS[key]:
        check_exchange(config)
        return
    with pytest.raises(
        ValueError, match=rf"^exchange\.{key} is set but exchange\.method is '{method}'; it only"
    ):
        check_exchange(config)


def test_shared_options_table() -> None:
    """Who reads what (each method's declaration): the dropping family everything but the overlap, which
    dropping, local_mix and dgc read, and the position code, which dgs's own wire does not use; dgc and
    dgc_adam no embedding rows, dgc_adam no overlap or hierarchy; dgs no dense vectors, embedding rows or
    hierarchy; powersgd only the seed; diloco the sparse round's options (for its compressed
    pseudo-gradients), not the drop ratio or its warm-up; dense and dense_bf16 only the overlap; sbc and
    local_sgd none."""
    readers = READERS
    assert {m for methods in readers.values() for m in methods} == {
        "dropping",
        "local_mix",
        "dgc",
        "dgc_adam",
        "dgs",
        "powersgd",
        "dense",
        "dense_bf16",
        "diloco",
    }
    diloco = {key for key, methods in readers.items() if "diloco" in methods}
    assert diloco == {
        "threshold",
        "min_tensor_density",
        "threshold_estimator",
        "sample_size",
        "capacity_factor",
        "quantize_bits",
        "position_code",
        "dense_fallback",
        "dense_vectors",
        "sample_seed",
    }
    overlap = {"overlap", "bucket_mb"}
    assert all(readers[key] == {"dense", "dense_bf16", "dropping", "local_mix", "dgc"} for key in overlap)
    assert all({"dropping", "local_mix"} <= methods for key, methods in readers.items() if key not in overlap)
    assert readers["hierarchy"] == readers["node_size"] == {"dropping", "local_mix", "dgc"}
    assert readers["embedding_rows"] == {"dropping", "local_mix"}
    assert readers["min_tensor_density"] == {"dropping", "local_mix", "dgc", "dgc_adam", "diloco"}
    assert readers["dense_vectors"] == {"dropping", "local_mix", "dgc", "dgc_adam", "diloco"}
    assert readers["position_code"] == {"dropping", "local_mix", "dgc", "dgc_adam", "diloco"}
    assert [key for key, methods in readers.items() if "powersgd" in methods] == ["sample_seed"]


@pytest.mark.parametrize("method", ["dropping", "local_mix", "dgc"])
def test_the_sparse_overlap_needs_layer_thresholds_and_a_flat_exchange(method: str) -> None:
    with pytest.raises(ValueError, match=rf"^exchange.overlap with {method} needs exchange.threshold: layer"):
        check_exchange(ExchangeConfig(method=method, overlap=True))
    layer = ExchangeConfig(method=method, overlap=True, threshold="layer")
    check_exchange(layer)
    with pytest.raises(ValueError, match=r"^exchange.overlap: the hierarchical exchange .* after backward"):
        check_exchange(ExchangeConfig(method=method, overlap=True, threshold="layer", hierarchy="node"))
    auto = ExchangeConfig(method=method, overlap=True, threshold="layer", hierarchy="auto")
    check_exchange(auto)  # flat on one machine; refused only when it resolves to nodes
    assert resolve_hierarchy(auto, world_size=2, ranks_per_machine=2).hierarchy == "flat"
    with pytest.raises(ValueError, match=r"^exchange.overlap: the hierarchical exchange \(exchange.hier"):
        resolve_hierarchy(auto, world_size=4, ranks_per_machine=2)


def test_the_dgc_overlap_refuses_local_clipping() -> None:
    clipped = ExchangeConfig(
        method="dgc", overlap=True, threshold="layer", dgc=DgcOptions(local_clip_norm=1.0)
    )
    with pytest.raises(
        ValueError, match=r"^exchange.overlap with dgc needs exchange.dgc.local_clip_norm: 0 "
    ):
        check_exchange(clipped)


def test_an_option_set_to_its_default_is_no_error() -> None:
    check_exchange(ExchangeConfig(method="dense", drop_ratio=0.99, sbc=SbcOptions(delay=1)))


def test_a_recipe_section_of_another_method_can_be_reset_from_the_command_line(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, {"method": "local_mix", "local_mix": {"average_every": 100}})
    config = load_config(recipe, ["exchange.method=dense", "exchange.local_mix={}"])
    assert config.exchange.local_mix.average_every == 500


def test_the_shipped_recipes_load(caplog) -> None:
    root = Path(__file__).resolve().parents[3]
    with caplog.at_level(logging.WARNING, logger="nmt.config"):
        for recipe in sorted((root / "recipes").glob("*.yml")):
            load_config(recipe)
    assert warnings_of(caplog) == []


# ------------------------------------------------------------------------------------------- old keys


@pytest.mark.parametrize("old", sorted(RENAMED_KEYS))
def test_each_old_key_in_a_recipe_loads_with_one_warning(old: str, tmp_path: Path, caplog) -> None:
    new = RENAMED_KEYS[old]
    recipe = write_recipe(tmp_path, {"method": new.split(".")[0], old: EXAMPLES[new]})
    with caplog.at_level(logging.WARNING, logger="nmt.config"):
        config = load_config(recipe)
    assert get(config.exchange, new) == EXAMPLES[new]
    line = line_of(recipe, f"{old}:")
    assert warnings_of(caplog) == [f"{recipe}:{line}: exchange.{old} is now exchange.{new}; rename it"]


@pytest.mark.parametrize("old", sorted(RENAMED_KEYS))
def test_each_old_key_in_an_override_loads_with_one_warning(old: str, caplog) -> None:
    new = RENAMED_KEYS[old]
    override = f"exchange.{old}={json.dumps(EXAMPLES[new])}"
    with caplog.at_level(logging.WARNING, logger="nmt.config"):
        config = load_config(None, ["train.optimizer=sgd", f"exchange.method={new.split('.')[0]}", override])
    assert get(config.exchange, new) == EXAMPLES[new]
    assert warnings_of(caplog) == [f"override {override}: exchange.{old} is now exchange.{new}; rename it"]


def test_an_old_key_is_checked_under_its_new_name(tmp_path: Path, caplog) -> None:
    with pytest.raises(ConfigError, match=r"^override exchange.delay=0: exchange.sbc.delay must be >= 1"):
        load_config(None, ["exchange.method=sbc", "exchange.delay=0"])
    recipe = write_recipe(tmp_path, {"method": "sbc", "delay": 0})
    with pytest.raises(
        ConfigError, match=rf"^{recipe}:{line_of(recipe, 'delay:')}: exchange.sbc.delay must be"
    ):
        load_config(recipe)
    with pytest.raises(ConfigError, match="exchange.sbc.delay is set but exchange.method is 'dense'"):
        load_config(None, ["exchange.delay=3"])  # an override is not an old-style recipe: the new rules hold


def test_an_override_replaces_the_recipes_old_key(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, {"method": "sbc", "delay": 5})
    assert load_config(recipe, ["exchange.sbc.delay=7"]).exchange.sbc.delay == 7
    both = write_recipe(tmp_path, {"method": "sbc", "delay": 5, "sbc": {"delay": 6}})
    with pytest.raises(
        ConfigError, match="exchange.delay and exchange.sbc.delay are both set; keep exchange.sbc.delay"
    ):
        load_config(both)


OLD_DEFAULTS = {  # the exchange section as config.yml files wrote it before the options moved
    "local_mode": "replace",
    "average_every": 500,
    "momentum": 0.9,
    "local_clip_norm": 0.0,
    "delay": 1,
    "density": 0.01,
    "preset": "",
    "max_staleness": 16,
    "sbc_binarize": True,
    "sbc_selection": "per_sign",
    "sbc_dense_vectors": False,
    "sbc_momentum_masking": True,
    "dgs_mode": "dual",
    "dgs_pull_density": 0.0,
    "dgs_deterministic": False,
    "powersgd_rank": 4,
    "powersgd_start_step": 10,
    "powersgd_min_compression_rate": 2.0,
}


def old_checkpoint_config(tmp_path: Path, method: str, **changes: object) -> Path:
    shared = {f.name: f.default for f in dataclasses.fields(ExchangeConfig) if f.name in SHARED_OPTIONS}
    return write_recipe(tmp_path, {"method": method, **shared, **OLD_DEFAULTS, **changes})


def test_an_old_checkpoint_config_keeps_loading(tmp_path: Path, caplog) -> None:
    """recipes/bible-es-en.yml used to carry local_mix settings with method dense: its runs' config.yml hold
    them. They were ignored then, so they are ignored now (not an error), and the run resumes."""
    saved = old_checkpoint_config(tmp_path, "dense", average_every=100, warmup_steps=50)
    with caplog.at_level(logging.WARNING, logger="nmt.config"):
        config = load_config(saved, warn_old_keys=False)  # how checkpoints are read: nothing to tell the user
    assert warnings_of(caplog) == []
    assert config.exchange == ExchangeConfig()  # everything dense does not read is back at its default
    with caplog.at_level(logging.WARNING, logger="nmt.config"):
        load_config(saved)  # given as --config by the user: says what to rename and what is ignored
    lines = warnings_of(caplog)
    assert len([line for line in lines if "is now" in line]) == len(RENAMED_KEYS)
    ignored = [line for line in lines if "is ignored" in line]
    # warmup_steps, average_every, local_mode (replace, the default until issue 27), max_staleness (16)
    assert len(ignored) == 4
    assert ignored[0] == (
        f"{saved}:{line_of(saved, 'warmup_steps:')}: exchange.warmup_steps is ignored: exchange.method "
        "'dense' does not read it (tolerated beside the old flat keys, an error with the new ones): remove it"
    )


def test_a_saved_config_holding_other_methods_sections_at_former_defaults_loads(tmp_path: Path) -> None:
    """Every config.yml the program writes holds every method's section, at the defaults of its day. When a
    default moves (local_mix's local_mode: replace -> sum), an older dense checkpoint still loads, for resume,
    init_from and decoding, and the local_mix checkpoint keeps the mode it trained with; a recipe that sets
    another method's option is still an error."""
    for method in ("dense", "local_mix"):
        path = tmp_path / method / "config.yml"
        path.parent.mkdir()
        older = {"method": method, "local_mix": {"local_mode": "replace", "average_every": 500}}
        path.write_text(yaml.safe_dump({"train": {"optimizer": "sgd"}, "exchange": older}), encoding="utf-8")
        loaded = load_saved_config(path).exchange
        assert loaded.local_mix.local_mode == ("replace" if method == "local_mix" else "sum")
    with pytest.raises(ConfigError, match="local_mix.local_mode is set but exchange.method is .dense."):
        load_config(tmp_path / "dense" / "config.yml")


def test_an_old_checkpoint_config_of_the_method_keeps_its_options(tmp_path: Path) -> None:
    saved = old_checkpoint_config(tmp_path, "dgs", dgs_mode="one_way", warmup_steps=50)
    dgs = load_config(saved, warn_old_keys=False).exchange
    assert (dgs.dgs.mode, dgs.dgs.max_staleness, dgs.warmup_steps) == (
        "one_way",
        16,
        50,
    )  # the bound it ran with


# ----------------------------------------------------------------------------------- DGS staleness bound


def test_max_staleness_defaults_to_auto() -> None:
    options = DgsOptions()
    assert options.max_staleness == 0
    assert [options.staleness_bound(w) for w in (1, 2, 8, 9, 32)] == [16, 16, 16, 18, 64]
    assert DgsOptions(max_staleness=400).staleness_bound(32) == 400
    with pytest.raises(ValueError, match=r"exchange.dgs.max_staleness must be >= 0 \(0 = auto\)"):
        DgsOptions(max_staleness=-1).validate()


def refreshes_in_round_robin(workers: int, max_staleness: int, rounds: int = 4) -> int:
    """Dense refreshes when `workers` take turns pushing and pulling (each pulls every `workers` updates)."""
    server = ParameterServer(torch.zeros(1000), workers, max_staleness)
    selector = TopDensity(estimator="exact", dense_fallback=False)
    gen = torch.Generator().manual_seed(0)
    for step in range(rounds * workers):
        worker = step % workers
        server.apply(worker, Update(DENSE, torch.randn(1000, generator=gen)), lr=0.1)
        server.pull(worker, selector, density=0.01)
    return server.refreshes


def test_the_auto_bound_keeps_pulls_sparse_with_many_workers() -> None:
    workers = 20
    assert refreshes_in_round_robin(workers, 16) >= (4 - 1) * workers  # the old default: every pull dense
    auto = refreshes_in_round_robin(workers, DgsOptions().staleness_bound(workers))
    assert auto <= workers  # about one dense refresh in every other round


def test_dgs_is_registered_as_an_asynchronous_method_with_a_server_process():
    from compression.registry import build_exchange, is_asynchronous, job_processes

    assert is_asynchronous("dgs") and not is_asynchronous("dense")
    assert job_processes("dgs", 2) == 3 and job_processes("local_mix", 2) == 2
    with pytest.raises(ValueError, match="asynchronous trainer"):
        build_exchange(ExchangeConfig(method="dgs"))
