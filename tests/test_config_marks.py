"""Config errors carry a place: file:line:col of the key in the YAML file, or the --set override that set
it (experiment/config_marks.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fedskew.errors import ConfigError
from fedskew.experiment.config import load_config
from fedskew.experiment.config_marks import MAX_MARKS, read_marked

HEAD = """seed: 0
rounds: 2
data:
  dataset: digits
  num_clients: 4
"""


def write(tmp_path: Path, text: str, name: str = "x.yaml", newline: str = "\n") -> Path:
    path = tmp_path / name
    path.write_bytes(text.replace("\n", newline).encode())
    return path


def error_of(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_schema_error_names_file_line_and_column(tmp_path):
    path = write(tmp_path, HEAD + "client:\n    epochs: 1\n    lr: abc\n")
    assert error_of(path).startswith(f"{path}:8:5: config key 'client.lr': Input should be a valid number")


def test_semantic_errors_deep_in_nested_sections_point_at_their_key(tmp_path):
    text = (
        HEAD + "  partition:\n    name: dirichlet\n    alpah: 0.3\nalgorithm:\n  name: fedprox\n  mu: lots\n"
    )
    msg = error_of(write(tmp_path, text))
    assert msg.startswith(f"{tmp_path / 'x.yaml'}:8:5: config key 'data.partition.alpah': unknown option")
    fixed = write(tmp_path, text.replace("alpah", "alpha"), "y.yaml")
    assert error_of(fixed).startswith(f"{fixed}:11:3: config key 'algorithm.mu': Input should be")
    unknown = write(tmp_path, HEAD + "algorithm:\n  name: fedavgg\n", "z.yaml")  # a registry's error
    assert error_of(unknown).startswith(
        f"{unknown}:7:3: unknown algorithm 'fedavgg' (did you mean 'fedavg'?)"
    )


def test_error_in_a_list_item_points_at_the_item(tmp_path):
    path = write(tmp_path, HEAD + "client:\n  optimizer: adamw\n  betas:\n    - 0.9\n    - 2.0\n")
    assert error_of(path).startswith(f"{path}:10:7: config key 'client.betas.1': Input should be less than 1")


def test_required_key_left_out_points_at_its_section(tmp_path):
    path = write(tmp_path, HEAD + "  partition:\n    alpha: 0.3\n")
    assert error_of(path).startswith(f"{path}:6:3: config key 'data.partition.name' is required")


def test_a_key_set_by_an_override_names_the_override(tmp_path):
    path = write(tmp_path, HEAD + "client:\n  lr: abc\n")
    msg = error_of(path, ["client.lr=xyz"])  # the file's bad value is overridden: the override is at fault
    assert msg.startswith("--set client.lr=xyz: config key 'client.lr': Input should be a valid number")
    assert "(got 'xyz')" in msg
    msg = error_of(path, ["client={lr: 0.1, epochz: 1}"])  # a whole section set by one override
    assert msg.startswith("--set client={lr: 0.1, epochz: 1}: config key 'client.epochz': unknown key")


def test_yaml_syntax_errors_tabs_and_windows_line_ends(tmp_path):
    text = HEAD + "client:\n\tlr: 0.1\n"  # a tab cannot indent YAML
    unix = error_of(write(tmp_path, text))
    assert unix.startswith(f"{tmp_path / 'x.yaml'}:7:1: invalid YAML (found character '\\t'")
    windows = error_of(write(tmp_path, text, "w.yaml", newline="\r\n"))
    assert windows == unix.replace("x.yaml", "w.yaml")
    crlf = write(tmp_path, HEAD + "client:\n  lr: abc\n", "c.yaml", newline="\r\n")
    assert error_of(crlf).startswith(f"{crlf}:7:3: config key 'client.lr'")
    tab_value = write(tmp_path, HEAD + "client:\n  lr:\t0.1\n", "t.yaml")  # PyYAML refuses this tab too
    assert error_of(tab_value).startswith(f"{tab_value}:7:6: invalid YAML (found character '\\t'")


def test_keys_in_anchors_aliases_and_merges(tmp_path):
    # an alias used where its value is wrong: the key's line at the alias
    alias = write(tmp_path, "seed: &n 3\nrounds: 2\nclient:\n  epochs: 1\n  optimizer: *n\n")
    assert error_of(alias).startswith(f"{alias}:5:3: config key 'client.optimizer'")
    # a merged key that the section refuses: the `<<` line that brought it in
    merge = write(tmp_path, "client: &c\n  epochs: 1\n  lr: 0.05\neval:\n  every: 1\n  <<: *c\n", "m.yaml")
    assert error_of(merge).startswith(f"{merge}:6:3: config key 'eval.epochs': unknown key")
    # a key inside an anchored mapping used twice: where it is written, in the anchor
    text = (
        HEAD
        + "model:\n  name: mlp_mpfedcl\n  per_client:\n    '0-1':\n      hidden: 8\n"
        + "    '2-3': &small\n      hiddn: 16\n    '4': *small\n"
    )
    per_client = write(tmp_path, text, "p.yaml")
    assert error_of(per_client).startswith(f"{per_client}:12:7: config key 'model.per_client.2-3.hiddn'")


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    path = write(tmp_path, HEAD + "client:\n  lr: 0.1\n  epochs: 1\n  lr: 0.2\n")
    assert error_of(path) == (
        f"{path}:9:3: key 'lr' given twice in one mapping (first at line 7); YAML keys must be unique"
    )
    merged = write(tmp_path, "c: &c {lr: 0.1}\nclient:\n  <<: *c\n  lr: 0.2\n", "m.yaml")  # override: fine
    assert error_of(merged).startswith(f"{merged}:1:1: config key 'c': unknown key")


def test_an_alias_bomb_does_not_hang_the_error(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10^9 leaves
    path = write(tmp_path, HEAD + "\n".join(lines) + "\n")
    assert len(read_marked(path).marks) == MAX_MARKS  # the walk stops there instead of visiting 10^9 keys
    assert error_of(path).startswith(f"{path}:6:1: config key 'a0': unknown key")


def test_errors_without_a_key_still_name_the_file(tmp_path):
    path = write(tmp_path, "- just\n- a list\n")
    assert error_of(path) == f"{path}: config must be a mapping of sections (seed, rounds, data, model, " + (
        "algorithm, ...)"
    )
    empty = write(tmp_path, "", "e.yaml")  # an empty file is the defaults
    assert load_config(empty).rounds == 20


def test_the_cli_prints_the_place_and_exits_2(tmp_path, monkeypatch, capsys):
    from fedskew.cli import main

    path = write(tmp_path, HEAD + "client:\n  lr: abc\n")
    monkeypatch.setattr(sys, "argv", ["fedskew", "run", str(path), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:7:3: config key 'client.lr': Input should be a valid number")
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
