"""Robust rules checked per round (issue 51, item 5): a round left by drops with fewer uploads than its rule
needs for its f is skipped (server state kept, one logged line, recorded as skipped) or fails
(``defence.too_few``); in simulation, the rounds whose sampled attackers exceed the rule's f are flagged in
their records, exactly those the pre-drawn sample and the malicious set say."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from benchmarks.cli_calls import one_line, run_cli
from benchmarks.faults import faulty_fedavg, strip_record

from fedskew.algorithms.base import ALGORITHMS, LocalOutput, LocalResult, LocalStep, Payload, Upload
from fedskew.algorithms.fedavg import FedAvg
from fedskew.algorithms.security.config import malicious_clients, security_plan
from fedskew.algorithms.security.secured import TooFewUploads, check_cohort
from fedskew.algorithms.steps import RoundSkipped
from fedskew.engine.sampling import client_schedule
from fedskew.errors import ConfigError, RunFailure
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation, run_experiment
from fedskew.settings import AttackSection, DefenceSection, PrivacySection
from fedskew.testing import fingerprint
from tests.conftest import digits_config

#: Krum over 6 clients a round, f = ⌈0.15 · 6⌉ = 1: it needs 2f + 3 = 5 uploads
KRUM = {"name": "krum", "byzantine_fraction": 0.15}


def krum_config(rounds: int = 3, **defence: Any) -> dict[str, Any]:
    return digits_config(
        rounds=rounds,
        data={"dataset": "digits", "num_clients": 6, "partition": {"name": "iid"}},
        model={"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16},
        client={"epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5, "fraction": 1.0},
        engine={"mode": "sequential", "workers": 1, "on_client_error": "drop"},
        defence={**KRUM, **defence},
    )


def metrics(out: Path) -> list[dict[str, Any]]:
    return [strip_record(json.loads(x)) for x in (out / "metrics.jsonl").read_text().splitlines()]


def uploads(cids: list[int]) -> list[Upload]:
    return [Upload(c, 10, Payload({})) for c in cids]


def plan(defence: dict[str, Any], per_round: int = 10, bad: tuple[int, ...] = (0, 1, 2)) -> Any:
    attack = AttackSection(name="sign_flip", clients=list(bad))
    return security_plan(
        attack, DefenceSection(**defence), PrivacySection(), num_clients=20, per_round=per_round, rounds=3,
        seed=0,
    )  # fmt: skip


# ---------------------------------------------------------------------------- too few uploads
@pytest.mark.parametrize(("victims", "skipped"), [({0}, False), ({0, 1}, True)])
def test_a_round_left_with_too_few_uploads_is_skipped_and_the_run_goes_on(
    victims: set[int], skipped: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two clients raise in round 2 (dropped): 4 uploads < 2f + 3 = 5, so Krum's round is skipped, its server
    state that of round 1 bit for bit; one drop leaves exactly 5 (the boundary): aggregated as usual."""
    states: list[str] = []
    with faulty_fedavg("raise", victims, round_=2), caplog.at_level(logging.WARNING):
        summary = run_experiment(
            build_config(krum_config()), tmp_path / "run", on_round=lambda sim, rec: states.append(
                fingerprint(sim.server)
            ),
        )  # fmt: skip
    r1, r2, r3 = metrics(tmp_path / "run")
    assert r2["rejected"] == len(victims) and "skipped" not in r1 and "skipped" not in r3
    assert len(set(states)) == (2 if skipped else 3)  # round 3 still moves the model
    lines = [r.getMessage() for r in caplog.records if "defence.too_few" in r.getMessage()]
    if skipped:
        assert r2["skipped"] is True and "defence_selected" not in r2 and states[1] == states[0]
        assert (r2["accuracy"], r2["loss"]) == (r1["accuracy"], r1["loss"])
        assert summary["skipped_rounds"] == [2] and summary["status"] == "finished"
        assert lines == [
            "round 2: defence.name=krum needs 5 uploads (2f + 3, f = 1), the round has 4 "
            "(defence.too_few=skip); the round is skipped"
        ]
    else:
        assert "skipped" not in r2 and r2["defence_selected"] == 1 and summary["skipped_rounds"] == []
        assert lines == []


def test_fail_policy_fails_the_round_with_one_line_and_resumes(tmp_path: Path) -> None:
    """``defence.too_few: fail``: exit 1 and one line, nothing of round 2 committed; the run resumed without
    the fault ends where an uninterrupted run does."""
    reference = tmp_path / "reference"
    run_experiment(build_config(krum_config(too_few="fail")), reference)
    config, out = tmp_path / "run.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump(krum_config(too_few="fail")))
    with faulty_fedavg("raise", {2, 4}, round_=2):
        code, err = run_cli("run", str(config), "--out", str(out))
    assert code == 1 and one_line(err), err
    assert "error: round 2: defence.name=krum needs 5 uploads (2f + 3, f = 1), the round has 4; the round " \
        "was not committed (defence.too_few=fail; allowed: skip, fail)" in err  # fmt: skip
    assert [r["round"] for r in metrics(out)] == [1]
    run_experiment(build_config(krum_config(too_few="fail")), out, resume=True)
    assert metrics(out) == metrics(reference)


def test_the_fail_policy_commits_nothing_of_the_round() -> None:
    with faulty_fedavg("raise", {0, 1, 2}, round_=2):
        sim = build_simulation(build_config(krum_config(too_few="fail")))
        sim.run_round()
        before = fingerprint((sim.server, sim.history))
        with pytest.raises(TooFewUploads, match=r"^round 2: .*the round has 3; .*not committed"):
            sim.run_round()
    assert sim.round == 1 and fingerprint((sim.server, sim.history)) == before
    assert issubclass(TooFewUploads, RunFailure)  # exit code 1, the checkpoint kept (engine/policy.py)


class AlwaysDown(FedAvg):
    """FedAvg whose clients 0 and 1 raise in every round."""

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        if step.client.cid in (0, 1):
            raise RuntimeError("injected client failure")
        return super().finish_local(step, result)


def test_skipping_every_round_does_not_pass_for_a_finished_run(tmp_path: Path) -> None:
    """A sceptical user's case: the skip policy never lets a run that never aggregated end as finished (the
    skipped rounds count against ``engine.max_skipped_share``), and the model never moved."""
    states: list[str] = []
    with ALGORITHMS.replaced("fedavg", AlwaysDown):
        summary = run_experiment(
            build_config(krum_config(rounds=2)), tmp_path / "run", on_round=lambda sim, rec: states.append(
                fingerprint(sim.server)
            ),
        )  # fmt: skip
    assert summary["status"] == "failed" and summary["skipped_rounds"] == [1, 2]
    assert summary["rounds_without_update"] == 2 and len(set(states)) == 1


@pytest.mark.parametrize(
    ("defence", "need"),
    [
        ({"name": "krum", "byzantine_fraction": 0.3}, 9),  # f = ⌈0.3 · 10⌉ = 3: 2f + 3
        ({"name": "multi_krum", "byzantine_fraction": 0.3}, 9),
        ({"name": "median", "byzantine_fraction": 0.3}, 7),  # 2f + 1
        ({"name": "bulyan", "byzantine_fraction": 0.1}, 7),  # f = 1: 4f + 3
    ],
)
def test_each_rule_needs_its_own_minimum_per_round(defence: dict[str, Any], need: int) -> None:
    """Adversarial inputs straight to the check: one upload short of the minimum skips (or fails), exactly
    the minimum passes; the rule itself never sees a cohort it cannot handle (Krum, Bulyan raised before)."""
    assert check_cohort(plan(defence), uploads(list(range(3, 3 + need))), 1) == {}  # no attacker sampled
    with pytest.raises(RoundSkipped, match=rf"needs {need} uploads .*the round has {need - 1} "):
        check_cohort(plan(defence), uploads(list(range(3, 2 + need))), 1)
    with pytest.raises(TooFewUploads, match=rf"^round 4: defence.name={defence['name']} needs {need} "):
        check_cohort(plan({**defence, "too_few": "fail"}), uploads(list(range(3, 2 + need))), 4)


def test_rules_without_a_minimum_never_skip() -> None:
    for name in ("trimmed_mean", "geomed", "norm_bound"):
        extra = {"max_norm": 1.0} if name == "norm_bound" else {}
        assert check_cohort(plan({"name": name, **extra}), uploads([7]), 1) == {}


def test_a_bad_too_few_value_is_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        build_config(krum_config(too_few="ignore"))
    message = str(err.value)
    assert "\n" not in message and "defence.too_few" in message and "'skip' or 'fail'" in message


# ---------------------------------------------------------------------------- attackers over f
def test_attackers_over_f_are_flagged_in_exactly_the_rounds_the_sample_says(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """20 clients, half a round, 30 % sign-flippers, Krum with f = 3: the flag (and the count) appear exactly
    in the rounds whose sampled attackers exceed 3, computed from the run's pre-drawn schedule and malicious
    set; an attacker dropped in such a round (it raised) is not counted, so that round is not flagged."""
    raw = digits_config(
        seed=2, rounds=6,
        data={"dataset": "digits", "num_clients": 20, "partition": {"name": "iid"}},
        model={"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16},
        client={"epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5, "fraction": 0.5},
        engine={"mode": "sequential", "workers": 1, "on_client_error": "drop"},
        attack={"name": "sign_flip", "fraction": 0.3}, defence={"name": "krum"},
    )  # fmt: skip
    cfg = build_config(raw)
    bad = malicious_clients(cfg.attack, 20, cfg.seed)
    rows = [[int(c) for c in row] for row in client_schedule(20, 0.5, 6, cfg.seed, cfg.privacy)]
    sampled = [sorted(set(row) & bad) for row in rows]
    over = [r for r in range(1, 7) if len(sampled[r - 1]) > 3]
    assert 2 <= len(over) < 6  # the case tells flagged rounds from the others
    dropped_round = over[0]  # one attacker of this round raises: 3 attackers left, not over f
    victim = sampled[dropped_round - 1][0]
    with faulty_fedavg("raise", {victim}, round_=dropped_round), caplog.at_level(logging.WARNING):
        run_experiment(cfg, tmp_path / "run")
    accepted = {r: len(sampled[r - 1]) - (r == dropped_round) for r in range(1, 7)}
    expected = {r: k for r, k in accepted.items() if k > 3}
    assert dropped_round not in expected  # the drop took this round back to f
    records = metrics(tmp_path / "run")
    flagged = {rec["round"]: rec["attackers"] for rec in records if rec.get("attackers_over_f") is True}
    assert flagged == expected and expected
    assert all("attackers" not in rec for rec in records if rec["round"] not in expected)
    lines = [r.getMessage() for r in caplog.records if "malicious uploads" in r.getMessage()]
    assert lines == [
        f"round {r}: {k} malicious uploads of 10 exceed the 3 defence.name=krum tolerates (simulation: the "
        "attackers are known)"
        for r, k in expected.items()
    ]


def test_trimmed_mean_tolerates_what_it_trims_of_the_round_it_got() -> None:
    """β = 0.2 trims ⌊0.2 n⌋ at each end: 2 attackers among 10 uploads are covered, among 9 (a drop) not."""
    p = plan({"name": "trimmed_mean", "beta": 0.2}, bad=(0, 1))
    assert check_cohort(p, uploads(list(range(10))), 1) == {}
    assert check_cohort(p, uploads(list(range(9))), 2) == {"attackers_over_f": True, "attackers": 2}


def test_no_flag_without_an_attack_or_a_stated_tolerance() -> None:
    quiet = security_plan(
        AttackSection(), DefenceSection(name="krum", byzantine_fraction=0.1), PrivacySection(),
        num_clients=20, per_round=10, rounds=3, seed=0,
    )  # fmt: skip
    assert check_cohort(quiet, uploads(list(range(10))), 1) == {}
    # geomed states no bound: all ten uploads malicious, nothing to compare them with
    assert check_cohort(plan({"name": "geomed"}, bad=tuple(range(10))), uploads(list(range(10))), 1) == {}
