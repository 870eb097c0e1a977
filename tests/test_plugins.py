"""Plugins (src/fedskew/plugins.py): methods, datasets, models and runtimes from a folder outside the package
(the config's ``plugins:``) or from an installed package's entry point; names that collide with a built-in
or another plugin refused in one line; a plugin that fails to import: one line, exit 2; runtimes chosen by
their registry entry (src/fedskew/runtimes.py), with no string dispatch on the runtime's name left."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import fedskew.cli
from fedskew.algorithms import ALGORITHMS
from fedskew.algorithms.base import ContractError
from fedskew.data.base import DATASETS
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config, load_config
from fedskew.models.base import MODELS
from fedskew.plugins import load_plugin
from fedskew.runtimes import RUNTIMES
from tests.conftest import cli, digits_config

EXAMPLE = Path(__file__).parent / "plugin_example"
SRC = Path(fedskew.cli.__file__).parents[1]


@pytest.fixture(autouse=True)
def _registries_restored():
    """Whatever a test's plugins register is forgotten afterwards (a reload re-registers it)."""
    with contextlib.ExitStack() as stack:
        for registry in (ALGORITHMS, DATASETS, MODELS, RUNTIMES):
            stack.enter_context(registry.restored())
        yield


def plugin(folder: Path, name: str, code: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(code))
    return path


# ---------------------------------------------------------------------------- plugins: in a config
def test_relative_plugin_paths_resolve_against_the_config_folder_and_are_recorded(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    shutil.copytree(EXAMPLE, folder)
    monkeypatch.chdir(tmp_path)  # not the config's folder
    cfg = load_config(folder / "experiment.yaml")
    assert cfg.plugins == [str(folder / "my_method.py"), str(folder / "dataset_and_model.py")]
    assert ALGORITHMS.get("fedavg_slr").name == "fedavg_slr"
    assert "plugin" in ALGORITHMS.source("fedavg_slr") and "my_method.py" in ALGORITHMS.source("fedavg_slr")
    assert DATASETS.source("tiny_blobs") != "fedskew (built-in)" and "tiny_mlp" in MODELS
    # what a sweep worker or a Flower node does: the recorded config, elsewhere, finds the same files
    monkeypatch.chdir("/")
    again = build_config(cfg.to_dict())
    assert again.plugins == cfg.plugins and again.algorithm.name == "fedavg_slr"


def test_loading_a_plugin_twice_is_idempotent_even_after_a_registry_was_restored(tmp_path):
    path = plugin(
        tmp_path,
        "twice.py",
        """
        from fedskew.algorithms.base import ALGORITHMS, Algorithm
        ALGORITHMS.register("twice_alg")(type("Twice", (Algorithm,), {}))
    """,
    )
    load_plugin(str(path))
    cls = ALGORITHMS.get("twice_alg")
    load_plugin(str(path))  # no "registered twice" with itself
    assert ALGORITHMS.get("twice_alg") is cls
    with ALGORITHMS.restored():
        pass
    with ALGORITHMS.restored():
        ALGORITHMS.discard("twice_alg", cls)  # what a test's restored() leaves behind
        load_plugin(str(path))
        assert ALGORITHMS.get("twice_alg") is cls  # re-registered, not re-executed


def test_a_plugin_taking_a_built_in_name_is_refused_in_one_line_naming_both(tmp_path):
    builtin = ALGORITHMS.get("fedavg")
    path = plugin(
        tmp_path,
        "shadow.py",
        """
        from fedskew.algorithms.base import ALGORITHMS, Algorithm
        ALGORITHMS.register("shadow_ok")(type("Ok", (Algorithm,), {}))
        ALGORITHMS.register("fedavg")(type("Evil", (Algorithm,), {}))
    """,
    )
    with pytest.raises(ConfigError) as err:
        build_config(digits_config(plugins=[str(path)]))
    msg = str(err.value)
    assert "\n" not in msg and "'fedavg'" in msg and "fedskew (built-in)" in msg and "shadow.py" in msg
    assert ALGORITHMS.get("fedavg") is builtin  # never shadowed
    assert "shadow_ok" not in ALGORITHMS  # the half-loaded plugin is undone


def test_two_plugins_registering_one_name_are_refused_naming_both(tmp_path):
    code = """
        from fedskew.models.base import MODELS
        MODELS.register("same_model")(lambda in_shape, num_classes: None)
    """
    a, b = plugin(tmp_path, "a.py", code), plugin(tmp_path, "b.py", code)
    with pytest.raises(ConfigError, match=r"model 'same_model' from plugin '.*b\.py'.*plugin '.*a\.py'"):
        build_config(digits_config(plugins=[str(a), str(b)]))


@pytest.mark.parametrize(
    ("code", "why"),
    [
        ("import not_a_module_anywhere\n", "ModuleNotFoundError: No module named 'not_a_module_anywhere'"),
        ("def broken(:\n", "SyntaxError"),
        ("raise RuntimeError('boom\\nsecond line')\n", "RuntimeError: boom second line"),
    ],
)
def test_a_plugin_that_fails_to_import_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, code, why):
    (tmp_path / "bad.py").write_text(code)
    cfg = digits_config(plugins=["bad.py"])
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    rc, _, err = cli(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("error: ") and "plugin" in err and "bad.py" in err and why in err
    assert not (tmp_path / "out").exists()  # refused before the run folder is touched


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ("missing_file.py", r"config key 'plugins': no file '.*missing_file\.py'"),
        ("rm -rf /", r"config key 'plugins': 'rm -rf /' is neither a \.py file nor a module name"),
        ("definitely_not_installed_mod", r"plugin 'definitely_not_installed_mod' failed to load"),
    ],
)
def test_bad_plugin_entries_are_refused_in_one_line(entry, match):
    with pytest.raises(ConfigError, match=match) as err:
        build_config(digits_config(plugins=[entry]))
    assert "\n" not in str(err.value)


def test_a_module_name_plugin_loads_from_sys_path(tmp_path, monkeypatch):
    plugin(
        tmp_path,
        "h1_user_methods.py",
        """
        from fedskew.algorithms.base import ALGORITHMS, Algorithm
        ALGORITHMS.register("by_module_name")(type("ByName", (Algorithm,), {}))
    """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = build_config(digits_config(plugins=["h1_user_methods"], algorithm={"name": "by_module_name"}))
    assert cfg.plugins == ["h1_user_methods"] and "by_module_name" in ALGORITHMS


# ---------------------------------------------------------------------------- plugins: entry points
def _dist_info(site: Path, group: str, line: str, *more: tuple[str, str]) -> None:
    info = site / "h1_fedskew_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: h1-fedskew-plugin\nVersion: 0.1\n")
    entries = ((group, line), *more)
    (info / "entry_points.txt").write_text("".join(f"[{g}]\n{entry}\n" for g, entry in entries))


def _fedskew(args: list[str], cwd: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": f"{site}:{SRC}", "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    import os

    env |= {k: v for k, v in os.environ.items() if k.startswith(("FEDSKEW_", "OMP_"))}
    return subprocess.run(
        [sys.executable, "-m", "fedskew.cli", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_installed_entry_points_run_embedded_in_a_two_worker_sweep_and_on_a_flower_deployment(tmp_path):
    """A method, a dataset and a model installed as a package (entry points, no ``plugins:`` key) run in
    ``fedskew run``, in a sweep's spawned worker processes and on a loopback Flower deployment's processes,
    each of which loads the entry points itself."""
    site = tmp_path / "site"
    shutil.copytree(EXAMPLE, site / "h1_pkg")
    (site / "h1_pkg" / "__init__.py").write_text("")
    _dist_info(
        site,
        "fedskew.algorithms",
        "fedavg_slr = h1_pkg.my_method",
        ("fedskew.datasets", "tiny_blobs = h1_pkg.dataset_and_model"),
        ("fedskew.models", "tiny_mlp = h1_pkg.dataset_and_model"),
    )
    cfg = yaml.safe_load((EXAMPLE / "experiment.yaml").read_text())
    del cfg["plugins"]
    cfg["rounds"] = 1
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    done = _fedskew(["run", "c.yaml", "--out", "out"], tmp_path, site)
    assert done.returncode == 0, done.stderr[-2000:]
    assert yaml.safe_load((tmp_path / "out/config.yaml").read_text())["algorithm"]["name"] == "fedavg_slr"
    grid = ["--grid", "algorithm.server_lr=0.5,1.0", "--jobs", "2", "--out", "sweep"]
    done = _fedskew(["sweep", "c.yaml", *grid], tmp_path, site)
    assert done.returncode == 0, done.stderr[-2000:]
    summaries = sorted((tmp_path / "sweep").rglob("summary.json"))
    assert len(summaries) == 2 and all(json.loads(p.read_text())["status"] == "finished" for p in summaries)
    listed = _fedskew(["list"], tmp_path, site)
    assert {"fedavg_slr", "tiny_blobs", "tiny_mlp"} <= set(listed.stdout.split())
    # the Flower loopback deployment: its ServerApp and SuperNodes are other processes that find the entry
    # points on their own (the environment's PYTHONPATH), with no plugins key
    deployed = ["--set", "engine.runtime=flower-deployment", "--set", "engine.nodes=2", "--out", "flower"]
    done = _fedskew(["run", "c.yaml", *deployed], tmp_path, site)
    assert done.returncode == 0, done.stderr[-2000:]
    final = [json.loads((tmp_path / f / "summary.json").read_text())["final"] for f in ("out", "flower")]
    assert final[1]["accuracy"] == pytest.approx(final[0]["accuracy"], rel=1e-5)


def test_an_entry_point_that_registers_another_name_is_refused(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(EXAMPLE, site / "h1_pkg")
    (site / "h1_pkg" / "__init__.py").write_text("")
    _dist_info(site, "fedskew.algorithms", "liar = h1_pkg.my_method")  # registers fedavg_slr, not liar
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(digits_config(rounds=1)))
    done = _fedskew(["run", "c.yaml", "--out", "out"], tmp_path, site)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert re.search(r"entry point 'liar = h1_pkg\.my_method'.*registered no algorithm 'liar'", done.stderr)


# ---------------------------------------------------------------------------- the contract, for a plugin
def test_the_readme_plugin_passes_the_public_contract_check(tmp_path):
    from fedskew.testing import check_algorithm

    load_plugin(str(EXAMPLE / "my_method.py"))
    check_algorithm("fedavg_slr", config={"algorithm": {"server_lr": 0.5}}, resume_dir=tmp_path)


def test_a_plugin_that_mutates_its_payload_fails_the_contract_check(tmp_path):
    from fedskew.testing import check_algorithm

    path = plugin(
        tmp_path,
        "mutator.py",
        """
        from fedskew.algorithms.base import ALGORITHMS, Algorithm

        @ALGORITHMS.register("payload_mutator")
        class PayloadMutator(Algorithm):
            def finish_local(self, step, result):
                out = super().finish_local(step, result)
                for v in step.payload.model_state().values():
                    v.mul_(0.5)  # scribbles on the broadcast every other client also receives
                return out
    """,
    )
    load_plugin(str(path))
    with pytest.raises(ContractError, match="mutat|payload"):
        check_algorithm("payload_mutator")


# ---------------------------------------------------------------------------- runtimes
def test_an_unknown_runtime_is_one_line_naming_the_registered_ones():
    with pytest.raises(ConfigError) as err:
        build_config(digits_config(engine={"runtime": "flower-simulaton"}))
    msg = str(err.value)
    assert msg.startswith("config key 'engine.runtime': unknown runtime 'flower-simulaton'")
    assert "did you mean 'flower-simulation'" in msg and ", ".join(RUNTIMES.names()) in msg


def test_a_plugin_runtime_is_launched_by_fedskew_run(tmp_path, monkeypatch, capsys):
    plugin(
        tmp_path,
        "my_runtime.py",
        """
        import json
        from pathlib import Path
        from fedskew.runtimes import Runtime, register_runtime

        def launch(cfg, out, *, resume, force):
            Path(out).mkdir(parents=True, exist_ok=True)
            summary = {"final": {"accuracy": 0.5}, "rounds": cfg.rounds, "wall_seconds": 0.0}
            (Path(out) / "launched.json").write_text(json.dumps({"resume": resume, "rounds": cfg.rounds}))
            return summary

        register_runtime("echo", Runtime("writes what it was asked", launch, in_process=False,
                                         processes=lambda engine: 7))
    """,
    )
    cfg = digits_config(rounds=2, plugins=["my_runtime.py"], engine={"runtime": "echo"})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    cli(["run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert (tmp_path / "out/launched.json").read_text() == '{"resume": false, "rounds": 2}'
    engine = load_config(tmp_path / "c.yaml").engine
    assert RUNTIMES.get("echo").processes(engine) == 7  # what the thread policy divides the cores by


def test_a_plugin_runtime_cannot_take_a_built_in_runtime_name(tmp_path):
    path = plugin(
        tmp_path,
        "hijack.py",
        """
        from fedskew.runtimes import RUNTIMES, Runtime, register_runtime
        register_runtime("embedded", Runtime("mine", print, in_process=True, processes=lambda e: 1))
    """,
    )
    with pytest.raises(
        ConfigError, match=r"runtime 'embedded' from plugin .*hijack\.py.*fedskew \(built-in\)"
    ):
        load_plugin(str(path))


def test_the_built_in_runtimes_declare_what_their_callers_read():
    embedded, sim, deploy = (RUNTIMES.get(n) for n in ("embedded", "flower-simulation", "flower-deployment"))
    assert embedded.in_process and not sim.in_process and not deploy.in_process
    assert deploy.node_local_roots and not sim.node_local_roots and not embedded.node_local_roots
    engine = build_config(digits_config(engine={"workers": 3, "nodes": 4})).engine
    assert (embedded.processes(engine), sim.processes(engine)) == (4, 5)


@pytest.mark.parametrize("module", ["cli/run.py", "cli/sweep.py", "cli/common.py", "flower/launch.py"])
def test_no_string_dispatch_on_the_runtime_name_is_left(module):
    text = (SRC / module).read_text()
    assert not re.search(r"runtime\s*[!=]=|==\s*\"(embedded|flower-)", text), module


# ---------------------------------------------------------------------------- a real deployment
@pytest.mark.slow
def test_a_method_dataset_and_model_plugin_run_on_a_loopback_flower_deployment(tmp_path, monkeypatch, capsys):
    """A SuperLink and 2 SuperNodes as processes: every fresh ClientApp process loads the plugins from the
    recorded config and the run gives the embedded numbers."""
    pytest.importorskip("flwr")
    folder = tmp_path / "project"
    shutil.copytree(EXAMPLE, folder)
    config = str(folder / "experiment.yaml")
    flower = ["--set", "engine.runtime=flower-deployment", "--set", "engine.nodes=2"]
    for out, extra in (("embedded", []), ("flower", flower)):
        rc, _, err = cli(["run", config, "--out", str(tmp_path / out), *extra], monkeypatch, capsys)
        assert rc == 0, err
    rows = {
        out: [yaml.safe_load(x) for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        for out in ("embedded", "flower")
    }
    assert len(rows["flower"]) == len(rows["embedded"]) == 2
    for a, b in zip(rows["flower"], rows["embedded"], strict=True):
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1e-6)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_a_registered_class_cannot_be_renamed_by_registering_it_again():
    """A plugin registering a built-in class under a second name would rename the built-in (the registry sets
    ``cls.name``): refused in one line, the built-in keeps its name and the alias is not registered."""
    fedavg = ALGORITHMS.get("fedavg")
    with pytest.raises(ConfigError, match="registered as 'fedavg' already") as err:
        ALGORITHMS.register("my_alias")(fedavg)
    assert "\n" not in str(err.value)
    assert fedavg.name == "fedavg" and "my_alias" not in ALGORITHMS
    alias = type("Alias", (fedavg,), {"__doc__": "FedAvg under another name."})
    with ALGORITHMS.restored():
        ALGORITHMS.register("my_alias")(alias)  # a subclass may take a new name
        assert alias.name == "my_alias" and fedavg.name == "fedavg"
